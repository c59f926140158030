// The coordinator's one job loop: a train job (coordinator.proto's JobSpec) is a derived train
// step partitioned like any jax.jit program, its batches fed on the workers by a sharded input
// pipeline, looped here with progress reports, evaluation, checkpoints, events and metrics.
#ifndef MESHRUN_SERVER_JOB_DRIVER_H_
#define MESHRUN_SERVER_JOB_DRIVER_H_

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
class JobDriver {
 public:
  struct Options {
    absl::Duration ready_timeout = absl::Seconds(60);
    CoordinatorMetrics* metrics = nullptr;  // optional; must outlive the driver
  };
  // Receives progress; returns false when nobody listens any more (the job is then cancelled).
  using EventSink = std::function<bool(const v1::JobEvent&)>;

  JobDriver(WorkerRegistry* registry, ArrayRegistry* arrays, Options options)
      : registry_(registry), arrays_(arrays), options_(options), partitioner_(registry->mesh()) {}

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
  // The state arrays and inputs are released whatever happens. Errors: InvalidArgument for a job
  // that does not fit the cluster (mesh, program, input); the first worker failure (naming its
  // rank); Cancelled when the sink stops listening.
  absl::Status Run(const v1::JobSpec& job, const EventSink& emit);

  // "idle" | "running" | "done" | "failed", the last step reported, the last error.
  void Status(std::string* state, int64_t* step, std::string* error);

 private:
  class Runner;
  void SetState(const std::string& state, int64_t step, const std::string& error);

  WorkerRegistry* registry_;
  ArrayRegistry* arrays_;
  Options options_;
  Partitioner partitioner_;
  int64_t jobs_started_ = 0;  // names each job's arrays apart
  absl::Mutex mu_;
  std::string state_ ABSL_GUARDED_BY(mu_) = "idle";
  int64_t step_ ABSL_GUARDED_BY(mu_) = 0;
  std::string error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace meshrun

#endif  // MESHRUN_SERVER_JOB_DRIVER_H_
