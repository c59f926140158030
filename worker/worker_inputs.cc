// WorkerService's sharded input pipelines (core/data/input_pipeline.h): opening one per
// OpenInput, and binding a run's fed arguments to this rank's blocks of the step's batch.
#include "absl/strings/str_cat.h"
#include "worker/worker_service.h"

namespace meshrun {

absl::StatusOr<std::shared_ptr<const Dataset>> WorkerService::OpenDataset(
    const v1::InputSpec& spec) {
  // IDX files are gzip streams decompressed whole: the few a worker reads are kept (a job's
  // train and test splits, reopened by the next job). .npy files are mapped, so opening them is
  // cheap, and reopening them sees files rewritten in between.
  const std::string key = absl::StrCat(spec.format(), ":", spec.path(), ":", spec.split());
  if (spec.format() == "idx") {
    absl::MutexLock lock(&input_mu_);
    auto it = idx_datasets_.find(key);
    if (it != idx_datasets_.end()) return it->second;
  }
  absl::StatusOr<std::unique_ptr<Dataset>> opened =
      Dataset::Open(spec.format(), spec.path(), spec.split());
  if (!opened.ok()) return opened.status();
  std::shared_ptr<const Dataset> ds(*std::move(opened));
  if (spec.format() == "idx") {
    absl::MutexLock lock(&input_mu_);
    constexpr size_t kMaxCachedIdx = 4;
    if (idx_datasets_.size() >= kMaxCachedIdx) idx_datasets_.erase(idx_datasets_.begin());
    idx_datasets_[key] = ds;
  }
  return ds;
}

grpc::Status WorkerService::OpenInputPipeline(grpc::ServerContext*,
                                              const v1::OpenInputPipelineRequest* req,
                                              v1::OpenInputPipelineResponse* resp) {
  absl::StatusOr<Membership> m = JoinedMembership();
  if (!m.ok()) return Error(m.status());
  if (req->input_id().empty()) return Error(absl::InvalidArgumentError("OpenInput: empty id"));
  absl::StatusOr<InputPipelineOptions> options =
      InputOptionsFromProto(req->spec(), m->mesh, m->rank);
  if (!options.ok()) return Error(options.status());
  const int prefetch = options->prefetch;
  absl::StatusOr<std::shared_ptr<const Dataset>> ds = OpenDataset(req->spec());
  if (!ds.ok()) return Error(ds.status());
  absl::StatusOr<std::unique_ptr<InputPipeline>> pipeline =
      InputPipeline::Create(*ds, *std::move(options));
  if (!pipeline.ok()) return Error(pipeline.status());
  // The batches in flight: the one a step binds and the prefetched ones.
  if (absl::Status s = CheckMemoryBudget(absl::StrCat("input '", req->input_id(), "''s batches"),
                                         (*pipeline)->step_bytes() * (prefetch + 1));
      !s.ok()) {
    return Error(s);
  }
  v1::InputInfo* info = resp->mutable_info();
  info->set_id(req->input_id());
  *info->mutable_spec() = req->spec();
  info->set_num_examples((*pipeline)->num_examples());
  info->set_steps_per_epoch((*pipeline)->steps_per_epoch());
  info->set_num_steps((*pipeline)->num_steps());
  absl::MutexLock lock(&input_mu_);
  inputs_[req->input_id()] = std::shared_ptr<InputPipeline>(*std::move(pipeline));
  return grpc::Status::OK;
}

grpc::Status WorkerService::CloseInputPipeline(grpc::ServerContext*,
                                               const v1::CloseInputPipelineRequest* req,
                                               v1::CloseInputPipelineResponse*) {
  absl::MutexLock lock(&input_mu_);
  if (inputs_.erase(req->input_id()) == 0) {
    return Error(absl::NotFoundError(absl::StrCat("input '", req->input_id(), "' is not open")));
  }
  return grpc::Status::OK;
}

absl::StatusOr<std::vector<Tensor>> WorkerService::FeedBlocks(const v1::InputFeed& feed, int run) {
  std::shared_ptr<InputPipeline> pipeline;
  {
    absl::MutexLock lock(&input_mu_);
    auto it = inputs_.find(feed.input_id());
    if (it == inputs_.end()) {
      return absl::NotFoundError(absl::StrCat("input '", feed.input_id(), "' is not open"));
    }
    pipeline = it->second;
  }
  if (static_cast<size_t>(feed.argnums_size()) != pipeline->block_dims().size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the feed of input '", feed.input_id(), "' binds ", feed.argnums_size(),
                     " arguments; the pipeline has ", pipeline->block_dims().size(), " fields"));
  }
  const int64_t before = pipeline->bytes_read();
  absl::StatusOr<std::vector<Tensor>> blocks = pipeline->Next(feed.step() + run);
  // Only this call takes from this pipeline (RunShardMap runs one at a time).
  if (metrics_ != nullptr) metrics_->OnInputBytes(pipeline->bytes_read() - before);
  return blocks;
}

}  // namespace meshrun
