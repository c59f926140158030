// WorkerRegistry's registration: rank assignment, a restarted worker taking its rank back, and the
// wait until the mesh forms (worker_registry.h). The rest of the registry is in
// worker_registry.cc.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/worker_registry.h"

namespace meshrun {

void WorkerRegistry::ReleaseIfWaitingLocked(int rank, const std::string& address) {
  if (RegisteredCountLocked() == ExpectedLocked()) return;  // the mesh formed: the rank is kept
  if (workers_[rank].registered && workers_[rank].peer.address() == address)
    workers_[rank] = Entry();
}

absl::StatusOr<v1::RegisterResponse> WorkerRegistry::Register(
    const v1::RegisterRequest& req, absl::Time deadline, const std::function<bool()>& cancelled) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckClusterIdLocked(req); !s.ok()) return s;
  if (RegisteredRankLocked(req) < 0) {
    absl::StatusOr<int> taken = TakeRankLocked(req, deadline, cancelled);
    if (!taken.ok()) return taken.status();
  }
  absl::StatusOr<int> rank = AwaitFormedLocked(req, deadline, cancelled);
  if (!rank.ok()) return rank.status();
  v1::RegisterResponse resp;
  resp.set_rank(*rank);
  *resp.mutable_mesh() = mesh_.ToProto();
  for (int c : mesh_.Coords(*rank)) resp.add_coords(c);
  for (const auto& w : workers_) *resp.add_peers() = w.peer;
  resp.set_ring_prev((*rank + ExpectedLocked() - 1) % ExpectedLocked());
  resp.set_ring_next((*rank + 1) % ExpectedLocked());
  resp.set_cluster_id(cluster_id_);
  resp.set_generation(generation_);
  return resp;
}

absl::Status WorkerRegistry::CheckClusterIdLocked(const v1::RegisterRequest& req) {
  if (!req.cluster_id().empty() && req.cluster_id() != cluster_id_) {
    if (!adopt_cluster_id_ || RegisteredCountLocked() > 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("worker ", req.address(), " belongs to cluster '", req.cluster_id(),
                       "'; this coordinator serves cluster '", cluster_id_, "'"));
    }
    cluster_id_ = req.cluster_id();  // a restarted coordinator resumes its workers' cluster
  }
  adopt_cluster_id_ = false;
  return absl::OkStatus();
}

int WorkerRegistry::RegisteredRankLocked(const v1::RegisterRequest& req) {
  int rank = -1;
  for (int r = 0; r < ExpectedLocked(); ++r) {
    const Entry& e = workers_[r];
    if (!e.registered || e.peer.address() != req.address()) continue;
    if (e.incarnation == req.incarnation()) {
      rank = r;  // the same process again (a retried call, or a rejoin)
    } else if (RegisteredCountLocked() < ExpectedLocked()) {
      workers_[r] = Entry();  // still forming: the new process simply takes the place
    } else {
      BeginRecoveryLocked({r},
                          absl::StrCat("a new process (pid ", req.pid(), ") serves ", req.address(),
                                       " in place of rank ", r, " (pid ", e.peer.pid(), ")"));
    }
  }
  return rank;
}

absl::StatusOr<int> WorkerRegistry::TakeRankLocked(const v1::RegisterRequest& req,
                                                   absl::Time deadline,
                                                   const std::function<bool()>& cancelled) {
  bool full = false;
  absl::StatusOr<int> assigned = AssignRankLocked(req, &full);
  // A full mesh: a replacement often starts (respawned) before its predecessor's loss is known.
  // Wait until a rank frees or a holder has been silent past the heartbeat timeout, then refuse.
  const absl::Time full_until =
      std::min(deadline, absl::Now() + heartbeat_timeout_ + absl::Milliseconds(200));
  while (!assigned.ok() && full && absl::Now() < full_until && !(cancelled && cancelled())) {
    auto not_full = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return RegisteredCountLocked() < ExpectedLocked();
    };
    mu_.AwaitWithDeadline(absl::Condition(&not_full),
                          std::min(full_until, absl::Now() + absl::Milliseconds(100)));
    assigned = AssignRankLocked(req, &full);
  }
  if (!assigned.ok()) return assigned.status();
  const int rank = *assigned;
  Entry& e = workers_[rank];
  e.registered = true;
  e.ready = false;
  e.kept_for_survivor = false;
  e.incarnation = req.incarnation();
  e.peer.set_rank(rank);
  e.peer.set_address(req.address());
  e.peer.set_pid(req.pid());
  e.peer.set_hostname(req.hostname());
  e.peer.set_metrics_address(req.metrics_address());
  e.peer.set_shm_host_id(req.shm_host_id());
  e.peer.set_process_identity(req.process_identity());
  e.last_heartbeat = absl::Now();
  WatchOomKillsLocked(e.peer);
  if (RegisteredCountLocked() == ExpectedLocked()) formed_at_ = absl::Now();
  return rank;
}

absl::StatusOr<int> WorkerRegistry::AwaitFormedLocked(const v1::RegisterRequest& req,
                                                      absl::Time deadline,
                                                      const std::function<bool()>& cancelled) {
  // The rank this registration holds: the one assigned, unless the mesh shrank (ranks
  // renumbered) or re-formed meanwhile (-1: not in the mesh).
  const auto held = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    for (int r = 0; r < ExpectedLocked(); ++r) {
      const Entry& e = workers_[r];
      if (e.registered && e.peer.address() == req.address() && e.incarnation == req.incarnation())
        return r;
    }
    return -1;
  };
  auto all = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return RegisteredCountLocked() == ExpectedLocked() && held() >= 0;
  };
  while (!mu_.AwaitWithDeadline(absl::Condition(&all),
                                std::min(deadline, absl::Now() + absl::Milliseconds(100)))) {
    const bool left = cancelled && cancelled();
    if (!left && absl::Now() < deadline) continue;
    const int joined = RegisteredCountLocked();
    const int now_rank = held();
    if (now_rank < 0) {
      return absl::DeadlineExceededError(absl::StrCat("the cluster re-formed as ", mesh_.ToString(),
                                                      " without this worker (", req.address(),
                                                      "); register again to join it"));
    }
    ReleaseIfWaitingLocked(now_rank, req.address());
    const std::string why = absl::StrCat("registered as rank ", now_rank, " but only ", joined,
                                         " of ", ExpectedLocked(), " workers have joined");
    if (left) return absl::CancelledError(absl::StrCat(why, "; the worker left, its rank is free"));
    return absl::DeadlineExceededError(why);
  }
  return held();
}

absl::StatusOr<int> WorkerRegistry::AssignRankLocked(const v1::RegisterRequest& req, bool* full) {
  *full = false;
  // Silent past the heartbeat timeout since its last heartbeat or the mesh's forming, whichever
  // is later (while the mesh forms, registered workers wait in Register and send none).
  const auto dead = [&](int r) ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return workers_[r].registered && RegisteredCountLocked() == ExpectedLocked() &&
           absl::Now() - std::max(workers_[r].last_heartbeat, formed_at_) > heartbeat_timeout_;
  };
  const int want = req.requested_rank();
  if (want >= ExpectedLocked()) {
    return absl::FailedPreconditionError(
        absl::StrCat("requested rank ", want, " is out of range for ", mesh_.ToString()));
  }
  if (want >= 0) {
    if (dead(want)) {
      BeginRecoveryLocked({want}, absl::StrCat("rank ", want, " (", workers_[want].peer.address(),
                                               ") is silent and ", req.address(), " asks for it"));
    }
    if (workers_[want].registered) {
      return absl::FailedPreconditionError(
          absl::StrCat("requested rank ", want, " is taken by ", workers_[want].peer.address()));
    }
    return want;
  }
  const auto free_rank = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const bool in_grace = absl::Now() < survivor_grace_end_;
    for (int r = 0; r < ExpectedLocked(); ++r) {
      if (!workers_[r].registered && !(in_grace && workers_[r].kept_for_survivor)) return r;
    }
    return -1;
  };
  int rank = free_rank();
  if (rank < 0 && RegisteredCountLocked() == ExpectedLocked()) {
    std::vector<int> silent;
    for (int r = 0; r < ExpectedLocked(); ++r) {
      if (dead(r)) silent.push_back(r);
    }
    if (!silent.empty()) {
      BeginRecoveryLocked(silent,
                          absl::StrCat("ranks [", absl::StrJoin(silent, ", "), "] are silent and ",
                                       req.address(), " joins in their place"));
      rank = free_rank();
    }
  }
  if (rank >= 0) return rank;
  if (RegisteredCountLocked() < ExpectedLocked()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the cluster is re-forming and its free ranks are kept for the surviving workers for ",
        absl::FormatDuration(survivor_grace_end_ - absl::Now()), "; try again"));
  }
  *full = true;
  return absl::FailedPreconditionError(absl::StrCat("cluster is full: ", ExpectedLocked(), " of ",
                                                    ExpectedLocked(), " workers registered for ",
                                                    mesh_.ToString()));
}

}  // namespace meshrun
