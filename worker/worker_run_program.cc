// WorkerService::RunProgram and its steps: checking a RunShardMap request, binding its arguments,
// running the program (once, or steps_per_call times) and storing or returning its results. The
// rest of the service is in worker_service.cc.
#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "worker/worker_service.h"

namespace meshrun {
namespace {

// Whether the two arrays' bytes overlap (one aliases the other's storage, or a part of it).
bool SharesMemory(const Tensor& a, const Tensor& b) {
  const char* pa = static_cast<const char*>(a.raw());
  const char* pb = static_cast<const char*>(b.raw());
  if (pa == nullptr || pb == nullptr || a.size_bytes() == 0 || b.size_bytes() == 0) return false;
  return pa < pb + b.size_bytes() && pb < pa + a.size_bytes();
}

}  // namespace

struct WorkerService::RunPlan {
  const v1::RunShardMapRequest* req;
  CachedExecutor* cached;
  std::set<int> returned;  // results returned in the response rather than stored
  std::set<int> donated;   // donate_argnums
  std::vector<int> fed;    // argument -> its field of the feed; -1: an array id
};

namespace {

// Checks `req`'s result and argument indices against `p`. Errors: InvalidArgument naming the
// index and the range expected.
absl::Status CheckRunRequest(const v1::ShardMapProgram& p, const v1::RunShardMapRequest& req) {
  if (p.inputs_size() != req.input_ids_size() || p.outputs_size() != req.output_ids_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("program takes ", p.inputs_size(), " arguments and returns ", p.outputs_size(),
                     "; got ", req.input_ids_size(), " and ", req.output_ids_size(), " array ids"));
  }
  for (int i : req.return_outputs()) {
    if (i < 0 || i >= p.outputs_size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "return_outputs: ", i, " is not a result index (0..", p.outputs_size() - 1, ")"));
    }
  }
  std::set<int> seen;
  for (int a : req.feed().argnums()) {
    if (a < 0 || a >= p.inputs_size() || !seen.insert(a).second) {
      return absl::InvalidArgumentError(absl::StrCat("feed argnums: ", a,
                                                     " is not an argument index (0..",
                                                     p.inputs_size() - 1, ") or is given twice"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

grpc::Status WorkerService::RunProgram(const v1::RunShardMapRequest* req,
                                       v1::RunShardMapResponse* resp) {
  SetComputeThreads(compute_threads_);
  absl::StatusOr<CachedExecutor*> found = ExecutorFor(*req);
  if (!found.ok()) return Error(found.status());
  const v1::ShardMapProgram& p = (*found)->program;
  if (absl::Status s = CheckRunRequest(p, *req); !s.ok()) return Error(s);
  RunPlan plan{req,
               *found,
               {req->return_outputs().begin(), req->return_outputs().end()},
               {req->donate_argnums().begin(), req->donate_argnums().end()},
               std::vector<int>(p.inputs_size(), -1)};
  for (int j = 0; j < req->feed().argnums_size(); ++j) plan.fed[req->feed().argnums(j)] = j;
  // Keras's steps_per_execution: the runs go back to back, each over the arrays the one before
  // left (a TrainState's donated ids are its results' ids).
  for (int k = 0; k <= req->more_runs_size(); ++k) {
    absl::Status s =
        RunOnce(plan, k == 0 ? req->input_ids() : req->more_runs(k - 1).input_ids(), k, resp);
    if (!s.ok()) {
      AbortEpoch(s);  // peers may be waiting in a collective this rank never reached
      return Error(
          req->more_runs_size() == 0
              ? s
              : absl::Status(s.code(), absl::StrCat("run ", k, " of ", req->more_runs_size() + 1,
                                                    ": ", s.message())));
    }
  }
  return grpc::Status::OK;
}

absl::Status WorkerService::RunOnce(const RunPlan& plan,
                                    const google::protobuf::RepeatedPtrField<std::string>& ids,
                                    int k, v1::RunShardMapResponse* resp) {
  const v1::ShardMapProgram& p = plan.cached->program;
  Executor& executor = *plan.cached->executor;
  if (ids.size() != p.inputs_size()) {
    return absl::InvalidArgumentError(absl::StrCat("program takes ", p.inputs_size(),
                                                   " arguments; got ", ids.size(), " array ids"));
  }
  std::vector<Tensor> blocks;  // bound below: alive until the run ends
  // Arguments that stay in the store: a result sharing their memory (one returned as is, or a
  // view of one) is stored as a copy, so that donating either later never writes over the other.
  std::vector<std::shared_ptr<const Tensor>> kept;
  if (absl::Status s = BindArguments(plan, ids, k, blocks, kept); !s.ok()) return s;
  const absl::Time start = absl::Now();
  const absl::Duration collective_before = executor.collective_time();
  if (absl::Status s = executor.Run("main", RunContext{}); !s.ok()) {
    // Recompiled on the next call, from a clean state.
    executors_.erase(executors_.begin() + (plan.cached - executors_.data()));
    return s;
  }
  resp->add_run_seconds(absl::ToDoubleSeconds(absl::Now() - start));
  resp->add_collective_seconds(
      absl::ToDoubleSeconds(executor.collective_time() - collective_before));
  for (const Executor::Arrival& a : executor.TakeArrivals()) {
    if (resp->arrivals_size() >= static_cast<int>(Executor::kMaxArrivals)) break;
    v1::CollectiveArrival* out = resp->add_arrivals();
    out->set_run(k);
    out->set_index(a.index);
    out->set_op(*a.op);
    out->set_axes(*a.axes);
    out->set_unix_micros(absl::ToUnixMicros(a.when));
  }
  if (plan.req->train_steps() && metrics_ != nullptr) metrics_->OnStep();
  return StoreResults(plan, ids, kept, resp);
}

absl::Status WorkerService::BindArguments(
    const RunPlan& plan, const google::protobuf::RepeatedPtrField<std::string>& ids, int k,
    std::vector<Tensor>& blocks, std::vector<std::shared_ptr<const Tensor>>& kept) {
  const v1::RunShardMapRequest& req = *plan.req;
  const v1::ShardMapProgram& p = plan.cached->program;
  Executor& executor = *plan.cached->executor;
  if (req.feed().argnums_size() > 0) {
    absl::StatusOr<std::vector<Tensor>> b = FeedBlocks(req.feed(), k);
    if (!b.ok()) return b.status();
    blocks = *std::move(b);
  }
  for (int i = 0; i < p.inputs_size(); ++i) {
    if (plan.fed[i] >= 0) {
      if (absl::Status s = executor.BindInput(p.inputs(i), blocks[plan.fed[i]], true); !s.ok()) {
        return absl::Status(s.code(), absl::StrCat("argument ", i, " (fed from input '",
                                                   req.feed().input_id(), "'): ", s.message()));
      }
      continue;
    }
    // A donated argument leaves the store; if no one else holds it (a concurrent GetShard), the
    // program may write its results over it. Passed twice or returned as is, it is only read.
    const bool donate = plan.donated.count(i) && std::count(ids.begin(), ids.end(), ids[i]) == 1 &&
                        std::count(p.outputs().begin(), p.outputs().end(), p.inputs(i)) == 0;
    absl::StatusOr<std::shared_ptr<const Tensor>> shard =
        donate ? shards_.Take(ids[i]) : shards_.Get(ids[i]);
    if (!shard.ok()) return shard.status();
    const bool sole_owner = shard->use_count() == 1;
    if (!(donate && sole_owner)) kept.push_back(*shard);
    if (absl::Status s = executor.BindInput(p.inputs(i), **shard, donate && sole_owner); !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("argument ", i, " (array '", ids[i], "'): ", s.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status WorkerService::StoreResults(const RunPlan& plan,
                                         const google::protobuf::RepeatedPtrField<std::string>& ids,
                                         const std::vector<std::shared_ptr<const Tensor>>& kept,
                                         v1::RunShardMapResponse* resp) {
  const v1::RunShardMapRequest& req = *plan.req;
  const v1::ShardMapProgram& p = plan.cached->program;
  Executor& executor = *plan.cached->executor;
  for (int i : req.return_outputs()) {
    absl::StatusOr<Tensor> result = executor.TakeOutput(p.outputs(i));
    if (!result.ok()) return result.status();
    *resp->add_outputs() = result->ToProto();
  }
  for (int i = 0; i < p.outputs_size(); ++i) {
    if (plan.returned.count(i)) continue;
    absl::StatusOr<Tensor> result = executor.TakeOutput(p.outputs(i));
    if (!result.ok()) return result.status();
    const bool shares = std::any_of(kept.begin(), kept.end(),
                                    [&](const auto& arg) { return SharesMemory(*arg, *result); });
    shards_.Put(req.output_ids(i), shares ? Tensor(*result) : *std::move(result));
  }
  // As jax.jit's donation, a donated argument is consumed, also where it was only read (passed
  // twice, returned as is): its id lives on only as a stored result's.
  for (int i : plan.donated) {
    if (i < 0 || i >= ids.size() || plan.fed[i] >= 0) continue;
    bool replaced = false;
    for (int j = 0; j < p.outputs_size(); ++j)
      replaced |= !plan.returned.count(j) && req.output_ids(j) == ids[i];
    if (!replaced) shards_.Delete(ids[i]).IgnoreError();  // NotFound: taken when bound
  }
  return absl::OkStatus();
}

}  // namespace meshrun
