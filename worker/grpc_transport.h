// The gRPC ring transport: each worker serves Ring.Transfer, and opens a long-lived client stream
// to each peer it sends to (its ring neighbour; other peers only when an algorithm needs them),
// or several (lanes, each on a TCP connection of its own) when GrpcStripeOptions stripes large
// messages over them; the receiver joins the pieces and keeps each sender's messages in send
// order (worker/stripe_joiner.h), which is all Transport promises.
//
// No protobuf on the data path: Ring.Transfer is served and called raw (gRPC's ByteBuffer), each
// message a frame of a 24-byte little-endian header {u32 sender's rank, u16 flags (goodbye, the
// lane, the stripe count), u16 cluster id bytes, u64 collective epoch, u64 tag}, the cluster id
// (a stream's first frame only), then the payload. ring.proto's Chunk documents the layout.
//
// Copies per payload byte in user space, besides the kernel's socket copies (and TLS's
// encryption, which writes a new buffer anyway):
//   - before (a protobuf Chunk): 3. The sender copied the chunk into the message's bytes field,
//     serialisation copied it into gRPC's slices, and parsing copied it out of them again.
//   - now: 1 for Send, 0 for SendFilled and Forward. Send copies the chunk into one gRPC-owned
//     slice. SendFilled has the caller write the payload into that slice, so a ring's
//     reduce-scatter step reduces a received chunk with its own straight into the slice it
//     forwards (the partial sum never lands in the collective's buffer to be copied out again).
//     Forward (a ring all-gather step that passes a block on) sends the received slices out
//     again as they are, each holding a reference to the message, and copies the block once,
//     into the collective's buffer. The receiver copies nothing: RecvInto's sink reduces or
//     copies straight out of gRPC's received slices, handed over piece by piece when the receive
//     is posted, or, for a frame that comes first, kept in the mailbox's queue as they are (an
//     absl::Cord holding references to them; pieces under 256 bytes, inlined ones among them,
//     are copied: worker/ring_frame.h).
//   The sender's copy stays (it is also what lets a small Send return before its write
//   completes: GrpcTransport's eager sends) because a slice that pointed at the caller's memory
//   could still be read by gRPC after Send returns: a write cancelled by Abort or abandoned at its
//   deadline (a stopped peer whose socket is full) leaves its bytes queued in the connection until
//   it drains or closes, while the collective frees the buffer as soon as it returns its error. A
//   borrowed slice whose release the sender awaits was tried (c8fabcc, reverted): faster on
//   loopback, but in the docker-compose cluster (8 workers, mutual TLS) the first step's
//   all-reduce failed with a send timing out, in both runs; the cause was not found.
#ifndef MESHRUN_WORKER_GRPC_TRANSPORT_H_
#define MESHRUN_WORKER_GRPC_TRANSPORT_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "core/collectives/mailbox.h"
#include "core/collectives/transport.h"
#include "grpcpp/support/slice.h"
#include "meshrun/v1/ring.grpc.pb.h"
#include "worker/stripe_joiner.h"

namespace meshrun {

// Receives peers' chunks into a Mailbox. It uses gRPC's callback API, so a chunk goes from
// gRPC's event thread straight into the mailbox and wakes the waiting collective (no handler
// thread in between). Until Attach() is called, Transfer fails with FailedPrecondition. When a
// peer's stream ends without its goodbye chunk (the process died or the connection broke), later
// receives from that rank fail with Unavailable naming it. Thread-safe.
// Serving it instead on the async API, from a completion queue that a thread of its own drives,
// was measured and was no faster in a worker (README, Collectives: who wakes whom).
class RingService final : public v1::Ring::WithRawCallbackMethod_Transfer<v1::Ring::Service> {
 public:
  // REQUIRES: `mailbox` outlives this service.
  void Attach(Mailbox* mailbox, int world_size, std::string cluster_id);

  // Frames that are too short, or a first frame naming a rank outside the world or another
  // cluster, end the stream with InvalidArgument / FailedPrecondition.
  grpc::ServerReadReactor<grpc::ByteBuffer>* Transfer(grpc::CallbackServerContext* context,
                                                      grpc::ByteBuffer* response) override;

 private:
  class Reactor;
  absl::Mutex mu_;
  Mailbox* mailbox_ ABSL_GUARDED_BY(mu_) = nullptr;
  // Shared by the streams of one Attach (a stream outlives a later Attach).
  std::shared_ptr<StripeJoiner> joiner_ ABSL_GUARDED_BY(mu_);
  int world_size_ ABSL_GUARDED_BY(mu_) = 0;
  std::string cluster_id_ ABSL_GUARDED_BY(mu_);
};

// How GrpcTransport stripes a large message over several streams (lanes) to one peer, each its
// own TCP connection (worker/stripe_joiner.h has the protocol). Worker flags --grpc_stripes and
// --grpc_stripe_bytes; README, Collectives, has the measurements behind the defaults.
struct GrpcStripeOptions {
  // The most lanes a message goes over, 1..kMaxLanes (1: never striped).
  int max_stripes = 1;
  // A message of `bytes` goes over min(max_stripes, max(1, bytes / stripe_bytes)) lanes, in
  // pieces of about bytes / lanes each (whole 8-byte words).
  size_t stripe_bytes = size_t{4} << 20;
};

// Transport over gRPC. Send writes the chunk on the peer's stream from the calling thread and
// waits for the write on the stream's own completion queue; with large HTTP/2 windows
// (net/grpc_util.cc) the write returns once the bytes are in the socket, so the caller goes on
// reducing the next chunk while this one is on the wire. A chunk of at most `eager_send_bytes`
// is sent eagerly, as MPI sends small messages: Send returns once the write is posted (gRPC
// holds its own copy of the payload), and the link's next Send, or its close, waits for that
// write first. The sending thread then does not wait on gRPC's executor, which completes a write
// started while another of gRPC's threads works on the connection (the peer's window updates
// after every message): README, Collectives, has the measurements. A write not back by its
// deadline (a peer that stopped reading, or one never reached) fails with DeadlineExceeded
// naming the peer (for an eager write, the deadline of the Send that waits for it);
// its stream is cancelled and abandoned to a thread that frees it once gRPC lets go of it (in
// gRPC 1.51 a cancel does not end a write stuck in a full socket: only the socket draining or
// the connection closing does), and the link is replaced on Reset() by one on a new
// connection. Thread-safe as Transport requires.
class GrpcTransport : public Transport {
 public:
  // `addresses[r]` is rank r's host:port. `mailbox` is the one attached to this worker's
  // RingService and must outlive the transport.
  GrpcTransport(int rank, std::vector<std::string> addresses, std::string cluster_id,
                Mailbox* mailbox, GrpcStripeOptions stripes = {},
                size_t eager_send_bytes = kEagerSendBytes);
  // The default `eager_send_bytes` (0: every Send waits for its write).
  static constexpr size_t kEagerSendBytes = 64 << 10;
  // Closes every link (sending goodbye, so peers know the close was deliberate).
  ~GrpcTransport() override;

  int rank() const override { return rank_; }
  int world_size() const override { return static_cast<int>(addresses_.size()); }
  absl::Status Send(int peer, uint64_t tag, absl::string_view data, absl::Time deadline) override;
  // `fill` writes straight into the gRPC slice that is sent (striped: each lane's piece refers to
  // a part of it), so the payload is not copied on this side at all.
  absl::Status SendFilled(int peer, uint64_t tag, size_t size, absl::Time deadline,
                          SendFill fill) override;
  absl::StatusOr<std::string> Recv(int peer, uint64_t tag, absl::Time deadline) override;
  // Sends the message on from gRPC's received slices (slices over the mailbox's Cord, each
  // holding a reference to it), so its only copy is the one into dst. The message is taken from
  // the mailbox's queue, not received in place.
  absl::Status Forward(int prev, uint64_t tag, char* dst, size_t size, int next, uint64_t next_tag,
                       absl::Time deadline) override;
  // Posted in the mailbox, where ShmTransport's rings fill it in place.
  absl::Status RecvInto(int peer, uint64_t tag, size_t size, absl::Time deadline,
                        RecvSink sink) override;
  void Abort(const absl::Status& reason) override;
  void Reset(uint64_t epoch) override;
  uint64_t epoch() const override { return mailbox_->epoch(); }

 private:
  struct Stream;
  class PeerLink;
  absl::StatusOr<PeerLink*> Link(int peer, int lane);
  // Sends the message `payload` holds (`size` bytes in all) to `peer`, striped over its lanes
  // as StripesFor says (each lane's piece refers to the slices: no copy).
  absl::Status SendPayload(int peer, uint64_t tag, const std::vector<grpc::Slice>& payload,
                           size_t size, absl::Time deadline);
  int StripesFor(size_t bytes) const;

  const int rank_;
  const std::vector<std::string> addresses_;
  const std::string cluster_id_;
  Mailbox* mailbox_;
  const GrpcStripeOptions stripes_;
  const size_t eager_send_bytes_;
  const int lanes_;  // links per peer
  absl::Mutex mu_;
  // Peer p's lane l at p * lanes_ + l, opened on first use.
  std::vector<std::unique_ptr<PeerLink>> links_ ABSL_GUARDED_BY(mu_);
  absl::Status aborted_ ABSL_GUARDED_BY(mu_);
};

}  // namespace meshrun

#endif  // MESHRUN_WORKER_GRPC_TRANSPORT_H_
