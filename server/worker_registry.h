// The coordinator's registry of workers: rank assignment, mesh coordinates, liveness.
#ifndef MESHRUN_SERVER_WORKER_REGISTRY_H_
#define MESHRUN_SERVER_WORKER_REGISTRY_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/sharding/mesh.h"
#include "meshrun/v1/coordinator.pb.h"

namespace meshrun {

// Workers register with (address, pid, hostname) and get rank r in arrival order (or the rank
// they ask for), laid out on the mesh row-major. Thread-safe; no gRPC in here.
class WorkerRegistry {
 public:
  // `adopt_cluster_id`: the id was not chosen by the operator, so a restarted coordinator takes
  // the id its re-registering workers present (RegisterRequest.cluster_id) while none has joined.
  WorkerRegistry(Mesh mesh, std::string cluster_id, bool adopt_cluster_id = false);

  const Mesh& mesh() const { return mesh_; }
  std::string cluster_id();
  int expected() const { return mesh_.size(); }

  // Registers a worker and blocks until every expected worker has registered, `deadline` passes
  // or `cancelled` (polled every 100 ms; the worker's call was cancelled: it left) returns true.
  // A worker that registers again from the same address keeps its rank. A worker that gives up
  // (deadline or cancellation) before the mesh is complete frees its rank, so a fresh worker can
  // take it. Errors: DeadlineExceeded saying how many workers are still missing; Cancelled;
  // FailedPrecondition when the cluster is full or the requested rank is taken (naming its
  // holder) or out of range.
  absl::StatusOr<v1::RegisterResponse> Register(const v1::RegisterRequest& request,
                                                absl::Time deadline,
                                                const std::function<bool()>& cancelled = nullptr);

  // Records a heartbeat. Errors: NotFound for an unknown rank or another cluster's id.
  absl::Status Heartbeat(int rank, const std::string& cluster_id);

  // Blocks until every worker has registered and sent a heartbeat since (so its services are
  // set up). Errors: DeadlineExceeded naming the ranks (or count) still missing.
  absl::Status WaitUntilReady(absl::Time deadline);

  // Ranks whose last heartbeat is older than `timeout`.
  std::vector<int> DeadRanks(absl::Duration timeout);
  // Every registered worker, by rank.
  std::vector<v1::PeerInfo> Peers();
  std::vector<v1::WorkerStatus> Snapshot(absl::Duration heartbeat_timeout);
  // "rank 3 (127.0.0.1:4567, pid 1234)".
  std::string Describe(int rank);

  // The collective epoch (core/collectives/transport.h) that every request running collectives on
  // the workers carries. The first is the coordinator's start time in microseconds, so a restarted
  // coordinator never reuses an epoch its workers have seen.
  uint64_t collective_epoch();
  // Moves to a new epoch, after a run that failed or was aborted on any worker; returns it.
  uint64_t AdvanceCollectiveEpoch();

  // After this, heartbeats answer shutdown=true.
  void RequestShutdown();
  bool shutdown_requested();

 private:
  struct Entry {
    v1::PeerInfo peer;
    bool registered = false;
    bool ready = false;  // heartbeated after registering
    absl::Time last_heartbeat;
  };
  int RegisteredCountLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Frees `rank` if `address` still holds it and the mesh is incomplete (a worker that left).
  void ReleaseIfWaitingLocked(int rank, const std::string& address)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Mesh mesh_;
  absl::Mutex mu_;
  std::string cluster_id_ ABSL_GUARDED_BY(mu_);
  bool adopt_cluster_id_ ABSL_GUARDED_BY(mu_);
  std::vector<Entry> workers_ ABSL_GUARDED_BY(mu_);
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t collective_epoch_ ABSL_GUARDED_BY(mu_);
};

}  // namespace meshrun

#endif  // MESHRUN_SERVER_WORKER_REGISTRY_H_
