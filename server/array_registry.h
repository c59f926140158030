// Sharded arrays on the cluster: device_put splits a global array by its NamedSharding and sends
// each worker its block; device_get fetches one replica of every block and assembles them.
#ifndef MESHRUN_SERVER_ARRAY_REGISTRY_H_
#define MESHRUN_SERVER_ARRAY_REGISTRY_H_

#include <atomic>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "core/checkpoint/checkpoint_root.h"
#include "core/sharding/named_sharding.h"
#include "core/sharding/partition_spec.h"
#include "core/tensor.h"
#include "grpcpp/support/byte_buffer.h"
#include "meshrun/v1/coordinator.pb.h"
#include "meshrun/v1/input.pb.h"
#include "meshrun/v1/worker.grpc.pb.h"
#include "server/checkpoint_ops.h"
#include "server/coordinator_metrics.h"
#include "server/worker_registry.h"

namespace meshrun {

// The wire bytes of PutShardRequest{array_id: id, shard: rank's block of `global`} (the block's
// dtype, shape and row-major data), its fields in protobuf's order, the data last: one slice
// into which the block is copied straight from `global`, the only copy the coordinator makes of
// it, shared by every holder's call. REQUIRES: sharding.Validate(global.dims()).ok().
grpc::ByteBuffer PutShardRequestBytes(const Tensor& global, const NamedSharding& sharding, int rank,
                                      const std::string& id);

// Thread-safe. Every worker call has a deadline; a failed call fails the operation with the
// worker's rank in the message, and a failed Put leaves no array registered.
class ArrayRegistry {
 public:
  // A run (ShardMap) fails as soon as a worker misses heartbeats for `heartbeat_timeout` (dead
  // or hung), naming it, rather than when the others' collectives time out.
  // `metrics` (optional, must outlive the registry) gets the straggler ledger: every collective's
  // arrival skew across its group (server/straggler_ledger.h), from each successful run.
  // `checkpoint_root`: the directory the coordinator's checkpoint calls may name paths under
  // (its --checkpoint_root; "/": anywhere); others are refused with PermissionDenied before
  // anything is created, written or read.
  explicit ArrayRegistry(WorkerRegistry* workers, absl::Duration rpc_timeout = absl::Seconds(60),
                         absl::Duration heartbeat_timeout = absl::Seconds(3),
                         CoordinatorMetrics* metrics = nullptr,
                         const std::string& checkpoint_root = "/")
      : workers_(workers),
        rpc_timeout_(rpc_timeout),
        heartbeat_timeout_(heartbeat_timeout),
        metrics_(metrics),
        checkpoint_root_(checkpoint_root, "the coordinator's"),
        id_prefix_(RandomIdPrefix()) {}

  // Errors: InvalidArgument for a spec that does not fit the array on the mesh (naming the spec,
  // shape and dim), an unsupported dtype, or an id in use; worker errors. The shards go to the
  // workers at once: each distinct block is serialised once, its holders sent the same bytes, and
  // the blocks serialised at once stay within kPutBytesInFlight (or one block, if larger), so the
  // coordinator's memory follows the array's size, not the worker count. A large block that
  // several workers hold is sent in pieces and gathered by them instead (PutGathered).
  static constexpr int64_t kPutBytesInFlight = int64_t{256} << 20;
  absl::StatusOr<v1::ArrayInfo> Put(const Tensor& global, const PartitionSpec& spec,
                                    std::string id);
  // GetArrayResponse's wire bytes for array `id`: its info, one replica of every distinct block
  // and the rank it came from (device_get's transfer; the client assembles). Each block is the
  // Tensor of its worker's GetShard response, passed on without a copy. Errors: NotFound naming
  // the id; worker errors naming the worker.
  absl::StatusOr<grpc::ByteBuffer> GetArrayBytes(const std::string& id);
  // Frees `ids` on every worker and forgets them; every known id is freed even when others are
  // unknown. Errors: NotFound naming the unknown ids (a lost worker's arrays say so); worker
  // errors naming the worker.
  absl::Status Delete(absl::Span<const std::string> ids);
  absl::Status Delete(const std::string& id) { return Delete(absl::MakeConstSpan(&id, 1)); }
  // Put sends each holder of a block 1/k of it and has the holders all-gather it (PutGathered)
  // when the block has at least `bytes` bytes (default 1 MiB; -1: never). Set before use.
  void set_put_gather_min_bytes(int64_t bytes) { put_gather_min_bytes_ = bytes; }
  std::vector<v1::ArrayInfo> List();
  // shard_map: runs `request.program` on every worker over the input arrays, whose specs must
  // equal the program's in_specs, and registers the outputs laid out by out_specs. On failure
  // every worker is told to abort, the cluster moves to a new collective epoch (so nothing the
  // failed run left in flight is read by the next one), and no output is registered.
  // Errors: InvalidArgument naming the argument, array and spec that do not match, or an output
  // spec that does not fit; worker errors (a collective deadline names the rank waited for).
  // Results named in request.fetch_outputs come back in the response instead of being registered.
  // request.more_runs: further runs in the same call, back to back on the workers (Keras's
  // steps_per_execution; coordinator.proto); InvalidArgument names the run, argument and array
  // that do not fit, or a kept result that takes no donated argument's id.
  // `cancel` (optional): when it turns true while the run is in flight, the workers are aborted
  // within 100 ms and the call fails with Cancelled.
  absl::StatusOr<v1::ShardMapResponse> ShardMap(const v1::ShardMapRequest& request,
                                                const std::atomic<bool>* cancel = nullptr);
  // As above for `program`, serialized as `serialized` (the partitioner's cached programs, which
  // come back every step: neither copied nor serialized again); request.program() is ignored.
  absl::StatusOr<v1::ShardMapResponse> ShardMap(const v1::ShardMapProgram& program,
                                                const std::string& serialized,
                                                const v1::ShardMapRequest& request,
                                                const std::atomic<bool>* cancel = nullptr);

  // Sharded checkpoints (core/checkpoint/checkpoint.h). Save: every worker writes the blocks it
  // owns of the named arrays in parallel into <root>/step_<N>.tmp-*, then the manifest is written
  // and the directory committed by a rename; older committed checkpoints beyond `keep` (> 0) are
  // deleted, as are uncommitted leftovers. A failure (a full disk, a dead worker) leaves the
  // previous checkpoints as they were. Errors: NotFound for an unknown array id; InvalidArgument
  // for a duplicate name; the failing worker's error naming its rank and file.
  absl::StatusOr<v1::SaveCheckpointResponse> SaveCheckpoint(
      const v1::SaveCheckpointRequest& request);
  // Restore into each array's target spec on this cluster's mesh (any layout, any mesh that the
  // shapes divide over): every worker reads only the saved blocks its block intersects.
  // Errors: NotFound for a missing checkpoint or array (naming it); InvalidArgument for a target
  // layout that cannot hold the saved shape or an id in use; DataLoss naming the array and file
  // for a corrupt or truncated block. Nothing is registered on failure.
  absl::StatusOr<v1::RestoreCheckpointResponse> RestoreCheckpoint(
      const v1::RestoreCheckpointRequest& request);
  // PermissionDenied naming `path` unless it lies under the coordinator's checkpoint root.
  absl::Status CheckCheckpointPath(const std::string& path) const {
    return checkpoint_root_.Check(path);
  }

  // Peers' in-memory TrainState (worker.proto's KeepPeerState; torchft's healing). Keep: every
  // worker keeps its blocks of `arrays` (array_id, name) under the job run's token `job` at
  // `step`, in its memory and on its ring successor; returns the bytes of all workers' blocks.
  // Errors: the first worker's, naming its rank (a lost successor, an unknown array id).
  absl::StatusOr<int64_t> KeepPeerState(const std::string& job, int64_t step,
                                        const std::vector<CheckpointArray>& arrays);
  // The newest step of `job` on the current mesh at which every rank's copy of `names` is held by
  // the rank itself or by its successor (so one lost worker loses no block). Errors: NotFound
  // naming the ranks without a copy; a worker's error naming its rank.
  absl::StatusOr<int64_t> NewestPeerState(const std::string& job,
                                          const std::vector<std::string>& names);
  // Restores `arrays` (name, array_id, dtype, global shape, spec as kept) from the copies of
  // `job` at `step`: each worker takes its blocks from its own copy or its successor's, and the
  // arrays are registered as RestoreCheckpoint's are (bytes_read: the bytes restored). Errors:
  // InvalidArgument for an id in use; the first worker's, naming its rank. Nothing is stored or
  // registered on failure.
  absl::StatusOr<v1::RestoreCheckpointResponse> RestorePeerState(
      const std::string& job, int64_t step, const std::vector<CheckpointArray>& arrays);

  // Frees every worker's copies of `job` (the job ended); best effort.
  void DropPeerState(const std::string& job);

  // Errors: NotFound naming the id and the arrays that exist.
  absl::StatusOr<v1::ArrayInfo> Info(const std::string& id);

  // Opens a sharded input pipeline (core/data/input_pipeline.h) on every worker as `id` (empty:
  // one is picked; an open id is replaced): each checks the dataset and the spec before
  // answering. Errors: the first worker's, naming its rank (a missing or truncated file, a field
  // that does not fit, a batch the layout does not divide); FailedPrecondition when workers see
  // different example counts. Nothing stays open on failure.
  absl::StatusOr<v1::InputInfo> OpenInput(const v1::InputSpec& spec, std::string id);
  // Errors: NotFound naming the id.
  absl::Status CloseInput(const std::string& id);

 private:
  // One stub per rank, for one membership. Held as a snapshot (shared_ptr): a call keeps using
  // the stubs it started with even if the cluster re-forms meanwhile and EnsureStubs replaces
  // them (the old workers' calls then fail, instead of reading a freed vector).
  // The channels are kept for raw calls, whose request is serialised once for several workers
  // (SendShards).
  struct Stubs {
    std::vector<std::shared_ptr<grpc::Channel>> channels;
    std::vector<std::unique_ptr<v1::Worker::Stub>> stubs;
    const std::unique_ptr<v1::Worker::Stub>& operator[](size_t r) const { return stubs[r]; }
  };
  using StubsRef = std::shared_ptr<const Stubs>;
  // Stubs for the current membership; after the cluster re-formed (a new generation), the arrays
  // and inputs the old workers held are forgotten. Waits up to 10 s for the workers.
  absl::StatusOr<StubsRef> EnsureStubs();
  // After the cluster re-formed (WorkerRegistry::BeginRecovery: its workers started afresh),
  // forgets the arrays and inputs the previous workers held and the stubs that reach them, keeping
  // the arrays' ids for NoSuchArray. Called before any lookup, so a request naming such an array
  // is refused here rather than by every worker.
  void ForgetIfReformed() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // NotFound for `id`: "gone" with the reason where the last re-form forgot it, else the ids held.
  absl::Status NoSuchArray(const std::string& id) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The stubs EnsureStubs made last, without waiting; FailedPrecondition before the first (an
  // array exists only after it ran, so calls about arrays use these).
  absl::StatusOr<StubsRef> CurrentStubs();
  // ShardMap's steps (server/array_registry_args.cc, server/array_registry_run.cc).
  // Each of `p`'s results as an array on the mesh: dtype, global shape (each local dim times the
  // blocks its out_spec entry names), sharding and bytes per worker; no id yet. Errors:
  // InvalidArgument for a result that is not a buffer or an out_spec that does not fit it.
  absl::StatusOr<std::vector<v1::ArrayInfo>> ResultInfos(const v1::ShardMapProgram& p) const;
  // The request's arguments fit `p`: counts, the feed, each array's existence and layout per
  // run, a donated argument the same array in every run. Errors: InvalidArgument naming them.
  absl::Status CheckShardMapArguments(const v1::ShardMapProgram& p,
                                      const v1::ShardMapRequest& request);
  // Sets the id of each result of `outputs` that is kept (request.output_ids, else a fresh one)
  // and fills `donated` (array ids) and `fetched` (result indices). Errors: InvalidArgument for
  // a bad index or an id in use that no donated argument frees.
  absl::Status AssignResultIds(const v1::ShardMapProgram& p, const v1::ShardMapRequest& request,
                               std::vector<v1::ArrayInfo>& outputs, std::set<std::string>& donated,
                               std::set<int>& fetched);
  // What every worker answered to one run, by rank.
  struct WorkerRun {
    std::vector<grpc::Status> results;
    std::vector<v1::RunShardMapResponse> responses;
    // Per rank: its result came after the others were told to abort. An aborted rank's ring
    // streams close, so its neighbours may fail with "disconnected" before their own abort
    // lands: such transport errors are consequences of the abort, not failures of their own.
    std::vector<char> after_abort;
    int dead_rank = -1;      // a rank that missed heartbeats, exited or stopped ...
    std::string dead_why;    // ... as WorkerRegistry::DeadRanks says
    bool cancelled = false;  // `cancel` was set while the run was in flight
  };
  // Put of a block held by several workers (a `spec` that leaves mesh axes out) of at least
  // put_gather_min_bytes: each holder is sent 1/k of it (laid out as `split`, SplitAmongHolders)
  // and the holders all-gather their pieces into `id`, so the coordinator sends each block once,
  // not once per holder (a 64 MiB P() on 2x4: 64 MiB instead of 512). The pieces are freed.
  absl::StatusOr<v1::ArrayInfo> PutGathered(const Tensor& global, const PartitionSpec& spec,
                                            const PartitionSpec& split, const std::string& id);
  // PutGathered's run: the array `pieces_id`, laid out as `split`, all-gathered into `id`, laid
  // out as `spec`; the pieces are donated.
  absl::StatusOr<v1::ShardMapResponse> GatherPieces(const Tensor& global, const PartitionSpec& spec,
                                                    const PartitionSpec& split,
                                                    const std::string& pieces_id,
                                                    const std::string& id);
  // Has every worker drop its blocks of `ids` (DeleteShard); a worker lacking some answers
  // NotFound after dropping the others.
  absl::Status DropOnWorkers(const Stubs& stubs, const std::vector<std::string>& ids);
  // Put's transfer: each rank's block of `global` to it, as PutShard `id`.
  absl::Status SendShards(const Stubs& stubs, const std::vector<int>& ranks, const Tensor& global,
                          const NamedSharding& sharding, const std::string& id);
  // Sends runs[r] to rank r, all at once, and waits for every answer; the first failure (or a
  // dead worker, or `cancel`) has the others aborted. REQUIRES: run_mu_ held.
  WorkerRun RunOnWorkers(const Stubs& stubs, const std::vector<v1::RunShardMapRequest>& runs,
                         const v1::ShardMapRequest& request, uint64_t epoch,
                         const std::atomic<bool>* cancel) ABSL_EXCLUSIVE_LOCKS_REQUIRED(run_mu_);
  // The run's outcome as one status: a dead or unreachable worker, the ranks whose program
  // failed, a collective deadline naming who had not arrived, or Cancelled.
  absl::Status RunStatus(const WorkerRun& run, const v1::ShardMapRequest& request);
  // The response's timings and fetched results (each block from the rank `returned_by` names),
  // moved out of run.responses.
  // Errors: Internal for a worker that returned the wrong number of results.
  absl::Status AddFetched(const v1::ShardMapRequest& request,
                          const std::vector<v1::ArrayInfo>& outputs,
                          const std::vector<std::vector<int>>& returned_by, WorkerRun& run,
                          v1::ShardMapResponse& response);
  // A request's feed fits its program: an open input, one argument per field, each with the
  // field's in_spec, dtype and block shape, none donated nor given an array id; the runs' steps
  // within a one-pass input. Errors: NotFound, InvalidArgument, OutOfRange naming the value.
  absl::Status CheckFeed(const v1::ShardMapRequest& request);
  void CloseOnWorkers(const Stubs& stubs, const std::string& id);
  // ForRanks over every rank, as server/checkpoint_ops.h's ForEachWorker, through `stubs`.
  ForEachWorker EachWorker(StubsRef stubs);
  // Runs call(rank) for each rank in `ranks` in parallel, each within the RPC timeout; the first
  // error, naming its rank. A call to a worker that dies or stops meanwhile (WorkerRegistry::
  // DeadRanks) is cancelled at once: Unavailable "worker rank R (...) is stopped (SIGSTOP)".
  absl::Status ForRanks(const std::vector<int>& ranks,
                        const std::function<grpc::Status(int rank, grpc::ClientContext*)>& call);
  // The one liveness watch of calls in flight on workers: with `mu` held, waits until
  // `settled()` holds, and every 100 ms meanwhile asks WorkerRegistry::DeadRanks which workers
  // died, exited or stopped and passes them to `on_poll` (with `mu` held; empty when none);
  // `on_poll` returning true ends the wait early.
  using DeadWorkers = std::vector<std::pair<int, std::string>>;  // (rank, why)
  void AwaitWatchingWorkers(absl::Mutex& mu, const std::function<bool()>& settled,
                            const std::function<bool(const DeadWorkers& dead)>& on_poll)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  WorkerRegistry* workers_;
  const absl::Duration rpc_timeout_;
  const absl::Duration heartbeat_timeout_;
  CoordinatorMetrics* const metrics_;
  const CheckpointRoot checkpoint_root_;
  absl::Mutex run_mu_;  // held while a program runs on the workers (ShardMap); before mu_
  absl::Mutex mu_;
  StubsRef stubs_ ABSL_GUARDED_BY(mu_);                 // null until the first EnsureStubs
  uint64_t stubs_generation_ ABSL_GUARDED_BY(mu_) = 0;  // the membership the stubs reach
  std::map<std::string, v1::ArrayInfo> arrays_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, v1::InputInfo> inputs_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> gone_ ABSL_GUARDED_BY(mu_);  // array ids the last re-form forgot
  int64_t put_gather_min_bytes_ = int64_t{1} << 20;  // set_put_gather_min_bytes
  // Ids the registry picks: "array-<prefix>-<n>". The prefix is random per coordinator, so an id
  // from before a restart (a client's stale handle, freed when it is garbage-collected) never
  // names an array of the new coordinator.
  std::string NewIdLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static std::string RandomIdPrefix();
  const std::string id_prefix_;
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace meshrun

#endif  // MESHRUN_SERVER_ARRAY_REGISTRY_H_
