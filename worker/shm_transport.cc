#include "worker/shm_transport.h"

#include <dirent.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/port/process.h"
#include "glog/logging.h"
#include "worker/shm_receiver.h"
#include "worker/shm_ring.h"

namespace meshrun {
namespace {

// A /dev/shm name from the cluster id (only [A-Za-z0-9_-] kept, at most 64 of them).
std::string SegmentName(const std::string& cluster_id, int src, int dst) {
  static std::atomic<int> counter{0};
  std::string id;
  for (char c : cluster_id) {
    if (std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_') id.push_back(c);
    if (id.size() == 64) break;
  }
  return absl::StrCat("/meshrun-", id, "-", src, "to", dst, "-", getpid(), "-",
                      counter.fetch_add(1));
}

}  // namespace

void UnlinkOwnShmSegments() {
  // SegmentName: "meshrun-<id>-<src>to<dst>-<pid>-<counter>".
  const std::string pid = absl::StrCat("-", getpid(), "-");
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return;
  while (const dirent* e = readdir(dir)) {
    const std::string name = e->d_name;
    if (!absl::StartsWith(name, "meshrun-")) continue;
    const size_t last = name.rfind('-');
    if (last == std::string::npos || last < pid.size() - 1) continue;
    if (name.compare(last - (pid.size() - 1), pid.size(), pid) != 0) continue;
    shm_unlink(("/" + name).c_str());
  }
  closedir(dir);
}

std::string ShmHostId() {
  const std::string boot = BootId();
  struct stat st;
  const std::string pid_ns = OwnNamespace("pid"), net_ns = OwnNamespace("net");
  if (boot.empty() || stat("/dev/shm", &st) != 0 || pid_ns.empty() || net_ns.empty()) return "";
  return absl::StrCat(boot, "/shm-dev-", st.st_dev, "/", pid_ns, "/", net_ns);
}

// The sending end of one link: the ring this process created in /dev/shm for one peer.
class ShmTransport::Sender {
 public:
  Sender(std::unique_ptr<ShmRing> ring, uint64_t epoch) : ring_(std::move(ring)), epoch_(epoch) {}
  ~Sender() { ring_->Unlink(); }  // in case the peer never opened it
  ShmRing& ring() { return *ring_; }
  // The collective epoch in which the ring was announced.
  uint64_t announced_in() const { return epoch_; }

 private:
  std::unique_ptr<ShmRing> ring_;
  const uint64_t epoch_;
};

// PeerMemory over the arenas of co-located workers: a handle names a segment of the peer's arena,
// mapped here through /proc/<pid>/fd.
class ShmTransport::ArenaPeerMemory : public PeerMemory {
 public:
  ArenaPeerMemory(ShmArena* arena, const ShmTransport* transport)
      : arena_(arena), transport_(transport) {}
  bool CanReach(int peer) const override {
    return peer >= 0 && peer < static_cast<int>(transport_->peers_.size()) &&
           transport_->CoLocated(peer);
  }
  std::string Export(const void* data, size_t size) override { return arena_->Export(data, size); }
  absl::StatusOr<void*> Import(int peer, absl::string_view handle) override {
    if (!CanReach(peer)) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", peer, " is not on this host: its memory cannot be mapped"));
    }
    absl::StatusOr<void*> p = arena_->Import(transport_->peers_[peer].pid, handle);
    if (!p.ok())
      return absl::Status(p.status().code(),
                          absl::StrCat("rank ", peer, ": ", p.status().message()));
    return p;
  }

 private:
  ShmArena* const arena_;
  const ShmTransport* const transport_;
};

absl::StatusOr<std::unique_ptr<ShmTransport>> ShmTransport::Create(
    int rank, std::string cluster_id, std::vector<ShmPeer> peers, Mailbox* mailbox,
    std::unique_ptr<Transport> remote, const Options& options) {
  if (remote == nullptr || static_cast<int>(peers.size()) != remote->world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared-memory transport: ", peers.size(),
                     " peers given; the remote transport's world size is ",
                     remote == nullptr ? 0 : remote->world_size()));
  }
  if (rank < 0 || rank >= static_cast<int>(peers.size()) || rank != remote->rank()) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared-memory transport: rank ", rank, " is not the remote ",
                     "transport's rank in a world of ", peers.size()));
  }
  auto t = std::unique_ptr<ShmTransport>(new ShmTransport(
      rank, std::move(cluster_id), std::move(peers), mailbox, std::move(remote), options));
  mailbox->SetControlHandler(kAnnounceTag, [raw = t.get()](int src, const std::string& payload) {
    raw->OnAnnounce(src, payload);
  });
  mailbox->SetWaitListener(
      [raw = t.get()](int src, Mailbox::WaitEvent event) { raw->OnWait(src, event); });
  return t;
}

ShmTransport::ShmTransport(int rank, std::string cluster_id, std::vector<ShmPeer> peers,
                           Mailbox* mailbox, std::unique_ptr<Transport> remote,
                           const Options& options)
    : cluster_id_(std::move(cluster_id)),
      peers_(std::move(peers)),
      co_located_(peers_.size(), false),
      mailbox_(mailbox),
      remote_(std::move(remote)),
      options_(options),
      state_(peers_.size(), LinkState::kUnset),
      senders_(peers_.size()),
      receivers_(peers_.size()),
      sleeping_(peers_.size(), 0) {
  const std::string& mine = peers_[rank].host_id;
  for (size_t r = 0; r < peers_.size(); ++r) {
    co_located_[r] = static_cast<int>(r) != rank && !mine.empty() && peers_[r].host_id == mine;
  }
  if (options_.arena != nullptr)
    peer_memory_ = std::make_unique<ArenaPeerMemory>(options_.arena, this);
}

ShmTransport::~ShmTransport() {
  mailbox_->SetControlHandler(kAnnounceTag, nullptr);  // waits for an announcement being handled
  mailbox_->SetWaitListener(nullptr);
  std::vector<std::unique_ptr<ShmReceiver>> receivers;
  std::vector<std::unique_ptr<Sender>> senders;
  {
    absl::MutexLock lock(&mu_);
    receivers = std::move(receivers_);
    for (auto& r : retired_) receivers.push_back(std::move(r));
    senders = std::move(senders_);
  }
}

bool ShmTransport::SendsThroughShm(int peer) const {
  absl::MutexLock lock(&mu_);
  return peer >= 0 && peer < static_cast<int>(state_.size()) && state_[peer] == LinkState::kShm;
}

int64_t ShmTransport::shm_drain_wakes() const {
  absl::MutexLock lock(&mu_);
  int64_t wakes = 0;
  for (const auto& sender : senders_) {
    if (sender) wakes += static_cast<int64_t>(sender->ring().data_wakes());
  }
  return wakes;
}

absl::Status ShmTransport::AbortStatus() {
  absl::MutexLock lock(&mu_);
  return aborted_;
}

absl::StatusOr<ShmTransport::Sender*> ShmTransport::SenderFor(int peer, absl::Time deadline) {
  {
    absl::MutexLock lock(&mu_);
    if (!aborted_.ok()) return aborted_;
    if (state_[peer] == LinkState::kShm) return senders_[peer].get();
    if (state_[peer] == LinkState::kRemote) return nullptr;
  }
  // Only this thread sends to `peer` (Transport's contract), so nothing else sets it up meanwhile.
  absl::StatusOr<std::unique_ptr<ShmRing>> ring =
      ShmRing::Create(SegmentName(cluster_id_, rank(), peer), options_.ring_bytes);
  if (!ring.ok()) {
    LOG(WARNING) << "no shared-memory link to rank " << peer << " (" << ring.status()
                 << "); using gRPC";
    absl::MutexLock lock(&mu_);
    state_[peer] = LinkState::kRemote;
    return nullptr;
  }
  auto sender = std::make_unique<Sender>(*std::move(ring), remote_->epoch());
  if (absl::Status s = remote_->Send(peer, kAnnounceTag, sender->ring().name(), deadline); !s.ok())
    return s;
  absl::MutexLock lock(&mu_);
  state_[peer] = LinkState::kShm;
  senders_[peer] = std::move(sender);
  return senders_[peer].get();
}

void ShmTransport::OnAnnounce(int src, const std::string& ring_name) {
  absl::StatusOr<std::unique_ptr<ShmRing>> ring = ShmRing::OpenAndUnlink(ring_name);
  if (!ring.ok()) {
    LOG(ERROR) << "rank " << src
               << " announced a shared-memory ring this worker cannot map: " << ring.status();
    mailbox_->MarkPeerFailed(
        src, absl::Status(ring.status().code(),
                          absl::StrCat("cannot map rank ", src,
                                       "'s shared-memory ring: ", ring.status().message())));
    return;
  }
  auto receiver =
      std::make_unique<ShmReceiver>(*std::move(ring), src, mailbox_, options_.drain_poll);
  absl::MutexLock lock(&mu_);
  // A receive from src may sleep already: its wake-up is armed, and the drain thread, which may
  // have gone to sleep before, looks at the ring again.
  if (sleeping_[src] > 0) {
    receiver->SetWakeOnData(true);
    receiver->WakeDrain();
  }
  // A peer that announces again (after an aborted epoch) replaces its ring; the old one's thread
  // may be delivering (and so waiting for the lock the mailbox holds while this runs): it stops
  // at the next Reset, or in the destructor.
  if (receivers_[src] != nullptr) retired_.push_back(std::move(receivers_[src]));
  receivers_[src] = std::move(receiver);
}

absl::StatusOr<ShmTransport::Sender*> ShmTransport::RingTo(int peer, absl::Time deadline) {
  if (peer < 0 || peer >= world_size() || !co_located_[peer]) return nullptr;
  return SenderFor(peer, deadline);
}

absl::Status ShmTransport::Send(int peer, uint64_t tag, absl::string_view data,
                                absl::Time deadline) {
  absl::StatusOr<Sender*> sender = RingTo(peer, deadline);
  if (!sender.ok()) return sender.status();
  if (*sender == nullptr) {
    remote_sent_.fetch_add(1);
    return remote_->Send(peer, tag, data, deadline);
  }
  const int64_t pid = peers_[peer].pid;
  absl::Time next_liveness_check = absl::Now() + options_.liveness_interval;
  absl::Status s = (*sender)->ring().Write(
      mailbox_->epoch(), tag, data, deadline, options_.liveness_interval, [&]() -> absl::Status {
        if (absl::Status aborted = AbortStatus(); !aborted.ok()) return aborted;
        if (absl::Now() < next_liveness_check) return absl::OkStatus();
        next_liveness_check = absl::Now() + options_.liveness_interval;
        if (!ProcessAlive(pid)) {
          return absl::UnavailableError(absl::StrCat("rank ", peer, " (pid ", pid,
                                                     ") exited; its shared-memory ring ",
                                                     "is full and no one reads it"));
        }
        return absl::OkStatus();
      });
  if (s.code() == absl::StatusCode::kDeadlineExceeded) {
    return absl::DeadlineExceededError(
        absl::StrCat("send to rank ", peer, " timed out: ", s.message(), " (peer not receiving)"));
  }
  if (s.ok()) shm_sent_.fetch_add(1);
  return s;
}

absl::Status ShmTransport::SendFilled(int peer, uint64_t tag, size_t size, absl::Time deadline,
                                      SendFill fill) {
  absl::StatusOr<Sender*> sender = RingTo(peer, deadline);
  if (!sender.ok()) return sender.status();
  if (*sender != nullptr) return Transport::SendFilled(peer, tag, size, deadline, fill);
  remote_sent_.fetch_add(1);
  return remote_->SendFilled(peer, tag, size, deadline, fill);
}

absl::Status ShmTransport::Forward(int prev, uint64_t tag, char* dst, size_t size, int next,
                                   uint64_t next_tag, absl::Time deadline) {
  const auto remote = [this](int peer) {
    return peer >= 0 && peer < world_size() && !co_located_[peer];
  };
  if (!remote(prev) || !remote(next)) {
    return Transport::Forward(prev, tag, dst, size, next, next_tag, deadline);
  }
  remote_sent_.fetch_add(1);
  return remote_->Forward(prev, tag, dst, size, next, next_tag, deadline);
}

absl::StatusOr<std::string> ShmTransport::Recv(int peer, uint64_t tag, absl::Time deadline) {
  return remote_->Recv(peer, tag, deadline);
}

absl::Status ShmTransport::RecvInto(int peer, uint64_t tag, size_t size, absl::Time deadline,
                                    RecvSink sink) {
  return remote_->RecvInto(peer, tag, size, deadline, sink);
}

void ShmTransport::Abort(const absl::Status& reason) {
  {
    absl::MutexLock lock(&mu_);
    if (aborted_.ok()) aborted_ = reason;
    for (auto& sender : senders_) {
      if (sender) sender->ring().WakeProducer();
    }
  }
  remote_->Abort(reason);
}

void ShmTransport::OnWait(int src, Mailbox::WaitEvent event) {
  if (src < 0 || src >= static_cast<int>(peers_.size())) return;
  ShmReceiver* receiver = nullptr;
  {
    absl::MutexLock lock(&mu_);
    receiver = receivers_[src].get();
    if (event != Mailbox::WaitEvent::kPoll) {
      sleeping_[src] += event == Mailbox::WaitEvent::kSleep ? 1 : -1;
      // Armed before the look below (kSleep), so a message its sender did not wake the drain
      // thread for is handed over by that look.
      if (receiver != nullptr) receiver->SetWakeOnData(sleeping_[src] > 0);
    }
  }
  // Outside mu_ (the drain calls into the Mailbox). A receiver replaced meanwhile stays alive in
  // retired_ until Reset, which never runs during a receive, and the destructor removes this
  // listener before it destroys any.
  if (receiver != nullptr && event != Mailbox::WaitEvent::kAwake) receiver->DrainNow();
}

void ShmTransport::Reset(uint64_t epoch) {
  if (epoch <= remote_->epoch()) return;
  std::vector<std::unique_ptr<Sender>> unannounced;
  std::vector<std::unique_ptr<ShmReceiver>> retired;
  {
    absl::MutexLock lock(&mu_);
    // Rings their peers replaced (OnAnnounce) hold only messages of aborted epochs: their drain
    // threads stop now. No receive runs (Reset's contract), so no OnWait holds one.
    retired = std::move(retired_);
    retired_.clear();
    if (!aborted_.ok()) {
      // An announcement made in the epoch being left may have been lost: the abort cancels the
      // remote transport's streams, and a write that gRPC reported done can still die with its
      // stream before the peer reads it. Such a peer never drains the ring, so the link is set up
      // again (a new ring, announced in the new epoch); a peer that did open the old one replaces
      // it when the new announcement comes.
      const uint64_t left = remote_->epoch();
      for (size_t peer = 0; peer < senders_.size(); ++peer) {
        if (senders_[peer] == nullptr || senders_[peer]->announced_in() != left) continue;
        unannounced.push_back(std::move(senders_[peer]));
        state_[peer] = LinkState::kUnset;
      }
    }
    aborted_ = absl::OkStatus();
  }
  // Outside mu_: unlinks the rings no peer may ever open, and joins the retired drain threads (one
  // may wait in the Mailbox behind an announcement being handled, and that handler for mu_).
  unannounced.clear();
  retired.clear();
  // The rings may still hold earlier epochs' messages: the Mailbox drops them as they come out.
  remote_->Reset(epoch);
}

}  // namespace meshrun
