// The coordinator's registry of workers: rank assignment, mesh coordinates, liveness. Registration
// (rank assignment and the wait for the mesh to form) is in worker_registration.cc.
#ifndef MESHRUN_SERVER_WORKER_REGISTRY_H_
#define MESHRUN_SERVER_WORKER_REGISTRY_H_

#include <atomic>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/port/process.h"
#include "core/sharding/mesh.h"
#include "meshrun/v1/coordinator.pb.h"

namespace meshrun {

// Workers register with (address, pid, hostname) and get rank r in arrival order (or the rank
// they ask for), laid out on the mesh row-major. Thread-safe; no gRPC in here.
class WorkerRegistry {
 public:
  // `adopt_cluster_id`: the id was not chosen by the operator, so a restarted coordinator takes
  // the id its re-registering workers present (RegisterRequest.cluster_id) while none has joined.
  // `heartbeat_timeout`: a registered worker silent this long is dead, and a fresh worker that
  // registers while one is re-forms the cluster in its place (BeginRecovery).
  WorkerRegistry(Mesh mesh, std::string cluster_id, bool adopt_cluster_id = false,
                 absl::Duration heartbeat_timeout = absl::Seconds(3));

  // The mesh (a copy: Shrink may replace it).
  Mesh mesh();
  std::string cluster_id();
  int expected();
  absl::Duration heartbeat_timeout() const { return heartbeat_timeout_; }

  // Registers a worker and blocks until every expected worker has registered, `deadline` passes
  // or `cancelled` (polled every 100 ms; the worker's call was cancelled: it left) returns true.
  // A worker that registers again from the same address keeps its rank; another process from that
  // address (another incarnation) replaces it at once (BeginRecovery). A worker that gives up
  // (deadline or cancellation) before the mesh is complete frees its rank, so a fresh worker can
  // take it. A worker that finds the mesh whole waits up to the heartbeat timeout for a holder to
  // fall silent (a respawned replacement often starts before its predecessor's loss is known)
  // before it is refused. While the cluster re-forms (BeginRecovery), the survivors' ranks are kept
  // for them (they ask for them) until `kSurvivorGrace` has passed; a fresh worker takes a lost
  // rank. Errors: DeadlineExceeded saying how many workers are still missing; Cancelled;
  // FailedPrecondition when the cluster is full or the requested rank is taken (naming its
  // holder) or out of range.
  absl::StatusOr<v1::RegisterResponse> Register(const v1::RegisterRequest& request,
                                                absl::Time deadline,
                                                const std::function<bool()>& cancelled = nullptr);

  // Records a heartbeat of `generation` (RegisterResponse.generation; 0: unknown). Returns true
  // when the worker must restart: it belongs to an earlier generation of this coordinator's
  // cluster, which is re-forming. Errors: NotFound for an unknown rank or another cluster's id.
  // `incarnation` must be the registered process's (RegisterRequest.incarnation): another
  // process cannot keep a rank alive. Errors: NotFound also for another incarnation.
  absl::StatusOr<bool> Heartbeat(int rank, const std::string& cluster_id, uint64_t generation = 0,
                                 uint64_t incarnation = 0);

  // Re-forms the cluster after the loss of `lost` (ranks; elastic recovery, as torchrun's agent
  // does on a worker failure): a new generation begins, every rank is unregistered, the
  // survivors are told to restart by their next heartbeat (and rejoin, asking for their ranks,
  // which are kept for them for kSurvivorGrace), and a fresh worker takes a lost rank. The mesh is
  // whole again once every rank has registered (WaitUntilReady). Returns the new generation.
  uint64_t BeginRecovery(const std::vector<int>& lost, const std::string& reason);
  // Changes on every BeginRecovery; a coordinator's first one is its start time in microseconds,
  // so a restarted coordinator's never equals its predecessor's.
  uint64_t generation();
  // The workers the latest BeginRecovery re-formed the cluster without, as they were registered.
  std::vector<v1::PeerInfo> last_lost();
  static constexpr absl::Duration kSurvivorGrace = absl::Seconds(15);
  // Continues on `smaller` (recovery.min_workers, as Horovod elastic does) when the mesh did not
  // re-form: the workers registered in the current generation take ranks 0..smaller.size()-1 in
  // their rank order (their pending registrations then answer with the new mesh), the others
  // stay out (their registrations time out), and a new generation begins. Errors:
  // FailedPrecondition when fewer than smaller.size() workers are registered.
  absl::Status Shrink(const Mesh& smaller);
  // Workers registered in the current generation.
  int RegisteredCount();

  // Blocks until every worker has registered and sent a heartbeat since (so its services are
  // set up). Errors: DeadlineExceeded naming the ranks (or count) still missing.
  absl::Status WaitUntilReady(absl::Time deadline);

  // Registered ranks whose last heartbeat is older than `timeout`, and at once those whose process
  // this coordinator sees (same host and pid namespace: core/port/process.h's ObserveProcess)
  // has exited or is stopped, unless set_process_checks(false); each with why: "missed heartbeats
  // for 3s", "has exited", "is stopped (SIGSTOP)".
  std::vector<std::pair<int, std::string>> DeadRanks(absl::Duration timeout);
  // Whether DeadRanks looks at the processes it can see (default true). Thread-safe.
  void set_process_checks(bool on) { process_checks_.store(on); }
  // The worker that held `rank` (registered now or before the cluster last re-formed); a
  // default PeerInfo for a rank never held.
  v1::PeerInfo Peer(int rank);
  // Every registered worker, by rank.
  std::vector<v1::PeerInfo> Peers();
  // Whether the OOM killer ran in the memory cgroup of worker `p` (its process identity) since it
  // registered, as this coordinator sees it (core/port/process.h's WatchOomKills: only a worker
  // on this host, in this pid namespace). Meant for a worker whose process is gone.
  bool KilledByOom(const v1::PeerInfo& p);
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
  // A heartbeat's answer for `rank`: whether shutdown was requested, which `rank` now knows.
  bool TellShutdown(int rank);
  // Waits until every registered worker has been told to stop by a heartbeat's answer, or until
  // `deadline` (a dead worker never asks); false at the deadline.
  bool AwaitShutdownTold(absl::Time deadline);

 private:
  struct Entry {
    v1::PeerInfo peer;  // kept after the cluster re-forms, until the rank is taken again
    bool registered = false;
    bool ready = false;  // heartbeated after registering
    absl::Time last_heartbeat;
    bool kept_for_survivor = false;  // re-forming: a fresh worker does not take this rank
    uint64_t incarnation = 0;        // RegisterRequest.incarnation
    bool told_to_stop = false;       // a heartbeat's answer said shutdown
  };
  int RegisteredCountLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  uint64_t BeginRecoveryLocked(const std::vector<int>& lost, const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The rank a fresh registration gets: the requested one, else the first free one (a survivor's
  // rank only after its grace), re-forming the cluster in place of a dead worker when none is
  // free. Errors: FailedPrecondition as Register's; `*full` says the mesh is whole and alive.
  absl::StatusOr<int> AssignRankLocked(const v1::RegisterRequest& req, bool* full)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Register's steps. FailedPrecondition when `req` names another cluster than this one (a
  // restarted coordinator adopts the first one it hears of).
  absl::Status CheckClusterIdLocked(const v1::RegisterRequest& req)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The rank `req`'s process already holds (a retried call, a rejoin), or -1; a new process at a
  // registered address takes its place while the mesh forms, or starts a recovery once formed.
  int RegisteredRankLocked(const v1::RegisterRequest& req) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Assigns `req` a rank (AssignRankLocked), waiting while the mesh is full for a rank to free,
  // and records the worker in it.
  absl::StatusOr<int> TakeRankLocked(const v1::RegisterRequest& req, absl::Time deadline,
                                     const std::function<bool()>& cancelled)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits until every rank has registered; the rank `req` holds then. DeadlineExceeded when the
  // mesh did not form in time or re-formed without it; Cancelled when the caller left.
  absl::StatusOr<int> AwaitFormedLocked(const v1::RegisterRequest& req, absl::Time deadline,
                                        const std::function<bool()>& cancelled)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees `rank` if `address` still holds it and the mesh is incomplete (a worker that left).
  void ReleaseIfWaitingLocked(int rank, const std::string& address)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  int ExpectedLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_) { return mesh_.size(); }

  const absl::Duration heartbeat_timeout_;
  std::atomic<bool> process_checks_{true};
  absl::Mutex mu_;
  Mesh mesh_ ABSL_GUARDED_BY(mu_);
  uint64_t generation_ ABSL_GUARDED_BY(mu_);
  const uint64_t first_generation_;
  absl::Time survivor_grace_end_ ABSL_GUARDED_BY(mu_);
  absl::Time formed_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();  // the mesh last became whole
  std::vector<v1::PeerInfo> last_lost_ ABSL_GUARDED_BY(mu_);
  // By process identity: the OOM kill counts of the workers this coordinator sees, taken at
  // registration (again at a heartbeat when the worker moved to another memory cgroup); those
  // of exited processes are pruned when the map outgrows the mesh.
  std::map<std::string, OomKillWatch> oom_watches_ ABSL_GUARDED_BY(mu_);
  // At registration: starts watching `p` if this coordinator sees its process.
  void WatchOomKillsLocked(const v1::PeerInfo& p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // At a heartbeat: a watched worker's new memory cgroup, if it moved (no /proc/PID/stat read
  // nor pruning on this path).
  void RewatchOomKillsLocked(const v1::PeerInfo& p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string cluster_id_ ABSL_GUARDED_BY(mu_);
  bool adopt_cluster_id_ ABSL_GUARDED_BY(mu_);
  std::vector<Entry> workers_ ABSL_GUARDED_BY(mu_);
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t collective_epoch_ ABSL_GUARDED_BY(mu_);
};

}  // namespace meshrun

#endif  // MESHRUN_SERVER_WORKER_REGISTRY_H_
