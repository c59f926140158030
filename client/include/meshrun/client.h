// meshrun client SDK: talk to a running coordinator — submit train jobs, read cluster status.
#ifndef MESHRUN_CLIENT_INCLUDE_MESHRUN_CLIENT_H_
#define MESHRUN_CLIENT_INCLUDE_MESHRUN_CLIENT_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/config/job_config.h"
#include "core/sharding/partition_spec.h"
#include "core/tensor.h"
#include "meshrun/v1/coordinator.grpc.pb.h"

namespace meshrun {

struct PlannedJob;  // meshrun/job.h

// The outcome of a train job, aggregated over the whole mesh.
struct TrainResult {
  std::vector<v1::StepReport> reports;  // one per log interval, in order
  bool evaluated = false;
  double test_loss = 0;
  double test_accuracy = 0;
  int64_t test_examples = 0;
  // With JobSpec.recovery: the workers the job lost and its recoveries, in order (reports after a
  // recovery continue from the restored step, so steps after it appear twice in `reports`).
  std::vector<v1::WorkerLost> lost;
  std::vector<v1::Recovered> recoveries;
};

// A connection to one coordinator. Thread-safe (gRPC stubs are); Train blocks its caller.
// Each Client is a session: the arrays it creates belong to it and, if it goes away without
// deleting them (killed, disconnected), are freed once it has been silent for the coordinator's
// --client_lease; a background thread sends KeepAlive meanwhile. A job it submitted is
// cancelled as soon as its call is gone.
class Client {
 public:
  // Errors: Unavailable naming the address if no coordinator answers within `timeout`.
  ~Client();
  static absl::StatusOr<std::unique_ptr<Client>> Connect(
      const std::string& address, absl::Duration timeout = absl::Seconds(10));

  const std::string& address() const { return address_; }

  // The mesh, the workers with their liveness, and the job state. Deadline: `timeout`.
  absl::StatusOr<v1::GetStatusResponse> GetStatus(absl::Duration timeout = absl::Seconds(5));

  // Blocks until every expected worker has registered and is alive.
  // Errors: DeadlineExceeded saying how many workers registered.
  absl::Status WaitForWorkers(absl::Duration timeout);

  // Runs a train job (see core/config/job_config.h): plans it for the cluster's mesh
  // (meshrun/job.h's PlanJob: the train step is derived and traced here), submits it as a typed
  // JobSpec, and calls `on_event` for each progress event as it arrives (on the calling thread).
  // Errors: InvalidArgument naming a config value that does not fit the cluster; the job's
  // error as the coordinator reports it, e.g. Unavailable naming a dead worker's rank, a missing
  // or truncated data file naming it; DeadlineExceeded after `timeout`.
  absl::StatusOr<TrainResult> Train(
      const JobConfig& config, const std::function<void(const v1::JobEvent&)>& on_event = nullptr,
      absl::Duration timeout = absl::Hours(24));
  // Runs a planned job (PlanJob, possibly adjusted): its fixed batch, if any, is put on the
  // cluster first and deleted after. Errors: as above.
  absl::StatusOr<TrainResult> Train(
      PlannedJob job, const std::function<void(const v1::JobEvent&)>& on_event = nullptr,
      absl::Duration timeout = absl::Hours(24));
  // Runs a planned job as it is (SubmitJob).
  absl::StatusOr<TrainResult> Train(
      const v1::JobSpec& job, const std::function<void(const v1::JobEvent&)>& on_event = nullptr,
      absl::Duration timeout = absl::Hours(24));

  // Opens a sharded input pipeline on every worker (core/data/input_pipeline.h; the batch
  // arguments of later Jit / ShardMap calls can then be fed from it, each worker reading only its
  // blocks). Errors: the first worker's, naming its rank (a missing or truncated file, a field
  // that does not fit the spec).
  absl::StatusOr<v1::InputInfo> OpenInput(const v1::InputSpec& spec, const std::string& id = "");
  absl::Status CloseInput(const std::string& id);

  // jax.device_put(host, NamedSharding(cluster mesh, spec)): each worker receives only its own
  // block (replicated dims are replicated). `host` is row-major, f32 / bf16 / i32 / u32.
  // `host`'s data is sent from its own memory, not copied: do not write it until Put returns.
  // Errors: InvalidArgument naming the spec, shape and dim that do not fit; an id in use; an
  // array over kMaxArrayMessageBytes (net/grpc_util.h: 2 GiB - 1 MiB), naming its size.
  absl::StatusOr<v1::ArrayInfo> Put(const Tensor& host, const PartitionSpec& spec,
                                    const std::string& id = "");
  // jax.device_get: the global array assembled from the workers' blocks, each read straight
  // from the response's bytes (a replicated array's one block is the result). Errors: NotFound.
  absl::StatusOr<Tensor> Get(const std::string& id);
  // jax.Array.delete: frees the arrays `ids` on every worker, in one call. Every known id is freed
  // even when others are unknown. Errors: NotFound naming the unknown ids.
  absl::Status Delete(absl::Span<const std::string> ids);
  absl::Status Delete(const std::string& id) { return Delete(absl::MakeConstSpan(&id, 1)); }
  absl::StatusOr<std::vector<v1::ArrayInfo>> ListArrays();
  // The grid jax.debug.visualize_array_sharding prints for the array (1-D and 2-D arrays).
  absl::StatusOr<std::string> VisualizeSharding(const std::string& id);

  // shard_map: runs `program` (see shard_map.h) on every worker over arrays already on the
  // cluster, whose specs must equal the program's in_specs; returns the results, which stay on
  // the cluster. Errors: InvalidArgument naming a mismatched argument or spec; the failing
  // worker's error (a collective deadline names the rank that did not arrive).
  // donate_argnums (jax.jit's): arguments the call consumes; a result may reuse a donated
  // argument's id, replacing that array. As in JAX the donated arrays are consumed: if the call
  // fails they are deleted (the error names them); when it succeeds, those no result replaces
  // are deleted too.
  absl::StatusOr<std::vector<v1::ArrayInfo>> ShardMap(
      const v1::ShardMapProgram& program, const std::vector<std::string>& input_ids,
      const std::vector<std::string>& output_ids = {},
      absl::Duration collective_timeout = absl::Seconds(30),
      const std::vector<int>& donate_argnums = {});

  // jax.jit on the cluster: the COORDINATOR partitions `program` (a JitBuilder's
  // global_program(): ops on global arrays, no collectives) for its mesh, choosing each
  // intermediate's layout and inserting the collectives, derives the VJP of its grad ops, and runs
  // the per-shard program as ShardMap does (same arguments, donation and errors). Partitioned
  // programs are cached on the coordinator. The results at `fetch_outputs` (indices of the
  // program's outputs) come back as host arrays in JitResult::fetched instead of staying on the
  // cluster (jax.device_get of a result, in the same call; their output ids are not used), and
  // JitResult::outputs lists the others. Errors: InvalidArgument naming the op (and dim) that
  // does not partition on the cluster's mesh, a malformed op by its index, or a fetch index out
  // of range; those of ShardMap.
  // more_runs (Keras's steps_per_execution): further runs of the program in the same call, back to
  // back on the workers, each over its own argument ids (one per argument); a donated argument
  // carries over from run to run (every kept result must take a donated argument's id), and
  // `fetched` holds the fetched results of every run in turn.
  struct JitResult {
    std::vector<v1::ArrayInfo> outputs;
    std::vector<std::string> collectives;  // inserted by the coordinator: "psum(model)", ...
    bool cache_hit = false;                // partitioned by an earlier call
    std::vector<Tensor> fetched;           // the results named by fetch_outputs, in its order
  };
  absl::StatusOr<JitResult> Jit(const v1::GlobalProgram& program,
                                const std::vector<std::string>& input_ids,
                                const std::vector<std::string>& output_ids = {},
                                absl::Duration collective_timeout = absl::Seconds(30),
                                const std::vector<int>& donate_argnums = {},
                                const std::vector<int>& fetch_outputs = {},
                                const std::vector<std::vector<std::string>>& more_runs = {});

  // Sharded checkpoints (core/checkpoint/checkpoint.h; `root` must be visible to every worker).
  // Save: every worker writes its own blocks in parallel; committed atomically as
  // <root>/step_<step>; keep > 0 deletes all but the newest `keep`. Restore: each array into
  // `spec` on this cluster (another layout or mesh than at save time works), each worker reading
  // only the blocks it needs. Errors: see ArrayRegistry (server/array_registry.h): NotFound,
  // InvalidArgument, DataLoss naming the array and file, a worker's error naming its rank.
  absl::StatusOr<v1::SaveCheckpointResponse> SaveCheckpoint(
      const v1::SaveCheckpointRequest& request, absl::Duration timeout = absl::Minutes(10));
  absl::StatusOr<v1::RestoreCheckpointResponse> RestoreCheckpoint(
      const v1::RestoreCheckpointRequest& request, absl::Duration timeout = absl::Minutes(10));

  // Stops the workers and then the coordinator.
  absl::Status Shutdown();

 private:
  Client(std::string address, std::shared_ptr<grpc::Channel> channel);
  // Sets the call's deadline and this client's session (its arrays' owner).
  void Prepare(grpc::ClientContext& ctx, absl::Duration timeout) const;
  // Sends KeepAlive every third of the coordinator's lease until the client is destroyed.
  void KeepAliveLoop();
  std::string address_;
  std::shared_ptr<grpc::Channel> channel_;  // PutArray and GetArray go out raw on it
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  const std::string session_;  // random, one per Client
  absl::Mutex mu_;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  std::thread keepalive_;
};

// "step 100/468 | epoch 0.21 | 8512 samples/s | loss 0.6123 | acc 0.781 | ETA 0:12"
std::string FormatProgress(const v1::StepReport& report);
// "worker rank 3 (127.0.0.1:4567, pid 1234 on host h) lost after step 50: killed; ..." and
// "recovered at step 40 from /ckpt/step_40 in 2.1 s (re-forming 1.6 s), restart 1"; "" for
// other events.
std::string FormatRecoveryEvent(const v1::JobEvent& event);

}  // namespace meshrun

#endif  // MESHRUN_CLIENT_INCLUDE_MESHRUN_CLIENT_H_
