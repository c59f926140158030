// The coordinator's one job loop: a train job (coordinator.proto's JobSpec) is a derived train
// step partitioned like any jax.jit program, its batches fed on the workers by a sharded input
// pipeline, looped here with progress reports, evaluation, checkpoints, events and metrics.
#ifndef MESHRUN_SERVER_JOB_DRIVER_H_
#define MESHRUN_SERVER_JOB_DRIVER_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "meshrun/v1/coordinator.pb.h"
#include "server/array_registry.h"
#include "server/coordinator_metrics.h"
#include "server/partitioner.h"
#include "server/worker_registry.h"

namespace meshrun {

// Runs one job at a time (Run is serialised by the caller; Status() is thread-safe). Every
// worker call goes through ArrayRegistry (deadlines, heartbeats: a worker that dies or hangs
// fails the job within about the heartbeat timeout, naming its rank, and the others are aborted).
// The mesh with its `data` axis (else its first) shrunk to the largest size that divides it and
// fits `available` workers, if that leaves at least `min_workers` devices. Errors:
// FailedPrecondition naming the counts when none does.
absl::StatusOr<Mesh> SmallerDataMesh(const Mesh& mesh, int available, int min_workers);

class JobDriver {
 public:
  struct Options {
    absl::Duration ready_timeout = absl::Seconds(60);
    CoordinatorMetrics* metrics = nullptr;  // optional; must outlive the driver
    // Where the job's state (name, state, step, checkpoint dir, last checkpoint) is kept as JSON
    // across coordinator restarts; empty: nowhere. A job the file says was running when the
    // coordinator started again is reported "interrupted", naming its last checkpoint.
    std::string state_file;
  };
  // Receives progress; returns false when nobody listens any more (the job is then cancelled).
  using EventSink = std::function<bool(const v1::JobEvent&)>;

  JobDriver(WorkerRegistry* registry, ArrayRegistry* arrays, Options options)
      : registry_(registry),
        arrays_(arrays),
        options_(options),
        partitioner_([registry] { return registry->mesh(); }) {
    LoadStateFile();
  }

  // Runs `job` to completion:
  //  1. partitions its train step for the cluster's mesh and opens its train input on every
  //     worker (each then reads only its blocks of every step's global batch);
  //  2. the TrainState: with checkpoint.resume, the newest committed checkpoint in checkpoint.dir
  //     (its step; the data order continues exactly as an uninterrupted run's), else the job's
  //     init program (each worker draws its own blocks) and rng = PRNGKey(seed), then the params
  //     of checkpoint.init_from (a safetensors file) if given;
  //  3. steps, log_every at a time back to back on the workers, with a progress event per
  //     report, the non-finite guard (no state after a NaN loss is saved), and checkpoints every
  //     save_every steps and at the end (async: from a snapshot taken on the workers);
  //  4. with schedule.evaluate, one pass of eval_step over eval_input, reported as an EvalReport.
  // The state arrays and inputs are released whatever happens.
  // With job.recovery.max_restarts > 0, a failure that lost a worker (its process is gone, hung
  // or unreachable) does not end the job: a WorkerLost event names it, the cluster re-forms
  // (WorkerRegistry::BeginRecovery: the survivors restart, a replacement takes the lost rank),
  // the newest committed checkpoint is restored (none: the initial state; the data order
  // continues as an uninterrupted run's) and a Recovered event says from which step and how long
  // it took. With job.recovery.peer_state_every > 0 every worker keeps its blocks of the state
  // in memory and on its ring successor every that many steps, and a recovery on the same mesh
  // restores from them (Recovered.source "peers") when they are at least as new as the newest
  // checkpoint; they are freed when the job ends. Errors: InvalidArgument for a job that does not
  // fit the cluster (mesh, program, input); the first worker failure (naming its rank);
  // DeadlineExceeded when the mesh does not re-form within recovery.timeout_seconds (naming the
  // ranks missing); Cancelled when the sink stops listening.
  absl::Status Run(const v1::JobSpec& job, const EventSink& emit);

  // Cancels the running job at once (its client went away): the run in flight on the workers is
  // aborted within 100 ms and Run returns Cancelled. Thread-safe.
  void Cancel();

  // "idle" | "running" | "done" | "failed" | "interrupted" (the coordinator restarted while it
  // ran; the error names its last checkpoint), the last step reported, the last error.
  void Status(std::string* state, int64_t* step, std::string* error);

 private:
  class Runner;
  void SetState(const std::string& state, int64_t step, const std::string& error);
  // A checkpoint of the running job was committed at `path`.
  void NoteCheckpoint(const std::string& path);
  // Options::state_file: reads it at start (a job it says was running is now "interrupted") and
  // rewrites it (temporary file and rename) on every change.
  void LoadStateFile();
  void WriteStateFileLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // job_recovery.cc. The workers a failure lost, probed by grpc.health.v1 (kWorkerHealthService,
  // SERVING once joined; heartbeat_timeout each, in parallel) and by their heartbeats; empty when
  // every worker answers (the failure was the job's own). When the cluster already re-formed since
  // `generation` (a new process took a worker's address), the workers it lost. `step`: the last
  // step completed.
  std::vector<v1::WorkerLost> FindLostWorkers(const absl::Status& failure, int64_t step,
                                              uint64_t generation);
  // Emits `lost`, re-forms the cluster without them (unless it did since `generation`) and
  // waits for the whole mesh. Errors:
  // DeadlineExceeded naming the lost ranks and the ranks still missing; Cancelled.
  // When the mesh did not re-form: shrinks it to SmallerDataMesh over the workers that rejoined
  // and waits for them. Errors: FailedPrecondition when no smaller mesh fits; DeadlineExceeded.
  absl::Status ContinueOnFewer(int min_workers, const EventSink& emit);
  absl::Status Reform(const v1::JobSpec& job, const std::vector<v1::WorkerLost>& lost,
                      const absl::Status& failure, uint64_t generation, const EventSink& emit);

  WorkerRegistry* registry_;
  ArrayRegistry* arrays_;
  Options options_;
  Partitioner partitioner_;
  int64_t jobs_started_ = 0;  // names each job's arrays apart
  // The running job's token (its name and 64 random bits): the peers' in-memory copies of its
  // state are kept under it, so no other run's copies are ever restored. Set by Run.
  std::string run_token_;
  std::atomic<bool> cancel_{false};
  absl::Mutex mu_;
  std::string state_ ABSL_GUARDED_BY(mu_) = "idle";
  int64_t step_ ABSL_GUARDED_BY(mu_) = 0;
  std::string error_ ABSL_GUARDED_BY(mu_);
  std::string job_name_ ABSL_GUARDED_BY(mu_);
  std::string checkpoint_dir_ ABSL_GUARDED_BY(mu_);
  std::string last_checkpoint_ ABSL_GUARDED_BY(mu_);
};

}  // namespace meshrun

#endif  // MESHRUN_SERVER_JOB_DRIVER_H_
