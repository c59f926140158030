// The Worker gRPC service: hosts shards, runs shard_map programs fed by its input pipelines,
// joins collectives and benchmarks.
#ifndef MESHRUN_WORKER_WORKER_SERVICE_H_
#define MESHRUN_WORKER_WORKER_SERVICE_H_

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "core/checkpoint/checkpoint_root.h"
#include "core/collectives/communicator.h"
#include "core/collectives/mailbox.h"
#include "core/data/input_pipeline.h"
#include "core/port/work_threads.h"
#include "core/sharding/mesh.h"
#include "meshrun/v1/worker.grpc.pb.h"
#include "worker/compute_thread.h"
#include "worker/grpc_transport.h"
#include "worker/peer_state.h"
#include "worker/shard_store.h"
#include "worker/shm_transport.h"
#include "worker/worker_metrics.h"

namespace meshrun {

// What the coordinator told this worker when it registered.
struct Membership {
  int rank = 0;
  Mesh mesh;
  std::vector<std::string> addresses;  // by rank
  std::string cluster_id;
  // By rank, where each worker runs; peers on this worker's host (same non-empty host id) get
  // shared-memory links. Empty: gRPC to everyone.
  std::vector<ShmPeer> shm_peers;
  uint64_t generation = 0;  // RegisterResponse.generation
};

// Thread-safe. RPCs that run programs (RunShardMap, BenchmarkCollective) run one at a time; Abort
// may arrive at any moment and fails the collectives in flight. Every error a handler returns
// starts with "rank R: ". PutShard and GetShard are served raw on gRPC's callback API, so that a
// shard's bytes go in with one copy (PutShardBytes) and out with none (GetShardBytes); the other
// RPCs are synchronous.
class WorkerService final : public v1::Worker::WithRawCallbackMethod_PutShard<
                                v1::Worker::WithRawCallbackMethod_GetShard<v1::Worker::Service>> {
 public:
  // `compute_threads`: oneDNN threads per worker (0: library default).
  // `metrics` may be null; it must outlive the service. `arena`: where this worker's large arrays
  // live, lent to the shared-memory transport for single-copy collectives with co-located peers
  // (null: none); it must outlive the service.
  // `memory_budget_bytes`: what this worker's stored shards and a program's buffers may take
  // together; a request past it is refused with ResourceExhausted naming its bytes (0: the
  // host's physical memory). `checkpoint_root`: SaveShards and LoadShards touch files under this
  // directory only; a path that resolves outside it is refused with PermissionDenied.
  explicit WorkerService(int compute_threads, WorkerMetrics* metrics = nullptr,
                         ShmArena* arena = nullptr, int64_t memory_budget_bytes = 0,
                         std::string checkpoint_root = "/");
  ~WorkerService() override;

  // The collective options every program and benchmark starts from (their timeouts are the
  // request's). Call before serving; not thread-safe.
  void set_collective_defaults(const CollectiveOptions& options) { collective_defaults_ = options; }
  // How the gRPC transport stripes large messages over several streams per peer. Call before
  // Join; not thread-safe.
  void set_grpc_stripes(const GrpcStripeOptions& options) { grpc_stripes_ = options; }

  // Sets up the transport once the coordinator has assigned the rank; attaches `ring` to it.
  void Join(Membership membership, RingService* ring);

  grpc::Status Abort(grpc::ServerContext*, const v1::AbortRequest*, v1::AbortResponse*) override;
  // Fails the collectives of the run in flight, as an Abort of the current epoch does: used when
  // the coordinator that sent it is gone (a restarted one never finishes it).
  void AbortRuns(const std::string& reason);
  grpc::Status RunShardMap(grpc::ServerContext*, const v1::RunShardMapRequest*,
                           v1::RunShardMapResponse*) override;
  grpc::Status SaveShards(grpc::ServerContext*, const v1::SaveShardsRequest*,
                          v1::SaveShardsResponse*) override;
  grpc::Status LoadShards(grpc::ServerContext*, const v1::LoadShardsRequest*,
                          v1::LoadShardsResponse*) override;
  // Stores the request's shard (PutShardBytes), on a thread of its own when it is large (the
  // copy would hold up gRPC's callback thread, which also delivers the ring's chunks).
  grpc::ServerUnaryReactor* PutShard(grpc::CallbackServerContext* ctx,
                                     const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  // Stores the shard of `request`, a v1::PutShardRequest's wire bytes, under its array id,
  // replacing any shard of that id: its data copied once, from the request's slices into the
  // stored Tensor (ParseWithTensor). Errors: InvalidArgument for bytes that are not such a
  // request, an empty id or a bad Tensor; ResourceExhausted past the memory budget.
  absl::Status PutShardBytes(const grpc::ByteBuffer& request);
  // Requests of at least this many bytes are stored on a thread of their own.
  static constexpr size_t kPutShardInlineBytes = size_t{1} << 20;
  // Parses the request as a v1::GetShardRequest and answers with GetShardBytes.
  grpc::ServerUnaryReactor* GetShard(grpc::CallbackServerContext* ctx,
                                     const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  // GetShardResponse's wire bytes for `req`'s stored shard: a header slice, then a slice over the
  // stored tensor's own memory (not copied; the slice holds the tensor until gRPC has sent it, so
  // a donation meanwhile does not reuse it in place). Errors: NotFound for an unknown id.
  absl::StatusOr<grpc::ByteBuffer> GetShardBytes(const v1::GetShardRequest& req);
  grpc::Status DeleteShard(grpc::ServerContext*, const v1::DeleteShardRequest*,
                           v1::DeleteShardResponse*) override;
  grpc::Status BenchmarkCollective(grpc::ServerContext*, const v1::BenchmarkCollectiveRequest*,
                                   v1::BenchmarkCollectiveResponse*) override;
  grpc::Status OpenInputPipeline(grpc::ServerContext*, const v1::OpenInputPipelineRequest*,
                                 v1::OpenInputPipelineResponse*) override;
  grpc::Status CloseInputPipeline(grpc::ServerContext*, const v1::CloseInputPipelineRequest*,
                                  v1::CloseInputPipelineResponse*) override;
  // peer_state_rpcs.cc: the peers' in-memory TrainState (worker.proto has their contracts).
  grpc::Status KeepPeerState(grpc::ServerContext*, const v1::KeepPeerStateRequest*,
                             v1::KeepPeerStateResponse*) override;
  grpc::Status HoldPeerState(grpc::ServerContext*, const v1::HoldPeerStateRequest*,
                             v1::HoldPeerStateResponse*) override;
  grpc::Status PeerStateInfo(grpc::ServerContext*, const v1::PeerStateInfoRequest*,
                             v1::PeerStateInfoResponse*) override;
  grpc::Status FetchPeerState(grpc::ServerContext*, const v1::FetchPeerStateRequest*,
                              v1::FetchPeerStateResponse*) override;
  grpc::Status RestorePeerState(grpc::ServerContext*, const v1::RestorePeerStateRequest*,
                                v1::RestorePeerStateResponse*) override;
  grpc::Status DropPeerState(grpc::ServerContext*, const v1::DropPeerStateRequest*,
                             v1::DropPeerStateResponse*) override;
  // The copies this worker holds; the runner passes them over a restart of the process.
  PeerStateStore& peer_state() { return peer_state_; }

 private:
  grpc::Status Error(const absl::Status& s) const;
  // ResourceExhausted naming `what` and its bytes unless `bytes` more fit in the memory budget
  // beside the stored shards and the peers' state copies.
  absl::Status CheckMemoryBudget(const std::string& what, int64_t bytes);
  // Moves the transport to collective epoch `epoch` before a run (0: stays in the current one);
  // an epoch the coordinator already aborted is entered aborted. Errors: FailedPrecondition for
  // an epoch earlier than the current one (a stale request).
  absl::Status EnterEpoch(uint64_t epoch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_mu_);
  // Called before waiting for job_mu_: a request of a later epoch than the transport's fails at
  // once what this rank still runs in an earlier one. The coordinator advances the epoch only
  // after giving a run up and aborting it on every rank it could reach; a rank it could not (one
  // stopped with SIGSTOP, or cut off) would otherwise finish that run's collectives only at their
  // deadline, holding the new run behind it.
  void EndEarlierEpochs(uint64_t epoch) ABSL_LOCKS_EXCLUDED(epoch_mu_);
  // A run that failed leaves its epoch aborted on this rank, so no later collective of that epoch
  // can read what the failed one left behind; the coordinator moves every rank to a new epoch.
  void AbortEpoch(const absl::Status& cause) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_mu_);
  // The membership, once Join has set it. Errors: FailedPrecondition before.
  absl::StatusOr<Membership> JoinedMembership();

  const int compute_threads_;
  CollectiveOptions collective_defaults_;
  GrpcStripeOptions grpc_stripes_;
  const int64_t memory_budget_bytes_;
  const CheckpointRoot checkpoint_root_;
  WorkerMetrics* const metrics_;
  ShmArena* const arena_;
  absl::Mutex join_mu_;
  bool joined_ ABSL_GUARDED_BY(join_mu_) = false;
  Membership membership_;                 // set once by Join
  std::unique_ptr<Mailbox> mailbox_;      // set once by Join
  std::unique_ptr<Transport> transport_;  // ShmTransport over GrpcTransport, or GrpcTransport

  ShardStore shards_;
  PeerStateStore peer_state_;
  // The blocks `names` of the copy `key` (this worker's own) that its ring successor holds,
  // fetched in one call by `deadline`.
  absl::StatusOr<std::vector<v1::PeerStateBlock>> FetchFromSuccessor(
      const Membership& m, const v1::PeerStateKey& key, const std::vector<std::string>& names,
      absl::Time deadline);

  absl::Mutex epoch_mu_;                                   // orders Abort with EnterEpoch
  uint64_t aborted_epoch_ ABSL_GUARDED_BY(epoch_mu_) = 0;  // the latest epoch an Abort named
  absl::Status abort_reason_ ABSL_GUARDED_BY(epoch_mu_);

  // RunShardMap's work, on compute_'s thread: compiles (or finds) the program, binds each run's
  // arguments, runs, stores or returns the results.
  grpc::Status RunProgram(const v1::RunShardMapRequest* req, v1::RunShardMapResponse* resp)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_mu_);
  // What RunProgram checked of a request (worker_run_program.cc, with RunProgram and its steps).
  struct RunPlan;
  // One run (run k of the call) over the arrays `ids`: binds them, runs, and returns or stores
  // the results into `resp` and the store. On a failed run the executor is dropped from the
  // cache (recompiled on the next call, from a clean state).
  absl::Status RunOnce(const RunPlan& plan,
                       const google::protobuf::RepeatedPtrField<std::string>& ids, int k,
                       v1::RunShardMapResponse* resp) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_mu_);
  // Binds run k's arguments: fed blocks into `blocks`, the others from the store (taken where
  // donated and not shared); `kept` holds the arguments that stay in the store.
  absl::Status BindArguments(const RunPlan& plan,
                             const google::protobuf::RepeatedPtrField<std::string>& ids, int k,
                             std::vector<Tensor>& blocks,
                             std::vector<std::shared_ptr<const Tensor>>& kept)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_mu_);
  // Returns the requested results in `resp`, stores the others (a copy where one shares memory
  // with a `kept` argument) and consumes the donated arguments.
  absl::Status StoreResults(const RunPlan& plan,
                            const google::protobuf::RepeatedPtrField<std::string>& ids,
                            const std::vector<std::shared_ptr<const Tensor>>& kept,
                            v1::RunShardMapResponse* resp) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_mu_);

  // worker_inputs.cc: the dataset of `spec` (IDX ones kept once read).
  absl::StatusOr<std::shared_ptr<const Dataset>> OpenDataset(const v1::InputSpec& spec);
  // This rank's blocks, one per fed argument, for run `run` of a call with `feed`. Errors:
  // NotFound for an input that is not open; the pipeline's.
  absl::StatusOr<std::vector<Tensor>> FeedBlocks(const v1::InputFeed& feed, int run);

  absl::Mutex input_mu_;
  std::map<std::string, std::shared_ptr<InputPipeline>> inputs_ ABSL_GUARDED_BY(input_mu_);
  std::map<std::string, std::shared_ptr<const Dataset>> idx_datasets_ ABSL_GUARDED_BY(input_mu_);

  ComputeThread compute_;  // every program runs on it (a stable OpenMP team)

  absl::Mutex job_mu_;
  // Compiled shard_map programs, by fingerprint (the program's bytes and the collective
  // deadline): a train step's program comes back every step, and compiling it (buffers, oneDNN
  // primitives) costs more than running it. The few most recent are kept, as jax.jit's cache.
  struct CachedExecutor {
    std::string fingerprint;
    v1::ShardMapProgram program;
    std::unique_ptr<Executor> executor;
  };
  // The cached executor of `req`'s program and collective deadline, compiled on a miss (the
  // oldest beyond a few is dropped). Errors: InvalidArgument for bytes that do not parse as a
  // ShardMapProgram; ResourceExhausted past the memory budget; the executor's compile errors.
  absl::StatusOr<CachedExecutor*> ExecutorFor(const v1::RunShardMapRequest& req)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_mu_);
  std::vector<CachedExecutor> executors_ ABSL_GUARDED_BY(job_mu_);
  // Large PutShard requests' work (declared last: joined before anything it uses is destroyed).
  WorkThreads put_threads_;
};

}  // namespace meshrun

#endif  // MESHRUN_WORKER_WORKER_SERVICE_H_
