// The seam between collective algorithms and the wire (Gloo's transport::Pair, reduced to what the
// algorithms need). Implementations: InProcessTransport (threads as ranks, for tests),
// worker/grpc_transport (gRPC streams between worker processes) and worker/shm_transport (shared
// memory rings between the workers on one host, gRPC to the others).
#ifndef MESHRUN_CORE_COLLECTIVES_TRANSPORT_H_
#define MESHRUN_CORE_COLLECTIVES_TRANSPORT_H_

#include <cstdint>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace meshrun {

// Where RecvInto puts a message: called with consecutive pieces of it, `n` bytes at `data` that
// belong at byte `offset` of the message, in order, covering it exactly once. Every piece but the
// last starts and ends at a multiple of 8 bytes (whole elements of any dtype). A sink may run on
// another thread (a transport's drain thread; in process, the sender's), but only while its
// RecvInto is blocked: every call returns before RecvInto does.
using RecvSink = absl::FunctionRef<void(size_t offset, const char* data, size_t n)>;

// What SendFilled calls to write a message's payload: it must write all of the `size` bytes at
// `dst` (memory of the transport's, uninitialised, not aligned beyond 1 byte) before it returns,
// or return an error, and then nothing is sent. It runs on the calling thread.
using SendFill = absl::FunctionRef<absl::Status(char* dst)>;

// Passes a message that comes in pieces split anywhere (gRPC's received slices, a Cord's chunks)
// on to a RecvSink in pieces that keep its promise: the few bytes that straddle two pieces go
// through a carry of their own (one 8-byte piece); everything else is passed where it lies. Call
// Add for each piece in order, then Finish. Not thread-safe. Like any FunctionRef, `sink` only
// refers to its callable, which must outlive the stitcher (a named lambda, not a temporary).
class SinkStitcher {
 public:
  explicit SinkStitcher(RecvSink sink) : sink_(sink) {}
  void Add(const char* data, size_t n);
  void Finish();

 private:
  RecvSink sink_;
  size_t offset_ = 0;  // message bytes passed to the sink so far
  size_t carried_ = 0;
  char carry_[8];
};

// Load/store access to the memory of peers on the same host, for single-copy collectives
// (direct_collectives.h): a rank reads its peers' buffers and writes results into them directly
// instead of sending bytes through a ring (NCCL's P2P transport reads and writes a peer GPU's
// buffer the same way; Open MPI's XPMEM path maps a peer process's pages). Only memory the owner
// exported can be reached, and a collective exchanges handles, so a peer touches a buffer only
// while its owner is inside the same collective. Thread-safe.
class PeerMemory {
 public:
  virtual ~PeerMemory() = default;
  // True if Import can reach memory that `peer` exports (it shares this host).
  virtual bool CanReach(int peer) const = 0;
  // A handle by which a peer that CanReach this rank maps [data, data + size), or "" if that
  // memory is not shareable (it does not lie in memory this process shares; the collective then
  // falls back to messages).
  virtual std::string Export(const void* data, size_t size) = 0;
  // This process's address of the memory `peer` exported as `handle`, valid while the peer keeps
  // that memory alive. Errors: FailedPrecondition if `peer` cannot be reached; Unavailable naming
  // the peer's rank if its memory cannot be mapped (it exited); InvalidArgument for a malformed
  // handle.
  virtual absl::StatusOr<void*> Import(int peer, absl::string_view handle) = 0;
};

// Point-to-point messages between the ranks of one cluster. Messages from one sender to one
// receiver arrive in send order; each carries a tag that the receiver checks, so two ranks that
// call collectives in different orders get an error instead of garbage, and the sender's
// collective epoch (see Reset), so that no message of an abandoned collective is ever received.
//
// Thread-safety: Send and Recv may be called from different threads, but calls that target the
// same peer must be ordered by the caller (a collective runs on one thread).
class Transport {
 public:
  virtual ~Transport() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // Queues `data` for `peer` and returns once it is buffered (not necessarily delivered).
  // Errors: Unavailable naming the peer's rank if its link is broken; DeadlineExceeded if the
  // buffer stays full past `deadline`; the Abort reason after Abort.
  virtual absl::Status Send(int peer, uint64_t tag, absl::string_view data,
                            absl::Time deadline) = 0;

  // Sends a message of `size` bytes that `fill` writes straight into the buffer the transport
  // sends from, so a collective can produce a chunk where the wire takes it (the reduction of a
  // received chunk with this rank's own, in a ring's reduce-scatter) instead of producing it in
  // its own memory and having Send copy it. Otherwise as Send; `fill`'s error is returned as it
  // is, with nothing sent. The default fills a buffer of its own and Sends it (one copy more
  // than Send: for transports with no buffer of their own to offer).
  virtual absl::Status SendFilled(int peer, uint64_t tag, size_t size, absl::Time deadline,
                                  SendFill fill);

  // Returns the next message from `peer`. Errors: DeadlineExceeded naming the peer's rank;
  // Unavailable if the peer disconnected; Internal if the message's tag is not `tag`; the Abort
  // reason after Abort.
  virtual absl::StatusOr<std::string> Recv(int peer, uint64_t tag, absl::Time deadline) = 0;

  // Receives the next message from `peer`, which must be `size` bytes, straight into the caller's
  // memory through `sink` (a posted receive, as MPI's MPI_Irecv into a user buffer): a transport
  // that can hand a message over in place (ShmTransport: from the shared-memory ring;
  // InProcessTransport: from the sender's buffer) calls the sink on the bytes where they lie, so
  // a collective reduces or copies them into its destination with no intermediate copy. Errors:
  // those of Recv; Internal naming the peer if the message is not `size` bytes (nothing is
  // passed to the sink then). The default receives a copy with Recv and passes it to the sink.
  virtual absl::Status RecvInto(int peer, uint64_t tag, size_t size, absl::Time deadline,
                                RecvSink sink);

  // Receives the next message from `prev`, which must be `size` bytes, into `dst` and sends it
  // on to `next` tagged `next_tag`, unchanged (a ring all-gather step that passes a block on).
  // A transport that keeps received messages in buffers of its own sends from those
  // (GrpcTransport: gRPC's received slices go out again as they are), so the bytes are copied
  // only into dst. Errors: those of RecvInto from `prev` (nothing is sent then), then those of
  // Send to `next`. The default is RecvInto a copy into dst, then Send from dst.
  virtual absl::Status Forward(int prev, uint64_t tag, char* dst, size_t size, int next,
                               uint64_t next_tag, absl::Time deadline);

  // Direct access to co-located peers' memory, or null when this transport offers none (the
  // default). Owned by the transport.
  virtual PeerMemory* peer_memory() { return nullptr; }

  // Fails every blocked and future Send/Recv with `reason` until Reset moves to a later epoch.
  // Thread-safe.
  virtual void Abort(const absl::Status& reason) = 0;
  // Collective epochs (as NCCL's communicator abort and re-init, made cheap): every message is
  // stamped with its sender's epoch, and a receiver drops every message of an epoch earlier than
  // its own, already received or still in flight (Mailbox). After an abort or a failed collective
  // every rank of the group moves to the same new epoch before its next collective, so nothing an
  // abandoned collective sent can be read by a later one. Reset(epoch) moves this rank to `epoch`:
  // clears an Abort, replaces broken links and drops the earlier epochs' messages; it does nothing
  // unless `epoch` > epoch(). Must not run concurrently with a Send (the caller orders it with
  // its collectives); thread-safe otherwise.
  virtual void Reset(uint64_t epoch) = 0;
  // The epoch this rank's sends are stamped with and its receives accept (0 at construction).
  virtual uint64_t epoch() const = 0;

 protected:
  // InvalidArgument "<what> rank <peer>; world size is <n>" unless 0 <= peer < world_size().
  absl::Status CheckPeer(absl::string_view what, int peer) const;
};

// The Internal error RecvInto returns when `peer` sent `got` bytes tagged `tag` where `expected`
// were posted.
absl::Status WrongMessageSize(int peer, uint64_t tag, size_t got, size_t expected);

}  // namespace meshrun

#endif  // MESHRUN_CORE_COLLECTIVES_TRANSPORT_H_
