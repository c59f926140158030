#include "server/job_driver.h"

#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "core/checkpoint/checkpoint.h"
#include "core/program/dp_classifier.h"
#include "glog/logging.h"
#include "net/grpc_util.h"
#include "server/checkpoint_ops.h"

namespace meshrun {
namespace {

// Worker shard-store ids of the job's TrainState copies: what a restore loads before the program
// takes it, and the snapshot a save writes from.
const std::string kRestorePrefix = "job/restore/";
const std::string kSnapshotPrefix = "job/snapshot/";

// The state arrays whose names start with `only` (all: ""), as the workers store them under
// `prefix`.
std::vector<CheckpointArray> StoredUnder(const std::vector<checkpoint::WantedArray>& state,
                                         const std::string& prefix, const std::string& only = "") {
  std::vector<CheckpointArray> out;
  for (const checkpoint::WantedArray& a : state) {
    if (absl::StartsWith(a.name, only))
      out.push_back({a.name, prefix + a.name, a.dtype, a.shape, a.spec});
  }
  return out;
}

// Puts the state the job starts from on the workers, as arrays kRestorePrefix + name: the newest
// committed checkpoint in checkpoint.dir when checkpoint.resume is set and there is one, else the
// params of checkpoint.init_from (a safetensors file). Errors name the checkpoint or file and the
// array.
struct RestoredState {
  int64_t step = -1;  // the step the job starts at; -1: from its init, nothing restored
  int arrays = 0;     // how many state arrays each worker must take from the store
};
absl::StatusOr<RestoredState> RestoreJobState(const JobConfig& config, const Mesh& mesh,
                                              const std::vector<checkpoint::WantedArray>& state,
                                              const ForEachWorker& each_worker,
                                              const std::function<bool(const std::string&)>& info) {
  std::string path;
  absl::StatusOr<checkpoint::Manifest> m = absl::NotFoundError("");
  std::vector<CheckpointArray> targets;
  if (config.checkpoint.resume) {
    absl::StatusOr<std::string> latest = checkpoint::LatestCheckpoint(config.checkpoint.dir);
    if (latest.ok()) {
      path = *latest;
      m = checkpoint::ReadManifest(path);
      if (!m.ok()) return m.status();
      targets = StoredUnder(state, kRestorePrefix);
    } else {
      info(absl::StrCat("resume: no committed checkpoint in ", config.checkpoint.dir,
                        "; starting from step 0"));
    }
  }
  const bool resuming = !targets.empty();
  if (!resuming && !config.checkpoint.init_from.empty()) {
    path = config.checkpoint.init_from;
    m = checkpoint::SafetensorsManifest(path);
    if (!m.ok()) return m.status();
    targets = StoredUnder(state, kRestorePrefix, "params/");
  }
  if (targets.empty()) return RestoredState{};
  absl::StatusOr<std::vector<v1::LoadShardsRequest>> loads = PlanLoad(*m, path, mesh, targets);
  if (!loads.ok()) return loads.status();
  absl::StatusOr<int64_t> bytes = LoadBlocks(*loads, targets, each_worker);
  if (!bytes.ok()) return bytes.status();
  info(absl::StrCat(resuming ? "resumed from " : "initialised from ", path, " at step ", m->step,
                    ": ", targets.size(), " arrays, ", *bytes, " bytes read by the workers"));
  return RestoredState{m->step, static_cast<int>(targets.size())};
}

}  // namespace

void JobDriver::SetState(const std::string& state, int64_t step, const std::string& error) {
  absl::MutexLock lock(&mu_);
  state_ = state;
  step_ = step;
  error_ = error;
}

void JobDriver::Status(std::string* state, int64_t* step, std::string* error) {
  absl::MutexLock lock(&mu_);
  *state = state_;
  *step = step_;
  *error = error_;
}

void JobDriver::AbortAll(const std::string& reason) {
  const uint64_t epoch = registry_->collective_epoch();
  registry_->AdvanceCollectiveEpoch();  // the next run starts clean (transport.h)
  std::vector<std::thread> threads;
  for (size_t r = 0; r < stubs_.size(); ++r) {
    threads.emplace_back([&, r] {
      grpc::ClientContext ctx;
      SetTimeout(ctx, absl::Seconds(2));
      v1::AbortRequest req;
      req.set_reason(reason);
      req.set_epoch(epoch);
      v1::AbortResponse resp;
      stubs_[r]->Abort(&ctx, req, &resp);
    });
  }
  for (auto& t : threads) t.join();
}

absl::Status JobDriver::AllWorkers(const std::string& what, absl::Duration timeout,
                                   const Call& call) {
  const int n = static_cast<int>(stubs_.size());
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  for (int r = 0; r < n; ++r) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    SetTimeout(*contexts.back(), timeout);
  }
  absl::Mutex mu;
  std::vector<grpc::Status> status(n);
  std::vector<int> failed_in_order;  // ranks, by time of failure
  int remaining = n;
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      grpc::Status s = call(r, *stubs_[r], contexts[r].get());
      absl::MutexLock lock(&mu);
      status[r] = s;
      if (!s.ok()) failed_in_order.push_back(r);
      --remaining;
    });
  }
  // Root cause first: a worker that missed heartbeats, then one the RPC could not reach (errors a
  // worker returns itself start with "rank "), then the earliest failure.
  auto root_cause = [&](const std::vector<int>& dead)
                        ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) -> absl::Status {
    if (!dead.empty()) {
      return absl::UnavailableError(absl::StrCat(
          "worker ", registry_->Describe(dead[0]), " missed heartbeats for ",
          absl::FormatDuration(options_.heartbeat_timeout), " during ", what, " (died or hung)"));
    }
    for (int r : failed_in_order) {
      if (status[r].error_code() == grpc::UNAVAILABLE &&
          !absl::StartsWith(status[r].error_message(), "rank ")) {
        return absl::UnavailableError(
            absl::StrCat("worker ", registry_->Describe(r), " is unreachable during ", what,
                         " (process died?): ", status[r].error_message()));
      }
    }
    const int first = failed_in_order.front();
    return FromGrpcStatus(status[first], absl::StrCat("worker ", registry_->Describe(first),
                                                      " failed during ", what));
  };
  absl::Status result;
  std::vector<int> dead;
  mu.Lock();
  while (remaining > 0) {
    auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return remaining == 0; };
    mu.AwaitWithTimeout(absl::Condition(&done), absl::Milliseconds(100));
    if (!result.ok()) continue;
    dead = registry_->DeadRanks(options_.heartbeat_timeout);
    if (failed_in_order.empty() && dead.empty()) continue;
    // Give a dead worker's RPC a moment to fail too, so the root cause names it.
    mu.AwaitWithTimeout(absl::Condition(&done), absl::Milliseconds(200));
    result = root_cause(dead);
    for (int r : dead) contexts[r]->TryCancel();
    mu.Unlock();
    AbortAll(std::string(result.message()));
    mu.Lock();
  }
  if (result.ok() && !failed_in_order.empty()) {
    result = root_cause(dead);
    mu.Unlock();
    AbortAll(std::string(result.message()));
    mu.Lock();
  }
  mu.Unlock();
  for (auto& t : threads) t.join();
  return result;
}

absl::Status JobDriver::Run(const JobConfig& config, const EventSink& emit) {
  SetState("running", 0, "");
  auto fail = [&](absl::Status s) {
    SetState("failed", 0, std::string(s.message()));
    if (options_.metrics != nullptr) options_.metrics->OnJobEnded(false);
    LOG(ERROR) << "job failed: " << s;
    return s;
  };
  auto info = [&](const std::string& text) {
    v1::JobEvent e;
    e.set_info(text);
    return emit(e);
  };
  const Mesh& mesh = registry_->mesh();
  if (!config.mesh.empty()) {
    absl::StatusOr<Mesh> want = Mesh::Create(config.mesh);
    if (!want.ok()) return fail(want.status());
    if (*want != mesh) {
      return fail(absl::InvalidArgumentError(absl::StrCat(
          "job mesh ", want->ToString(), " does not match the cluster's ", mesh.ToString())));
    }
  }
  absl::StatusOr<v1::StepProgram> program = BuildDpClassifierProgram(config, mesh);
  if (!program.ok()) return fail(program.status());
  if (absl::Status s = registry_->WaitUntilReady(absl::Now() + options_.ready_timeout); !s.ok())
    return fail(s);
  if (stubs_.empty()) {
    for (const auto& p : registry_->Peers())
      stubs_.push_back(v1::Worker::NewStub(CreateChannel(p.address())));
  }
  const int64_t steps_per_epoch = kFashionMnistTrainExamples / config.data.batch_size;
  const int64_t total =
      config.train.max_steps > 0 ? config.train.max_steps : config.train.epochs * steps_per_epoch;
  info(absl::StrCat(
      "plan: ", mesh.ToString(),
      "; params and optimizer state PartitionSpec() (replicated); batch ",
      "PartitionSpec('data', None): ", program->minibatch_size() * program->num_minibatches(),
      " examples per worker per step in ", program->num_minibatches(), " minibatches; ", total,
      " steps (", steps_per_epoch, " per epoch)"));

  // Checkpoints (config.checkpoint): where the state comes from, if not from init.
  const std::vector<checkpoint::WantedArray> state = TrainStateArrays(*program, mesh);
  const ForEachWorker each_worker = [this](const WorkerCall& call) {
    return AllWorkers("checkpoint", options_.load_timeout, call);
  };
  absl::StatusOr<RestoredState> restored = RestoreJobState(config, mesh, state, each_worker, info);
  if (!restored.ok()) return fail(restored.status());
  int64_t step = std::max<int64_t>(0, restored->step);
  const std::string restore_prefix = restored->step >= 0 ? kRestorePrefix : "";

  v1::LoadProgramRequest load;
  *load.mutable_program() = *program;
  load.set_restore_prefix(restore_prefix);
  load.set_dataset_dir(config.data.path);
  load.set_seed(config.train.seed);
  load.set_global_batch_size(config.data.batch_size);
  load.set_collective_timeout_seconds(config.train.collective_timeout_seconds);
  load.set_epoch(registry_->collective_epoch());
  absl::Status s = AllWorkers(
      "LoadProgram", options_.load_timeout,
      [&](int r, v1::Worker::Stub& stub, grpc::ClientContext* ctx) {
        v1::LoadProgramResponse resp;
        grpc::Status st = stub.LoadProgram(ctx, load, &resp);
        if (st.ok() && resp.restored_size() != restored->arrays) {
          return grpc::Status(grpc::INTERNAL,
                              absl::StrCat("rank ", r, ": took ", resp.restored_size(), " of the ",
                                           restored->arrays, " restored state arrays"));
        }
        return st;
      });
  if (!s.ok()) return fail(s);

  // A save in flight (async: written from the workers' snapshot while the next steps run).
  std::thread save_thread;
  absl::StatusOr<v1::SaveCheckpointResponse> save_result;
  absl::Duration save_time;
  auto finish_save = [&]() -> absl::Status {
    if (!save_thread.joinable()) return absl::OkStatus();
    save_thread.join();
    if (!save_result.ok()) return save_result.status();
    info(absl::StrCat("checkpoint saved: ", save_result->path(), " (", save_result->bytes_written(),
                      " bytes in ", absl::FormatDuration(save_time), ")"));
    return absl::OkStatus();
  };
  auto fail_after_save = [&](absl::Status s) {
    if (save_thread.joinable()) save_thread.join();
    return fail(std::move(s));
  };
  const bool saving = !config.checkpoint.dir.empty();
  auto is_save_step = [&](int64_t at) {
    return saving && (at == total ||
                      (config.checkpoint.save_every > 0 && at % config.checkpoint.save_every == 0));
  };
  const std::vector<CheckpointArray> snapshot_arrays = StoredUnder(state, kSnapshotPrefix);

  const int64_t first_step = step;
  const absl::Time start = absl::Now();
  absl::Time interval_start = start;
  int64_t interval_first = step;
  std::vector<v1::RunStepsResponse> responses(stubs_.size());
  std::vector<v1::StepMetrics> interval;  // every worker's metrics since the last report
  while (step < total) {
    // Up to the next report (every log_every steps), the next save or the end.
    int64_t next =
        std::min<int64_t>(total, (step / config.train.log_every + 1) * config.train.log_every);
    if (saving && config.checkpoint.save_every > 0) {
      next = std::min<int64_t>(
          next, (step / config.checkpoint.save_every + 1) * config.checkpoint.save_every);
    }
    const int block = static_cast<int>(next - step);
    v1::RunStepsRequest req;
    req.set_first_step(step);
    req.set_num_steps(block);
    req.set_epoch(registry_->collective_epoch());
    if (is_save_step(next)) {
      // A second save waits for the first; the snapshot replaces the one it writes from.
      if (absl::Status saved = finish_save(); !saved.ok()) return fail(saved);
      req.set_snapshot_prefix(kSnapshotPrefix);
    }
    const absl::Duration timeout =
        absl::Seconds(config.train.collective_timeout_seconds * block + 30);
    s = AllWorkers(absl::StrCat("steps ", step, "..", step + block - 1), timeout,
                   [&](int r, v1::Worker::Stub& stub, grpc::ClientContext* ctx) {
                     responses[r].Clear();
                     return stub.RunSteps(ctx, req, &responses[r]);
                   });
    if (!s.ok()) return fail_after_save(s);
    // The non-finite guard, before this block's state can be saved: the step's loss is the sum
    // over every worker's examples.
    for (int k = 0; k < block; ++k) {
      double loss_sum = 0;
      for (const auto& resp : responses)
        loss_sum += k < resp.steps_size() ? resp.steps(k).loss_sum() : 0.0;
      if (absl::Status finite = CheckLossFinite(step + k + 1, loss_sum); !finite.ok()) {
        return fail_after_save(finite);
      }
    }
    step += block;
    for (const auto& resp : responses)
      interval.insert(interval.end(), resp.steps().begin(), resp.steps().end());
    if (is_save_step(step)) {
      const int64_t at = step;
      save_thread = std::thread([&, at] {
        const absl::Time t0 = absl::Now();
        save_result = WriteCheckpoint(config.checkpoint.dir, at, config.checkpoint.keep, mesh,
                                      snapshot_arrays, each_worker);
        save_time = absl::Now() - t0;
      });
      if (!config.checkpoint.async) {
        if (absl::Status saved = finish_save(); !saved.ok()) return fail(saved);
      }
    }
    if (step % config.train.log_every != 0 && step != total) continue;
    const int64_t steps_done = step - interval_first;
    // Means over every step of the interval and every worker, as the seed's metrics accumulate
    // between prints.
    double loss = 0, correct = 0, step_seconds = 0, collective_seconds = 0;
    int64_t count = 0, samples = 0;
    std::vector<double> all_step_seconds, all_collective_seconds;
    for (const v1::StepMetrics& m : interval) {
      loss += m.loss_sum();
      correct += m.correct();
      count += m.count();
      step_seconds += m.step_seconds();
      collective_seconds += m.collective_seconds();
      all_step_seconds.push_back(m.step_seconds());
      all_collective_seconds.push_back(m.collective_seconds());
      ++samples;
    }
    interval.clear();
    if (options_.metrics != nullptr) {
      options_.metrics->OnSteps(static_cast<int>(steps_done), config.data.batch_size, loss / count,
                                correct / count, all_step_seconds, all_collective_seconds);
    }
    const double block_seconds =
        std::max(1e-9, absl::ToDoubleSeconds(absl::Now() - interval_start));
    const double elapsed = absl::ToDoubleSeconds(absl::Now() - start);
    interval_start = absl::Now();
    interval_first = step;
    v1::JobEvent e;
    v1::StepReport* rep = e.mutable_step();
    rep->set_step(step);
    rep->set_total_steps(total);
    rep->set_epoch(static_cast<double>(step) / steps_per_epoch);
    rep->set_loss(loss / count);
    rep->set_accuracy(correct / count);
    rep->set_samples_per_second(steps_done * config.data.batch_size / block_seconds);
    rep->set_eta_seconds(elapsed / (step - first_step) * (total - step));
    rep->set_step_seconds(step_seconds / samples);
    rep->set_collective_seconds(collective_seconds / samples);
    SetState("running", step, "");
    if (!emit(e)) {
      AbortAll("job cancelled: the client went away");
      return fail_after_save(absl::CancelledError("job cancelled: the client went away"));
    }
  }
  if (absl::Status saved = finish_save(); !saved.ok()) return fail(saved);
  if (saving) {
    // The snapshot's copies are not needed any more.
    DeleteOnWorkers(snapshot_arrays, each_worker);
  }

  if (config.train.evaluate) {
    std::vector<v1::EvaluateResponse> evals(stubs_.size());
    s = AllWorkers("Evaluate", options_.load_timeout,
                   [&](int r, v1::Worker::Stub& stub, grpc::ClientContext* ctx) {
                     v1::EvaluateRequest req;
                     req.set_epoch(registry_->collective_epoch());
                     return stub.Evaluate(ctx, req, &evals[r]);
                   });
    if (!s.ok()) return fail(s);
    double loss = 0, correct = 0;
    int64_t count = 0;
    for (const auto& ev : evals) {
      loss += ev.loss_sum();
      correct += ev.correct();
      count += ev.count();
    }
    v1::JobEvent e;
    e.mutable_eval()->set_loss(loss / std::max<int64_t>(1, count));
    e.mutable_eval()->set_accuracy(correct / std::max<int64_t>(1, count));
    e.mutable_eval()->set_num_examples(count);
    emit(e);
  }
  SetState("done", step, "");
  if (options_.metrics != nullptr) options_.metrics->OnJobEnded(true);
  return absl::OkStatus();
}

}  // namespace meshrun
