// ArrayRegistry::ShardMap: the program run on every worker (the others aborted as soon as one
// fails), and its results registered or returned (the request's checks: array_registry_args.cc).
#include <numeric>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/sharding/shard_layout.h"
#include "net/grpc_util.h"
#include "server/array_registry.h"
#include "server/straggler_ledger.h"

namespace meshrun {

absl::StatusOr<v1::ShardMapResponse> ArrayRegistry::ShardMap(const v1::ShardMapRequest& request,
                                                             const std::atomic<bool>* cancel) {
  std::string serialized;
  if (!request.program().SerializeToString(&serialized))
    return absl::InvalidArgumentError("the shard_map program does not serialize");
  return ShardMap(request.program(), serialized, request, cancel);
}

absl::StatusOr<v1::ShardMapResponse> ArrayRegistry::ShardMap(const v1::ShardMapProgram& p,
                                                             const std::string& serialized,
                                                             const v1::ShardMapRequest& request,
                                                             const std::atomic<bool>* cancel) {
  if (absl::Status s = CheckShardMapArguments(p, request); !s.ok()) return s;
  absl::StatusOr<std::vector<v1::ArrayInfo>> infos = ResultInfos(p);
  if (!infos.ok()) return infos.status();
  std::vector<v1::ArrayInfo>& outputs = *infos;
  std::set<std::string> donated;
  std::set<int> fetched;
  if (absl::Status s = AssignResultIds(p, request, outputs, donated, fetched); !s.ok()) return s;
  absl::StatusOr<StubsRef> stubs = EnsureStubs();
  if (!stubs.ok()) return stubs.status();
  v1::RunShardMapRequest run;
  run.set_program(serialized);
  for (const auto& id : request.input_ids()) run.add_input_ids(id);
  for (const auto& o : outputs) run.add_output_ids(o.id());
  run.set_collective_timeout_seconds(request.collective_timeout_seconds());
  *run.mutable_donate_argnums() = request.donate_argnums();
  *run.mutable_more_runs() = request.more_runs();
  *run.mutable_feed() = request.feed();
  run.set_train_steps(request.train_steps());
  // One run on the workers at a time, whichever client or job it comes from: each worker runs
  // programs in the order they arrive, so two runs sent at once could reach the ranks in
  // different orders and wait on each other's collectives. Later runs queue here.
  absl::MutexLock run_lock(&run_mu_);
  const uint64_t epoch = workers_->collective_epoch();
  run.set_epoch(epoch);
  std::vector<int> ranks(workers_->expected());
  std::iota(ranks.begin(), ranks.end(), 0);
  // A fetched result comes back from one holder of each of its blocks (the lowest rank).
  std::vector<v1::RunShardMapRequest> runs(ranks.size(), run);
  std::vector<std::vector<int>> returned_by(ranks.size());  // rank -> fetch_outputs positions
  for (int f = 0; f < request.fetch_outputs_size(); ++f) {
    const v1::ArrayInfo& info = outputs[request.fetch_outputs(f)];
    absl::StatusOr<NamedSharding> sharding = NamedSharding::FromProto(info.sharding());
    if (!sharding.ok()) return sharding.status();
    for (const auto& holders :
         BlockHolders(Dims(info.shape().dims().begin(), info.shape().dims().end()), *sharding)) {
      runs[holders.front()].add_return_outputs(request.fetch_outputs(f));
      returned_by[holders.front()].push_back(f);
    }
  }
  WorkerRun done = RunOnWorkers(**stubs, runs, request, epoch, cancel);
  absl::Status s = RunStatus(done, request);
  if (!s.ok()) {
    // What the failed run's collectives left in flight is dropped by every worker before its
    // next one.
    workers_->AdvanceCollectiveEpoch();
    // Whatever some workers kept of the run (results stored under their ids, donated arguments
    // a worker refused the run before taking) is dropped everywhere: nothing registers them.
    std::vector<std::string> dropped(donated.begin(), donated.end());
    for (int i = 0; i < p.outputs_size(); ++i)
      if (!fetched.count(i) && !donated.count(outputs[i].id())) dropped.push_back(outputs[i].id());
    if (!dropped.empty()) DropOnWorkers(**stubs, dropped).IgnoreError();
    if (!donated.empty()) {
      // As with jax.jit's donation, the donated arrays are consumed: some workers may already hold
      // their results under those ids, so none of them is readable any more.
      absl::MutexLock lock(&mu_);
      for (const auto& id : donated) arrays_.erase(id);
      s = absl::Status(s.code(), absl::StrCat(s.message(), "; the donated arrays (",
                                              absl::StrJoin(donated, ", "), ") are consumed"));
    }
    return s;
  }
  if (metrics_ != nullptr) {
    for (const CollectiveSkew& k : ArrivalSkews(workers_->mesh(), done.responses))
      metrics_->OnCollectiveSkew(k.op, k.axes, k.seconds, k.late_rank);
  }
  v1::ShardMapResponse response;
  if (absl::Status r = AddFetched(request, outputs, returned_by, done, response); !r.ok()) return r;
  absl::MutexLock lock(&mu_);
  // The donated arrays are consumed, as jax.jit's: the workers dropped their blocks. A result that
  // took a donated argument's id is registered again under it below.
  for (const std::string& id : donated) arrays_.erase(id);
  for (int i = 0; i < p.outputs_size(); ++i) {
    if (fetched.count(i)) continue;
    arrays_[outputs[i].id()] = outputs[i];
    *response.add_outputs() = outputs[i];
  }
  return response;
}

ArrayRegistry::WorkerRun ArrayRegistry::RunOnWorkers(
    const Stubs& stubs, const std::vector<v1::RunShardMapRequest>& runs,
    const v1::ShardMapRequest& request, uint64_t epoch, const std::atomic<bool>* cancel) {
  std::vector<int> ranks(runs.size());
  std::iota(ranks.begin(), ranks.end(), 0);
  WorkerRun run;
  run.results.resize(ranks.size());
  run.responses.resize(ranks.size());
  run.after_abort.assign(ranks.size(), 0);
  // Every worker runs the program; the first to fail has the others aborted at once, rather than
  // leaving them waiting in a collective for its deadline. The calls go out together through
  // gRPC's callback API (no thread per worker on the step's critical path).
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  absl::Mutex done_mu;
  size_t pending = ranks.size();
  int first_failed = -1;  // the rank whose failure aborts the others
  bool aborted = false;
  // A collective deadline: the others' deadlines follow within their arrival skew, so the abort
  // waits a little for them, and the ranks that then have not timed out are the ones that had not
  // arrived (the straggler ledger's view of a deadline).
  absl::Time abort_after = absl::InfinitePast();
  for (int r : ranks) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    SetTimeout(*contexts.back(), rpc_timeout_ * (1 + request.more_runs_size()));
    stubs[r]->async()->RunShardMap(
        contexts.back().get(), &runs[r], &run.responses[r], [&, r](grpc::Status status) {
          absl::MutexLock lock(&done_mu);
          run.results[r] = std::move(status);
          run.after_abort[r] = aborted;
          if (!run.results[r].ok() && run.results[r].error_code() != grpc::ABORTED && !aborted &&
              first_failed < 0) {
            first_failed = r;
            if (run.results[r].error_code() == grpc::DEADLINE_EXCEEDED)
              abort_after = absl::Now() + absl::Milliseconds(500);
          }
          --pending;
        });
  }
  {
    absl::MutexLock lock(&done_mu);
    auto settled_or_failed = [&]() ABSL_SHARED_LOCKS_REQUIRED(done_mu) {
      return pending == 0 || (first_failed >= 0 && !aborted && absl::Now() >= abort_after);
    };
    // Watching heartbeats: a dead or stopped worker fails the run within heartbeat_timeout.
    AwaitWatchingWorkers(done_mu, settled_or_failed,
                         [&](const DeadWorkers& dead) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                           if (cancel != nullptr && cancel->load()) {
                             run.cancelled = true;
                             return true;
                           }
                           if (dead.empty()) return false;
                           run.dead_rank = dead.front().first;
                           run.dead_why = dead.front().second;
                           first_failed = run.dead_rank;
                           contexts[run.dead_rank]->TryCancel();
                           return true;
                         });
    if (pending > 0) {
      aborted = true;
      const int failed_rank = first_failed;
      done_mu.Unlock();
      for (int q : ranks) {
        if (q == failed_rank) continue;
        grpc::ClientContext actx;
        SetTimeout(actx, absl::Seconds(2));
        v1::AbortRequest areq;
        areq.set_reason(run.cancelled ? std::string("the run was cancelled: its client left")
                        : run.dead_rank >= 0
                            ? absl::StrCat("worker ", workers_->Describe(run.dead_rank), " ",
                                           run.dead_why, " (died or hung)")
                            : absl::StrCat("shard_map failed on rank ", failed_rank));
        areq.set_epoch(epoch);
        v1::AbortResponse aresp;
        stubs[q]->Abort(&actx, areq, &aresp);
      }
      done_mu.Lock();
      auto settled = [&]() ABSL_SHARED_LOCKS_REQUIRED(done_mu) { return pending == 0; };
      done_mu.Await(absl::Condition(&settled));
    }
  }
  return run;
}

absl::Status ArrayRegistry::RunStatus(const WorkerRun& run, const v1::ShardMapRequest& request) {
  std::vector<int> ranks(run.results.size());
  std::iota(ranks.begin(), ranks.end(), 0);
  // Ranks whose own program failed never reached the collectives the others waited in; ranks that
  // timed out or were aborted did arrive.
  std::vector<int> failed, timed_out;
  for (int r : ranks) {
    const grpc::StatusCode code = run.results[r].error_code();
    if (code == grpc::DEADLINE_EXCEEDED) timed_out.push_back(r);
    const bool consequence = code == grpc::UNAVAILABLE && run.after_abort[r];
    if (code != grpc::OK && code != grpc::ABORTED && code != grpc::DEADLINE_EXCEEDED &&
        !consequence)
      failed.push_back(r);
  }
  absl::Status s;
  const auto unreachable = [&](int r) {
    return run.results[r].error_code() == grpc::UNAVAILABLE &&
           !absl::StartsWith(run.results[r].error_message(), "rank ") && !run.after_abort[r];
  };
  const auto dead_or_unreachable =
      std::find_if(failed.begin(), failed.end(), [&](int r) { return unreachable(r); });
  if (run.dead_rank >= 0) {
    s = absl::UnavailableError(absl::StrCat("worker ", workers_->Describe(run.dead_rank), " ",
                                            run.dead_why, " during the run (died or hung)"));
  } else if (dead_or_unreachable != failed.end()) {
    const int r = *dead_or_unreachable;
    s = absl::UnavailableError(
        absl::StrCat("worker ", workers_->Describe(r),
                     " is unreachable (process died?): ", run.results[r].error_message()));
  } else if (!failed.empty()) {
    const grpc::Status& first = run.results[failed.front()];
    s = absl::Status(static_cast<absl::StatusCode>(first.error_code()),
                     absl::StrCat("shard_map failed on ", failed.size() == 1 ? "rank " : "ranks ",
                                  absl::StrJoin(failed, ", "),
                                  failed.size() < ranks.size() ? " (the other ranks were "
                                                                 "aborted in their collectives)"
                                                               : "",
                                  ": ", first.error_message()));
  } else if (!timed_out.empty()) {
    // Each message names the rank its collective waited for (a hung or unreachable worker).
    // The straggler ledger's view of a deadline: who never arrived, and how long the others
    // waited for them.
    std::vector<int> absent;
    for (int r : ranks) {
      if (run.after_abort[r] && run.results[r].error_code() != grpc::DEADLINE_EXCEEDED)
        absent.push_back(r);
    }
    const double waited = request.collective_timeout_seconds() > 0
                              ? request.collective_timeout_seconds()
                              : 30.0;  // the workers' default
    s = absl::DeadlineExceededError(absl::StrCat(
        "shard_map timed out: ranks ", absl::StrJoin(timed_out, ", "), " waited ", waited,
        " s in a collective",
        absent.empty()
            ? ""
            : absl::StrCat(" for ranks ", absl::StrJoin(absent, ", "), ", which had not arrived"),
        "; rank ", timed_out.front(), ": ", run.results[timed_out.front()].error_message(),
        // Where the first absent rank was when the abort reached it (a collective of its own,
        // a send, or not yet in the run).
        absent.empty() ? ""
                       : absl::StrCat("; rank ", absent.front(), " when aborted: ",
                                      run.results[absent.front()].error_message())));
  } else {
    for (int r : ranks) {
      if (!run.results[r].ok())
        s = FromGrpcStatus(run.results[r], absl::StrCat("worker ", workers_->Describe(r)));
    }
  }
  if (run.cancelled) s = absl::CancelledError("the run was cancelled: its client left");
  return s;
}

absl::Status ArrayRegistry::AddFetched(const v1::ShardMapRequest& request,
                                       const std::vector<v1::ArrayInfo>& outputs,
                                       const std::vector<std::vector<int>>& returned_by,
                                       WorkerRun& run, v1::ShardMapResponse& response) {
  std::vector<int> ranks(run.responses.size());
  std::iota(ranks.begin(), ranks.end(), 0);
  const int num_runs = 1 + request.more_runs_size();
  for (int k = 0; k < num_runs; ++k) {
    double slowest = 0, collective = 0;
    for (int r : ranks) {
      if (k < run.responses[r].run_seconds_size())
        slowest = std::max(slowest, run.responses[r].run_seconds(k));
      if (k < run.responses[r].collective_seconds_size())
        collective += run.responses[r].collective_seconds(k);
    }
    v1::RunTiming* t = response.add_timings();
    t->set_seconds(slowest);
    t->set_collective_seconds(collective / static_cast<double>(ranks.size()));
  }
  const int num_fetched = request.fetch_outputs_size();
  for (int k = 0; k < num_runs; ++k) {
    for (int f = 0; f < num_fetched; ++f) {
      v1::GetArrayResponse* got = response.add_fetched();
      *got->mutable_info() = outputs[request.fetch_outputs(f)];
    }
  }
  for (int r : ranks) {
    const size_t per_run = returned_by[r].size();
    if (run.responses[r].outputs_size() != static_cast<int>(per_run * num_runs)) {
      return absl::InternalError(absl::StrCat("worker ", workers_->Describe(r), " returned ",
                                              run.responses[r].outputs_size(),
                                              " results; expected ", per_run * num_runs));
    }
    for (int k = 0; k < num_runs; ++k) {
      for (size_t j = 0; j < per_run; ++j) {
        v1::GetArrayResponse* got = response.mutable_fetched(k * num_fetched + returned_by[r][j]);
        *got->add_blocks() = std::move(*run.responses[r].mutable_outputs(k * per_run + j));
        got->add_block_ranks(r);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace meshrun
