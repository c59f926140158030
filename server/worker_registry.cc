#include "server/worker_registry.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace meshrun {

WorkerRegistry::WorkerRegistry(Mesh mesh, std::string cluster_id, bool adopt_cluster_id)
    : mesh_(std::move(mesh)),
      cluster_id_(std::move(cluster_id)),
      adopt_cluster_id_(adopt_cluster_id),
      workers_(mesh_.size()),
      collective_epoch_(static_cast<uint64_t>(absl::ToUnixMicros(absl::Now()))) {}

std::string WorkerRegistry::cluster_id() {
  absl::MutexLock lock(&mu_);
  return cluster_id_;
}

uint64_t WorkerRegistry::collective_epoch() {
  absl::MutexLock lock(&mu_);
  return collective_epoch_;
}

uint64_t WorkerRegistry::AdvanceCollectiveEpoch() {
  absl::MutexLock lock(&mu_);
  return ++collective_epoch_;
}

int WorkerRegistry::RegisteredCountLocked() const {
  int n = 0;
  for (const auto& w : workers_) n += w.registered;
  return n;
}

void WorkerRegistry::ReleaseIfWaitingLocked(int rank, const std::string& address) {
  if (RegisteredCountLocked() == expected()) return;  // the mesh formed: the rank is kept
  if (workers_[rank].registered && workers_[rank].peer.address() == address)
    workers_[rank] = Entry();
}

absl::StatusOr<v1::RegisterResponse> WorkerRegistry::Register(
    const v1::RegisterRequest& req, absl::Time deadline, const std::function<bool()>& cancelled) {
  absl::MutexLock lock(&mu_);
  if (!req.cluster_id().empty() && req.cluster_id() != cluster_id_) {
    if (!adopt_cluster_id_ || RegisteredCountLocked() > 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("worker ", req.address(), " belongs to cluster '", req.cluster_id(),
                       "'; this coordinator serves cluster '", cluster_id_, "'"));
    }
    cluster_id_ = req.cluster_id();  // a restarted coordinator resumes its workers' cluster
  }
  adopt_cluster_id_ = false;
  int rank = -1;
  for (int r = 0; r < expected(); ++r) {
    if (workers_[r].registered && workers_[r].peer.address() == req.address()) rank = r;
  }
  if (rank < 0) {
    if (req.requested_rank() >= 0) {
      if (req.requested_rank() >= expected()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "requested rank ", req.requested_rank(), " is out of range for ", mesh_.ToString()));
      }
      if (workers_[req.requested_rank()].registered) {
        return absl::FailedPreconditionError(
            absl::StrCat("requested rank ", req.requested_rank(), " is taken by ",
                         workers_[req.requested_rank()].peer.address()));
      }
      rank = req.requested_rank();
    } else {
      for (int r = 0; r < expected() && rank < 0; ++r) {
        if (!workers_[r].registered) rank = r;
      }
    }
    if (rank < 0) {
      return absl::FailedPreconditionError(absl::StrCat("cluster is full: ", expected(), " of ",
                                                        expected(), " workers registered for ",
                                                        mesh_.ToString()));
    }
    Entry& e = workers_[rank];
    e.registered = true;
    e.ready = false;
    e.peer.set_rank(rank);
    e.peer.set_address(req.address());
    e.peer.set_pid(req.pid());
    e.peer.set_hostname(req.hostname());
    e.peer.set_metrics_address(req.metrics_address());
    e.peer.set_shm_host_id(req.shm_host_id());
    e.last_heartbeat = absl::Now();
  }
  auto all = [this]()
                 ABSL_SHARED_LOCKS_REQUIRED(mu_) { return RegisteredCountLocked() == expected(); };
  while (!mu_.AwaitWithDeadline(absl::Condition(&all),
                                std::min(deadline, absl::Now() + absl::Milliseconds(100)))) {
    const bool left = cancelled && cancelled();
    if (!left && absl::Now() < deadline) continue;
    const int joined = RegisteredCountLocked();
    ReleaseIfWaitingLocked(rank, req.address());
    const std::string why = absl::StrCat("registered as rank ", rank, " but only ", joined, " of ",
                                         expected(), " workers have joined");
    if (left) return absl::CancelledError(absl::StrCat(why, "; the worker left, its rank is free"));
    return absl::DeadlineExceededError(why);
  }
  v1::RegisterResponse resp;
  resp.set_rank(rank);
  *resp.mutable_mesh() = mesh_.ToProto();
  for (int c : mesh_.Coords(rank)) resp.add_coords(c);
  for (const auto& w : workers_) *resp.add_peers() = w.peer;
  resp.set_ring_prev((rank + expected() - 1) % expected());
  resp.set_ring_next((rank + 1) % expected());
  resp.set_cluster_id(cluster_id_);
  return resp;
}

absl::Status WorkerRegistry::Heartbeat(int rank, const std::string& cluster_id) {
  absl::MutexLock lock(&mu_);
  if (cluster_id != cluster_id_ || rank < 0 || rank >= expected() || !workers_[rank].registered) {
    return absl::NotFoundError(absl::StrCat("no rank ", rank, " in cluster '", cluster_id,
                                            "' (this is '", cluster_id_, "')"));
  }
  workers_[rank].last_heartbeat = absl::Now();
  workers_[rank].ready = true;
  return absl::OkStatus();
}

absl::Status WorkerRegistry::WaitUntilReady(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    for (const auto& w : workers_) {
      if (!w.ready) return false;
    }
    return true;
  };
  if (mu_.AwaitWithDeadline(absl::Condition(&ready), deadline)) return absl::OkStatus();
  std::vector<int> missing;
  for (int r = 0; r < expected(); ++r) {
    if (!workers_[r].ready) missing.push_back(r);
  }
  return absl::DeadlineExceededError(absl::StrCat(RegisteredCountLocked(), " of ", expected(),
                                                  " workers registered; not ready: ranks ",
                                                  absl::StrJoin(missing, ", ")));
}

std::vector<int> WorkerRegistry::DeadRanks(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  std::vector<int> dead;
  const absl::Time now = absl::Now();
  for (int r = 0; r < expected(); ++r) {
    if (workers_[r].registered && now - workers_[r].last_heartbeat > timeout) dead.push_back(r);
  }
  return dead;
}

std::vector<v1::PeerInfo> WorkerRegistry::Peers() {
  absl::MutexLock lock(&mu_);
  std::vector<v1::PeerInfo> out;
  for (const auto& w : workers_) out.push_back(w.peer);
  return out;
}

std::vector<v1::WorkerStatus> WorkerRegistry::Snapshot(absl::Duration heartbeat_timeout) {
  absl::MutexLock lock(&mu_);
  std::vector<v1::WorkerStatus> out;
  const absl::Time now = absl::Now();
  for (const auto& w : workers_) {
    if (!w.registered) continue;
    v1::WorkerStatus s;
    *s.mutable_peer() = w.peer;
    s.set_seconds_since_heartbeat(absl::ToDoubleSeconds(now - w.last_heartbeat));
    s.set_alive(now - w.last_heartbeat <= heartbeat_timeout);
    out.push_back(s);
  }
  return out;
}

std::string WorkerRegistry::Describe(int rank) {
  absl::MutexLock lock(&mu_);
  if (rank < 0 || rank >= expected()) return absl::StrCat("rank ", rank);
  const auto& p = workers_[rank].peer;
  return absl::StrCat("rank ", rank, " (", p.address(), ", pid ", p.pid(), ")");
}

void WorkerRegistry::RequestShutdown() {
  absl::MutexLock lock(&mu_);
  shutdown_ = true;
}

bool WorkerRegistry::shutdown_requested() {
  absl::MutexLock lock(&mu_);
  return shutdown_;
}

}  // namespace meshrun
