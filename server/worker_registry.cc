#include "server/worker_registry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/port/process.h"
#include "glog/logging.h"

namespace meshrun {

WorkerRegistry::WorkerRegistry(Mesh mesh, std::string cluster_id, bool adopt_cluster_id,
                               absl::Duration heartbeat_timeout)
    : heartbeat_timeout_(heartbeat_timeout),
      mesh_(std::move(mesh)),
      generation_(static_cast<uint64_t>(absl::ToUnixMicros(absl::Now()))),
      first_generation_(generation_),
      cluster_id_(std::move(cluster_id)),
      adopt_cluster_id_(adopt_cluster_id),
      workers_(mesh_.size()),
      collective_epoch_(generation_) {}

Mesh WorkerRegistry::mesh() {
  absl::MutexLock lock(&mu_);
  return mesh_;
}

int WorkerRegistry::expected() {
  absl::MutexLock lock(&mu_);
  return mesh_.size();
}

int WorkerRegistry::RegisteredCount() {
  absl::MutexLock lock(&mu_);
  return RegisteredCountLocked();
}

absl::Status WorkerRegistry::Shrink(const Mesh& smaller) {
  absl::MutexLock lock(&mu_);
  std::vector<Entry> kept;
  for (const Entry& e : workers_) {
    if (e.registered && static_cast<int>(kept.size()) < smaller.size()) kept.push_back(e);
  }
  if (static_cast<int>(kept.size()) < smaller.size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        kept.size(), " workers are registered; ", smaller.ToString(), " needs ", smaller.size()));
  }
  LOG(WARNING) << "continuing on " << smaller.ToString() << " (was " << mesh_.ToString()
               << ") with the workers that rejoined";
  mesh_ = smaller;
  for (int r = 0; r < static_cast<int>(kept.size()); ++r) kept[r].peer.set_rank(r);
  workers_ = std::move(kept);
  formed_at_ = absl::Now();
  ++generation_;
  ++collective_epoch_;
  return absl::OkStatus();
}

uint64_t WorkerRegistry::generation() {
  absl::MutexLock lock(&mu_);
  return generation_;
}

std::vector<v1::PeerInfo> WorkerRegistry::last_lost() {
  absl::MutexLock lock(&mu_);
  return last_lost_;
}

void WorkerRegistry::WatchOomKillsLocked(const v1::PeerInfo& p) {
  const ProcessState state = ObserveProcess(p.process_identity());
  if (state != ProcessState::kRunning && state != ProcessState::kStopped) return;
  if (oom_watches_.size() > 2 * workers_.size() + 16) {
    for (auto it = oom_watches_.begin(); it != oom_watches_.end();) {
      const bool gone = ObserveProcess(it->first) == ProcessState::kGone;
      it = gone ? oom_watches_.erase(it) : std::next(it);
    }
  }
  oom_watches_[p.process_identity()] = WatchOomKills(p.pid());
}

void WorkerRegistry::RewatchOomKillsLocked(const v1::PeerInfo& p) {
  auto it = oom_watches_.find(p.process_identity());
  if (it == oom_watches_.end()) return;  // not a process this coordinator sees
  OomKillWatch now = WatchOomKills(p.pid());
  // The count since registration, unless the worker moved to another memory cgroup meanwhile.
  if (it->second.counter != now.counter || it->second.kills < 0) it->second = std::move(now);
}

bool WorkerRegistry::KilledByOom(const v1::PeerInfo& p) {
  absl::MutexLock lock(&mu_);
  auto it = oom_watches_.find(p.process_identity());
  return it != oom_watches_.end() && OomKilledSince(it->second);
}

uint64_t WorkerRegistry::BeginRecovery(const std::vector<int>& lost, const std::string& reason) {
  absl::MutexLock lock(&mu_);
  return BeginRecoveryLocked(lost, reason);
}

uint64_t WorkerRegistry::BeginRecoveryLocked(const std::vector<int>& lost,
                                             const std::string& reason) {
  ++generation_;
  ++collective_epoch_;  // nothing of the old generation's collectives is read again
  survivor_grace_end_ = absl::Now() + kSurvivorGrace;
  last_lost_.clear();
  for (int r = 0; r < ExpectedLocked(); ++r) {
    Entry& e = workers_[r];
    const bool is_lost = std::find(lost.begin(), lost.end(), r) != lost.end();
    if (is_lost) last_lost_.push_back(e.peer);
    e.kept_for_survivor = e.registered && !is_lost;
    e.registered = false;
    e.ready = false;
  }
  LOG(WARNING) << "re-forming the cluster (generation " << generation_ << ") without ranks ["
               << absl::StrJoin(lost, ", ") << "]: " << reason;
  return generation_;
}

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

absl::StatusOr<bool> WorkerRegistry::Heartbeat(int rank, const std::string& cluster_id,
                                               uint64_t generation, uint64_t incarnation) {
  absl::MutexLock lock(&mu_);
  if (cluster_id == cluster_id_ && generation >= first_generation_ && generation < generation_)
    return true;  // a worker of an earlier generation: the cluster re-formed without it
  if (cluster_id != cluster_id_ || rank < 0 || rank >= ExpectedLocked() ||
      !workers_[rank].registered) {
    return absl::NotFoundError(absl::StrCat("no rank ", rank, " in cluster '", cluster_id,
                                            "' (this is '", cluster_id_, "')"));
  }
  if (workers_[rank].incarnation != incarnation) {
    return absl::NotFoundError(absl::StrCat("rank ", rank, " is held by another process (",
                                            workers_[rank].peer.address(), ", pid ",
                                            workers_[rank].peer.pid(), ")"));
  }
  workers_[rank].last_heartbeat = absl::Now();
  workers_[rank].ready = true;
  RewatchOomKillsLocked(workers_[rank].peer);
  return false;
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
  for (int r = 0; r < ExpectedLocked(); ++r) {
    if (!workers_[r].ready) missing.push_back(r);
  }
  return absl::DeadlineExceededError(absl::StrCat(RegisteredCountLocked(), " of ", ExpectedLocked(),
                                                  " workers registered; not ready: ranks ",
                                                  absl::StrJoin(missing, ", ")));
}

std::vector<std::pair<int, std::string>> WorkerRegistry::DeadRanks(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<int, std::string>> dead;
  const absl::Time now = absl::Now();
  for (int r = 0; r < ExpectedLocked(); ++r) {
    const Entry& w = workers_[r];
    if (!w.registered) continue;
    if (now - w.last_heartbeat > timeout) {
      dead.emplace_back(r, absl::StrCat("missed heartbeats for ", absl::FormatDuration(timeout)));
      continue;
    }
    if (!process_checks_) continue;
    switch (ObserveProcess(w.peer.process_identity())) {
      case ProcessState::kGone:
        dead.emplace_back(r, "has exited");
        break;
      case ProcessState::kStopped:
        dead.emplace_back(r, "is stopped (SIGSTOP)");
        break;
      case ProcessState::kRunning:
      case ProcessState::kUnknown:
        break;
    }
  }
  return dead;
}

v1::PeerInfo WorkerRegistry::Peer(int rank) {
  absl::MutexLock lock(&mu_);
  return rank >= 0 && rank < ExpectedLocked() ? workers_[rank].peer : v1::PeerInfo();
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
  if (rank < 0 || rank >= ExpectedLocked()) return absl::StrCat("rank ", rank);
  const auto& p = workers_[rank].peer;
  return absl::StrCat("rank ", rank, " (", p.address(), ", pid ", p.pid(), ")");
}

void WorkerRegistry::RequestShutdown() {
  absl::MutexLock lock(&mu_);
  shutdown_ = true;
}

bool WorkerRegistry::TellShutdown(int rank) {
  absl::MutexLock lock(&mu_);
  if (shutdown_ && rank >= 0 && rank < static_cast<int>(workers_.size()))
    workers_[rank].told_to_stop = true;
  return shutdown_;
}

bool WorkerRegistry::AwaitShutdownTold(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto told = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    for (const auto& w : workers_) {
      if (w.registered && !w.told_to_stop) return false;
    }
    return true;
  };
  return mu_.AwaitWithDeadline(absl::Condition(&told), deadline);
}

}  // namespace meshrun
