// Drives a train job over the registered workers: plan, load, step, evaluate, report.
#ifndef MESHRUN_SERVER_JOB_DRIVER_H_
#define MESHRUN_SERVER_JOB_DRIVER_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "core/config/job_config.h"
#include "meshrun/v1/coordinator.pb.h"
#include "meshrun/v1/worker.grpc.pb.h"
#include "server/coordinator_metrics.h"
#include "server/worker_registry.h"

namespace meshrun {

// Runs one job at a time (Run is serialised by the caller; Status() is thread-safe). Every call
// to a worker has a deadline; a worker that dies, hangs or misses heartbeats fails the job within
// about heartbeat_timeout, with an error naming its rank, and the other workers are told to abort
// so none is left blocked in a collective.
class JobDriver {
 public:
  struct Options {
    absl::Duration heartbeat_timeout = absl::Seconds(3);
    absl::Duration ready_timeout = absl::Seconds(60);
    absl::Duration load_timeout = absl::Seconds(120);
    CoordinatorMetrics* metrics = nullptr;  // optional; must outlive the driver
  };
  // Receives progress; returns false when nobody listens any more (the job is then cancelled).
  using EventSink = std::function<bool(const v1::JobEvent&)>;

  JobDriver(WorkerRegistry* registry, Options options) : registry_(registry), options_(options) {}

  // Runs `config` to completion. With config.checkpoint.dir, the TrainState is saved every
  // save_every steps and at the end (server/checkpoint_ops.h; async: written from a snapshot the
  // workers take after the step while the next steps run, a second save waiting for the first),
  // keeping the newest `keep`; `resume` starts from the newest committed checkpoint there (its
  // step, params, opt_state and rng; the data order is the seed's, so the losses continue as an
  // uninterrupted run's), `init_from` from a safetensors file of params. Errors: InvalidArgument for a config that does not fit the
  // cluster (mesh mismatch, indivisible batch); the first worker failure (Unavailable naming a
  // dead rank, DeadlineExceeded, or the worker's own error prefixed with its rank); Cancelled
  // when the sink stops listening.
  absl::Status Run(const JobConfig& config, const EventSink& emit);

  // "idle" | "running" | "done" | "failed", the last step reported, the last error.
  void Status(std::string* state, int64_t* step, std::string* error);

 private:
  using Call = std::function<grpc::Status(int rank, v1::Worker::Stub& stub, grpc::ClientContext* ctx)>;
  // Runs `call` on every worker in parallel, watching heartbeats; see the class comment.
  absl::Status AllWorkers(const std::string& what, absl::Duration timeout, const Call& call);
  void AbortAll(const std::string& reason);
  void SetState(const std::string& state, int64_t step, const std::string& error);

  WorkerRegistry* registry_;
  Options options_;
  std::vector<std::unique_ptr<v1::Worker::Stub>> stubs_;
  absl::Mutex mu_;
  std::string state_ ABSL_GUARDED_BY(mu_) = "idle";
  int64_t step_ ABSL_GUARDED_BY(mu_) = 0;
  std::string error_ ABSL_GUARDED_BY(mu_);
};

// Fashion-MNIST split sizes, known to the planner without reading the files.
inline constexpr int64_t kFashionMnistTrainExamples = 60000;

}  // namespace meshrun

#endif  // MESHRUN_SERVER_JOB_DRIVER_H_
