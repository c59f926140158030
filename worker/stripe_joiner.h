// Striped messages put back together: a GrpcTransport may split one large message over several
// streams to the same peer (lanes, each its own TCP connection, as NCCL's multi-socket TCP
// transport and PCCL stripe a chunk), and the receiver must hand the Mailbox each sender's
// messages whole and in the order they were sent.
//
// The protocol (worker/ring_frame.h's FrameHeader): lane 0 carries every message, whole or as its
// first piece together with the number of lanes K it is striped over; lane j (1 <= j < K) carries
// piece j of every message striped over more than j lanes, in the same order. A receiver needs
// no other agreement with its sender: K comes with each message, so peers with different
// --grpc_stripes settings still understand each other.
#ifndef MESHRUN_WORKER_STRIPE_JOINER_H_
#define MESHRUN_WORKER_STRIPE_JOINER_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/synchronization/mutex.h"
#include "core/collectives/mailbox.h"
#include "worker/ring_frame.h"

namespace meshrun {

// Joins, per sender, the pieces of striped messages and delivers every message to the Mailbox in
// lane 0's order. A message that is not striped and has nothing before it still waiting for
// pieces goes straight into the receive the collective posted (Mailbox::BeginInPlace), with no
// copy; a joined message is queued as one Cord over its pieces' gRPC slices (no copy either).
//
// Collective epochs: a piece that a broken stream lost never comes, so a message waiting for it
// would hold back its sender's later messages forever. A message is therefore dropped once a
// frame of a later epoch arrives on lane 0, or on the lane whose piece it waits for (a lane is
// one stream, in order, within an epoch: its piece would have come first); and a piece of an
// earlier epoch than the message it would join is dropped. Dropping is safe: a message of an
// earlier epoch belongs to an aborted collective, which the Mailbox would drop anyway.
//
// Thread-safe: each lane's stream delivers on its own gRPC thread.
class StripeJoiner {
 public:
  // REQUIRES: `mailbox` outlives this.
  StripeJoiner(Mailbox* mailbox, int world_size);

  // A data frame from `src` (0 <= src < world size) on `lane` (0 <= lane < kMaxLanes), header
  // `h` already read from `reader`, whose rest is the payload. Errors (the stream must then
  // end): InvalidArgument when a piece's tag is not the tag of the message of the same epoch it
  // joins (a sender that broke the protocol).
  absl::Status Receive(int src, int lane, const FrameHeader& h, FrameReader& reader);

  // Messages and pieces dropped as stale (see above), since construction.
  int64_t dropped();

 private:
  struct Message {
    uint64_t epoch = 0;
    uint64_t tag = 0;
    int stripes = 1;
    uint32_t have = 0;  // bit j: piece j is here
    std::vector<absl::Cord> pieces;
    bool complete() const { return have == (uint32_t{1} << stripes) - 1; }
  };
  struct Piece {
    uint64_t epoch = 0;
    uint64_t tag = 0;
    absl::Cord data;
  };
  struct Source {
    absl::Mutex mu;
    std::deque<Message> pending ABSL_GUARDED_BY(mu);  // lane 0's order; the front is incomplete
    std::deque<Piece> early[kMaxLanes] ABSL_GUARDED_BY(mu);  // pieces before their lane-0 frame
  };

  absl::Status ReceiveFirst(int src, Source& s, const FrameHeader& h, FrameReader& reader)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  absl::Status ReceivePiece(Source& s, int lane, const FrameHeader& h, absl::Cord data)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // Pops the complete messages at the front of `s.pending` into the Mailbox.
  void DeliverReady(int src, Source& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);

  Mailbox* const mailbox_;
  std::vector<std::unique_ptr<Source>> sources_;
  std::atomic<int64_t> dropped_{0};
};

}  // namespace meshrun

#endif  // MESHRUN_WORKER_STRIPE_JOINER_H_
