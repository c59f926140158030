// ArrayRegistry's sharded input pipelines: opened on every worker, and the checks a fed run's
// arguments pass before any worker runs it.
#include <numeric>

#include "absl/strings/str_cat.h"
#include "core/sharding/named_sharding.h"
#include "net/grpc_util.h"
#include "server/array_registry.h"

namespace meshrun {

absl::StatusOr<v1::InputInfo> ArrayRegistry::OpenInput(const v1::InputSpec& spec, std::string id) {
  absl::StatusOr<StubsRef> stubs = EnsureStubs();
  if (!stubs.ok()) return stubs.status();
  {
    absl::MutexLock lock(&mu_);
    if (id.empty()) id = absl::StrCat("input-", next_id_++);
  }
  std::vector<int> ranks(workers_->expected());
  std::iota(ranks.begin(), ranks.end(), 0);
  std::vector<v1::OpenInputPipelineResponse> opened(ranks.size());
  absl::Status s = ForRanks(ranks, [&](int r, grpc::ClientContext* ctx) {
    v1::OpenInputPipelineRequest req;
    req.set_input_id(id);
    *req.mutable_spec() = spec;
    return (**stubs)[r]->OpenInputPipeline(ctx, req, &opened[r]);
  });
  if (!s.ok()) {
    CloseOnWorkers(**stubs, id);
    return s;
  }
  // Every worker must see the same dataset: the global order is defined on its examples.
  for (size_t r = 1; r < opened.size(); ++r) {
    if (opened[r].info().num_examples() != opened[0].info().num_examples()) {
      CloseOnWorkers(**stubs, id);
      return absl::FailedPreconditionError(
          absl::StrCat("the dataset at ", spec.path(), " has ", opened[r].info().num_examples(),
                       " examples on worker ", workers_->Describe(static_cast<int>(r)), " but ",
                       opened[0].info().num_examples(), " on worker ", workers_->Describe(0),
                       ": every worker must see the same files"));
    }
  }
  absl::MutexLock lock(&mu_);
  inputs_[id] = opened[0].info();
  return opened[0].info();
}

void ArrayRegistry::CloseOnWorkers(const Stubs& stubs, const std::string& id) {
  std::vector<int> ranks(workers_->expected());
  std::iota(ranks.begin(), ranks.end(), 0);
  ForRanks(ranks, [&](int r, grpc::ClientContext* ctx) {
    v1::CloseInputPipelineRequest req;
    req.set_input_id(id);
    v1::CloseInputPipelineResponse resp;
    grpc::Status s = stubs[r]->CloseInputPipeline(ctx, req, &resp);
    return s.error_code() == grpc::NOT_FOUND ? grpc::Status::OK : s;
  }).IgnoreError();
}

absl::Status ArrayRegistry::CloseInput(const std::string& id) {
  {
    absl::MutexLock lock(&mu_);
    if (inputs_.erase(id) == 0) {
      return absl::NotFoundError(absl::StrCat("no input '", id, "' is open on this cluster"));
    }
  }
  absl::StatusOr<StubsRef> stubs = EnsureStubs();
  if (!stubs.ok()) return stubs.status();
  CloseOnWorkers(**stubs, id);
  return absl::OkStatus();
}

absl::Status ArrayRegistry::CheckFeed(const v1::ShardMapRequest& request) {
  const v1::InputFeed& feed = request.feed();
  if (feed.argnums_size() == 0) return absl::OkStatus();
  const v1::ShardMapProgram& p = request.program();
  v1::InputInfo info;
  {
    absl::MutexLock lock(&mu_);
    auto it = inputs_.find(feed.input_id());
    if (it == inputs_.end()) {
      return absl::NotFoundError(
          absl::StrCat("feed: no input '", feed.input_id(), "' is open on this cluster"));
    }
    info = it->second;
  }
  const v1::InputSpec& spec = info.spec();
  if (feed.argnums_size() != spec.fields_size()) {
    return absl::InvalidArgumentError(absl::StrCat("feed: input '", feed.input_id(), "' has ",
                                                   spec.fields_size(), " fields; ",
                                                   feed.argnums_size(), " argnums given"));
  }
  const int runs = 1 + request.more_runs_size();
  if (feed.step() < 0 || (info.num_steps() >= 0 && feed.step() + runs > info.num_steps())) {
    return absl::OutOfRangeError(absl::StrCat("feed: steps ", feed.step(), "..",
                                              feed.step() + runs - 1, " of input '",
                                              feed.input_id(), "', which has ", info.num_steps()));
  }
  std::map<std::string, const v1::BufferDecl*> buffers;
  for (const auto& b : p.program().buffers()) buffers[b.name()] = &b;
  const std::set<int> donated(request.donate_argnums().begin(), request.donate_argnums().end());
  for (int j = 0; j < feed.argnums_size(); ++j) {
    const int a = feed.argnums(j);
    const v1::InputFieldSpec& f = spec.fields(j);
    if (a < 0 || a >= p.inputs_size() || donated.count(a)) {
      return absl::InvalidArgumentError(absl::StrCat("feed argnums: ", a,
                                                     " is not an argument index (0..",
                                                     p.inputs_size() - 1, ") or is donated"));
    }
    const std::string what = absl::StrCat("argument ", a, " (fed from field '", f.field(), "')");
    for (int k = 0; k < runs; ++k) {
      const auto& ids = k == 0 ? request.input_ids() : request.more_runs(k - 1).input_ids();
      if (a < ids.size() && !ids[a].empty()) {
        return absl::InvalidArgumentError(absl::StrCat(what, " is also given array '", ids[a],
                                                       "': a fed argument's id must be empty"));
      }
    }
    const PartitionSpec want = PartitionSpec::FromProto(f.spec());
    const PartitionSpec have = PartitionSpec::FromProto(p.in_specs(a));
    const Dims global(f.global_shape().dims().begin(), f.global_shape().dims().end());
    const v1::BufferDecl* b = buffers[p.inputs(a)];
    const Dims local = NamedSharding(workers_->mesh(), want).ShardDims(global);
    if (b == nullptr || have != want || b->dtype() != f.dtype() ||
        Dims(b->shape().dims().begin(), b->shape().dims().end()) != local) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": the program takes ", b == nullptr ? "?" : DTypeName(b->dtype()),
          b == nullptr ? ""
                       : DimsToString(Dims(b->shape().dims().begin(), b->shape().dims().end())),
          " blocks laid out as ", have.ToString(), "; the input gives ", DTypeName(f.dtype()),
          DimsToString(local), " blocks of ", DimsToString(global), " laid out as ",
          want.ToString()));
    }
  }
  return absl::OkStatus();
}

}  // namespace meshrun
