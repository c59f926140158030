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
