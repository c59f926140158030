// Ring.Transfer's frames (proto/meshrun/v1/ring.proto's Chunk comment lays them out): what one
// raw message of a ring stream holds, and the receiving end of one stream, which checks each
// frame and hands its payload to the Mailbox without copying it out of gRPC's slices.
#ifndef MESHRUN_WORKER_RING_FRAME_H_
#define MESHRUN_WORKER_RING_FRAME_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "core/collectives/mailbox.h"
#include "grpcpp/support/slice.h"

namespace meshrun {

class StripeJoiner;

inline constexpr size_t kFrameHeaderBytes = 24;
inline constexpr uint16_t kGoodbye = 1;  // flag: the sender closes the stream on purpose
// Streams a sender may open to one receiver (lanes; worker/stripe_joiner.h).
inline constexpr int kMaxLanes = 16;

// A frame's header and cluster id; the payload is the rest of the message.
struct FrameHeader {
  int src_rank = 0;
  uint16_t flags = 0;  // kGoodbye or 0 (the lane and stripe count have fields of their own)
  // Which of the sender's streams to this receiver carries the frame: 0 <= lane < kMaxLanes,
  // the same for every frame of a stream.
  int lane = 0;
  // Lane 0: the number of lanes this message is striped over, 1 <= stripes <= kMaxLanes (its
  // piece j comes on lane j). Other lanes: 1 (a piece).
  int stripes = 1;
  uint64_t epoch = 0;
  uint64_t tag = 0;
  std::string cluster_id;  // only on a stream's first frame (at most 65535 bytes)
};

// The header's 24 little-endian bytes, then the cluster id.
std::string EncodeFrameHeader(const FrameHeader& header);

// Reads a received frame where gRPC's slices hold it: the header is copied out (it may straddle
// slices), the payload is passed on where it lies. Not thread-safe.
class FrameReader {
 public:
  explicit FrameReader(std::vector<grpc::Slice> slices);
  size_t remaining() const { return remaining_; }
  // Errors: InvalidArgument when the frame ends inside the header or the cluster id.
  absl::StatusOr<FrameHeader> ReadHeader();
  // Passes the unread bytes to `sink` (SinkStitcher keeps RecvSink's promise of whole 8-byte
  // words across slice boundaries).
  void ForEachPiece(RecvSink sink);
  // The unread bytes as a Cord over gRPC's slices (each chunk holds a reference to its slice;
  // small and inlined slices are copied).
  absl::Cord Rest();

 private:
  bool Read(char* out, size_t n);
  std::vector<grpc::Slice> slices_;
  size_t slice_ = 0, pos_ = 0, remaining_ = 0;
};

// The receiving end of one ring stream: the first frame names the sender (a rank of the world),
// the cluster and the stream's lane; every later frame must come from the same rank on the same
// lane. A data frame goes to `joiner` (shared by all of the world's streams into this worker),
// which hands it to the posted receive (Mailbox::BeginInPlace) or the mailbox's queue. Not
// thread-safe (a stream's frames come one at a time).
class RingStreamReceiver {
 public:
  // `joiner` delivers into the Mailbox, for a world of `world_size` ranks.
  RingStreamReceiver(std::shared_ptr<StripeJoiner> joiner, int world_size, std::string cluster_id);
  // Errors (the stream must then end): InvalidArgument for a short frame, a first frame naming a
  // rank outside the world, a later frame naming another rank or lane, flags other than those
  // FrameHeader defines, or a stripe count on a lane other than 0; FailedPrecondition for a first
  // frame of another cluster; the joiner's errors.
  absl::Status Receive(std::vector<grpc::Slice> frame);
  int src() const { return src_; }  // -1 until the first frame
  bool goodbye() const { return goodbye_; }

 private:
  const std::shared_ptr<StripeJoiner> joiner_;
  const int world_size_;
  const std::string cluster_id_;
  int src_ = -1;
  int lane_ = -1;
  bool goodbye_ = false;
};

}  // namespace meshrun

#endif  // MESHRUN_WORKER_RING_FRAME_H_
