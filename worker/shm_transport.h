// Shared-memory links between workers on one host, the way NCCL's SHM transport and Gloo's shared
// memory pairs serve ranks that share a machine: a sender copies each message into a
// single-producer single-consumer byte ring in /dev/shm, and the receiver's drain thread moves
// whole messages from the ring into its Mailbox, where Recv finds them exactly as it finds the
// ones that came over gRPC. A message that fits the ring whole stays there until a receive for
// it is posted (Transport::RecvInto), then goes from the ring straight into the collective's
// destination: reduced or copied once, where a copy into the Mailbox and another out of it would
// otherwise be made (NCCL's SHM transport reduces from the FIFO in the same way). Peers on other
// hosts, and every peer when shared memory cannot be set up, go through the remote transport (the
// gRPC ring transport).
//
// Setting up a link (the sender decides, lazily, at its first Send to a peer): the sender
// creates a ring segment (/dev/shm/meshrun-...; its memory reserved with posix_fallocate, so a
// full /dev/shm is an error at set-up, not a SIGBUS later) and announces its name through the
// remote transport, as a control message the receiver's Mailbox hands to ShmTransport instead of
// queuing it. The receiver maps the ring, unlinks its name (so a crash leaves nothing behind)
// and starts draining it. Messages sent before the announcement travelled through the remote
// transport and were delivered before it, so per-peer order holds across the switch. A link set
// up in a collective epoch that is then aborted is set up again in the next epoch (Reset), with a
// new ring: the abort cancels the remote transport's streams, and its announcement may have died
// with them.
//
// Failures: a receiver that dies while a sender waits for ring space is seen by its pid (same
// host and pid namespace, which the host id guarantees) and the Send fails with Unavailable
// naming its rank; a sender that dies is seen through its gRPC stream closing, as before (the
// announcement opened it), and the receiver's Recv fails with Unavailable naming its rank.
#ifndef MESHRUN_WORKER_SHM_TRANSPORT_H_
#define MESHRUN_WORKER_SHM_TRANSPORT_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/collectives/mailbox.h"
#include "core/collectives/transport.h"
#include "worker/shm_arena.h"

namespace meshrun {

class ShmReceiver;  // worker/shm_receiver.h

// What "the same host" means for shared memory: the kernel's boot id, the filesystem behind
// /dev/shm and the pid and network namespaces. Two processes with equal ids can map each other's
// /dev/shm segments and see each other's pids; processes in different containers or network
// namespaces get different ids (and talk over gRPC). Empty if any part cannot be read.
std::string ShmHostId();

// Unlinks the /dev/shm ring segments named with this process's pid that are still there: an
// earlier image of this process (a worker restarts by re-executing itself, keeping its pid) made
// them and no receiver mapped them (a dead process's, if its pid was reused: garbage too).
void UnlinkOwnShmSegments();

// Where rank r runs, as its worker registered it.
struct ShmPeer {
  std::string host_id;  // ShmHostId() of that worker; empty: never shared memory
  int64_t pid = 0;      // its process id, for the liveness check
};

// Transport that routes each peer to a shared-memory ring when it shares this host and to
// `remote` otherwise. Thread-safety as Transport requires.
class ShmTransport : public Transport {
 public:
  struct Options {
    // Bytes of each sender's ring (rounded up to 4 KiB); a message larger than half of it is cut
    // into fragments. The default holds four 512 KiB collective chunks.
    size_t ring_bytes = size_t{2} << 20;
    // How often a sender waiting for ring space checks that its receiver is alive.
    absl::Duration liveness_interval = absl::Milliseconds(100);
    // How long a drain thread sleeps before it looks at its ring unwoken (a backstop: a message
    // wakes it while a receive for it sleeps).
    absl::Duration drain_poll = absl::Milliseconds(200);
    // Where this worker's large arrays live (shared with peers: single-copy collectives reach
    // co-located peers' buffers through it, peer_memory()); null: no peer memory. Must outlive
    // the transport.
    ShmArena* arena = nullptr;
  };

  // `peers[r]` describes rank r; ranks whose host id equals peers[rank].host_id (non-empty) get
  // shared-memory links. `mailbox` is the one `remote` delivers into; it must outlive the
  // transport. Errors: InvalidArgument if peers.size() differs from remote's world size or `rank`
  // is out of range.
  static absl::StatusOr<std::unique_ptr<ShmTransport>> Create(int rank, std::string cluster_id,
                                                              std::vector<ShmPeer> peers,
                                                              Mailbox* mailbox,
                                                              std::unique_ptr<Transport> remote,
                                                              const Options& options);
  // Stops the drain threads, unmaps every ring and unlinks any this process created that no
  // receiver has taken yet.
  ~ShmTransport() override;

  int rank() const override { return remote_->rank(); }
  int world_size() const override { return remote_->world_size(); }
  // To a shared-memory peer: copies `data` into the ring, waiting for space up to `deadline`.
  // Errors besides the remote transport's: Unavailable naming the peer's rank when it died;
  // DeadlineExceeded naming it when its ring stays full; the Abort reason after Abort. If the
  // ring cannot be created (no /dev/shm space), the link falls back to the remote transport.
  absl::Status Send(int peer, uint64_t tag, absl::string_view data, absl::Time deadline) override;
  // To a remote peer: in place, as the remote transport's. To a shared-memory peer: filled into
  // a buffer, which Send copies into the ring (a message can wrap around the ring's end, or be
  // cut into fragments, so it is not filled there).
  absl::Status SendFilled(int peer, uint64_t tag, size_t size, absl::Time deadline,
                          SendFill fill) override;
  absl::StatusOr<std::string> Recv(int peer, uint64_t tag, absl::Time deadline) override;
  // Between two remote peers: the remote transport's (sent on from its buffers). Otherwise the
  // default: received in place (from a ring) into dst and sent from there.
  absl::Status Forward(int prev, uint64_t tag, char* dst, size_t size, int next, uint64_t next_tag,
                       absl::Time deadline) override;
  // Posted in the mailbox: a message that comes through a ring whole goes from the ring straight
  // into the sink on the drain thread, with no copy in between.
  absl::Status RecvInto(int peer, uint64_t tag, size_t size, absl::Time deadline,
                        RecvSink sink) override;
  void Abort(const absl::Status& reason) override;
  void Reset(uint64_t epoch) override;
  uint64_t epoch() const override { return remote_->epoch(); }

  // Co-located peers' arenas (Options::arena), or null without one.
  PeerMemory* peer_memory() override { return peer_memory_.get(); }

  // True once sends to `peer` go through shared memory (after the first Send to it).
  bool SendsThroughShm(int peer) const;
  // True if `peer` may use shared memory at all (same host id).
  bool CoLocated(int peer) const { return co_located_[peer]; }
  // Messages this transport sent through shared memory, and through the remote transport.
  int64_t shm_messages_sent() const { return shm_sent_.load(); }
  int64_t remote_messages_sent() const { return remote_sent_.load(); }
  // How many of the messages sent through shared memory woke the receiver's drain thread (one
  // is woken only while a receive for the message sleeps; a polling one takes it itself).
  int64_t shm_drain_wakes() const;

  // The tag of the control message that announces a ring (never a collective's tag: those are
  // (sequence << 32) + step/chunk offsets).
  static constexpr uint64_t kAnnounceTag = ~uint64_t{0};

 private:
  class Ring;
  class Sender;
  class ArenaPeerMemory;
  ShmTransport(int rank, std::string cluster_id, std::vector<ShmPeer> peers, Mailbox* mailbox,
               std::unique_ptr<Transport> remote, const Options& options);
  // The peer's sender, set up at the first call; null when the peer goes through `remote`.
  absl::StatusOr<Sender*> SenderFor(int peer, absl::Time deadline);
  // SenderFor a co-located peer; null for one reached through the remote transport (another
  // host, a rank outside the world, or a link that fell back to it).
  absl::StatusOr<Sender*> RingTo(int peer, absl::Time deadline);
  void OnAnnounce(int src, const std::string& ring_name);
  // The Mailbox's wait listener: hands over what src's ring holds (ShmReceiver::DrainNow), and
  // has the ring's sender wake the drain thread only while a receive from src sleeps.
  void OnWait(int src, Mailbox::WaitEvent event);
  absl::Status AbortStatus();

  const std::string cluster_id_;
  const std::vector<ShmPeer> peers_;
  std::vector<bool> co_located_;
  Mailbox* const mailbox_;
  const std::unique_ptr<Transport> remote_;
  const Options options_;

  mutable absl::Mutex mu_;
  enum class LinkState { kUnset, kShm, kRemote };
  std::vector<LinkState> state_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Sender>> senders_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<ShmReceiver>> receivers_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<ShmReceiver>> retired_ ABSL_GUARDED_BY(mu_);
  std::vector<int> sleeping_ ABSL_GUARDED_BY(mu_);  // receives from each src that sleep
  absl::Status aborted_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> shm_sent_{0};
  std::atomic<int64_t> remote_sent_{0};
  std::unique_ptr<PeerMemory> peer_memory_;
};

}  // namespace meshrun

#endif  // MESHRUN_WORKER_SHM_TRANSPORT_H_
