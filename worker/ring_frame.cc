#include "worker/ring_frame.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "worker/stripe_joiner.h"

namespace meshrun {
namespace {

void Put(char* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

// Received pieces smaller than this are copied into the queued Cord rather than referenced.
constexpr size_t kCopiedPieceBytes = 256;

// The flags field: bit 0 kGoodbye, bits 4-7 the lane, bits 8-11 the stripe count - 1; the rest
// must be 0.
constexpr int kLaneShift = 4, kStripesShift = 8;
constexpr uint16_t kKnownFlags = kGoodbye | 0xff0;

uint64_t Get(const char* in, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i)
    v |= static_cast<uint64_t>(static_cast<uint8_t>(in[i])) << (8 * i);
  return v;
}

}  // namespace

std::string EncodeFrameHeader(const FrameHeader& h) {
  std::string out(kFrameHeaderBytes + h.cluster_id.size(), '\0');
  Put(&out[0], static_cast<uint32_t>(h.src_rank), 4);
  Put(&out[4], h.flags | h.lane << kLaneShift | (h.stripes - 1) << kStripesShift, 2);
  Put(&out[6], h.cluster_id.size(), 2);
  Put(&out[8], h.epoch, 8);
  Put(&out[16], h.tag, 8);
  std::copy(h.cluster_id.begin(), h.cluster_id.end(), out.begin() + kFrameHeaderBytes);
  return out;
}

FrameReader::FrameReader(std::vector<grpc::Slice> slices) : slices_(std::move(slices)) {
  for (const grpc::Slice& s : slices_) remaining_ += s.size();
}

absl::StatusOr<FrameHeader> FrameReader::ReadHeader() {
  char fixed[kFrameHeaderBytes];
  if (!Read(fixed, kFrameHeaderBytes)) {
    return absl::InvalidArgumentError(absl::StrCat("ring frame of ", remaining_,
                                                   " bytes is shorter than its ", kFrameHeaderBytes,
                                                   "-byte header"));
  }
  FrameHeader h;
  h.src_rank = static_cast<int32_t>(Get(&fixed[0], 4));
  const uint16_t flags = static_cast<uint16_t>(Get(&fixed[4], 2));
  if ((flags & ~kKnownFlags) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("ring frame with flags ", flags, " (bits ",
                                                   flags & ~kKnownFlags, " are not defined)"));
  }
  h.flags = flags & kGoodbye;
  h.lane = (flags >> kLaneShift) & 0xf;
  h.stripes = ((flags >> kStripesShift) & 0xf) + 1;
  const size_t id_bytes = Get(&fixed[6], 2);
  h.epoch = Get(&fixed[8], 8);
  h.tag = Get(&fixed[16], 8);
  if (id_bytes > remaining_) {
    return absl::InvalidArgumentError(
        absl::StrCat("ring frame declares a ", id_bytes, "-byte cluster id but ends first"));
  }
  h.cluster_id.resize(id_bytes);
  Read(h.cluster_id.data(), id_bytes);
  return h;
}

void FrameReader::ForEachPiece(RecvSink sink) {
  SinkStitcher stitcher(sink);
  for (; slice_ < slices_.size(); ++slice_, pos_ = 0) {
    const grpc::Slice& s = slices_[slice_];
    stitcher.Add(reinterpret_cast<const char*>(s.begin()) + pos_, s.size() - pos_);
  }
  stitcher.Finish();
  remaining_ = 0;
}

absl::Cord FrameReader::Rest() {
  absl::Cord rest;
  for (; slice_ < slices_.size(); ++slice_, pos_ = 0) {
    const grpc::Slice& s = slices_[slice_];
    if (s.size() == pos_) continue;
    const absl::string_view piece(reinterpret_cast<const char*>(s.begin()) + pos_, s.size() - pos_);
    // A small slice keeps its bytes inside the grpc::Slice object itself (inlined), which moves
    // and dies with this reader: its bytes are copied (and so are other small pieces, which cost
    // less copied than referenced). Every other slice's bytes stay where gRPC put them.
    const char* object = reinterpret_cast<const char*>(&s);
    const bool inlined = piece.data() >= object && piece.data() < object + sizeof(s);
    if (inlined || piece.size() < kCopiedPieceBytes) {
      rest.Append(piece);
    } else {
      rest.Append(absl::MakeCordFromExternal(piece, [keep = s](absl::string_view) {}));
    }
  }
  remaining_ = 0;
  return rest;
}

bool FrameReader::Read(char* out, size_t n) {
  if (n > remaining_) return false;
  remaining_ -= n;
  while (n > 0) {
    const grpc::Slice& s = slices_[slice_];
    const size_t take = std::min(n, s.size() - pos_);
    std::memcpy(out, s.begin() + pos_, take);
    out += take;
    n -= take;
    pos_ += take;
    if (pos_ == s.size()) {
      ++slice_;
      pos_ = 0;
    }
  }
  return true;
}

RingStreamReceiver::RingStreamReceiver(std::shared_ptr<StripeJoiner> joiner, int world_size,
                                       std::string cluster_id)
    : joiner_(std::move(joiner)), world_size_(world_size), cluster_id_(std::move(cluster_id)) {}

absl::Status RingStreamReceiver::Receive(std::vector<grpc::Slice> frame) {
  FrameReader reader(std::move(frame));
  absl::StatusOr<FrameHeader> h = reader.ReadHeader();
  if (!h.ok()) return h.status();
  if (src_ < 0) {
    if (h->src_rank < 0 || h->src_rank >= world_size_) {
      return absl::InvalidArgumentError(
          absl::StrCat("ring frame from rank ", h->src_rank, "; world size is ", world_size_));
    }
    if (h->cluster_id != cluster_id_) {
      return absl::FailedPreconditionError(absl::StrCat("ring stream from cluster '", h->cluster_id,
                                                        "'; this is '", cluster_id_, "'"));
    }
    src_ = h->src_rank;
    lane_ = h->lane;
  } else if (h->src_rank != src_ || h->lane != lane_) {
    return absl::InvalidArgumentError(absl::StrCat("ring frame from rank ", h->src_rank,
                                                   " on lane ", h->lane, " in rank ", src_,
                                                   "'s stream on lane ", lane_));
  }
  if (h->flags & kGoodbye) {
    goodbye_ = true;
    return absl::OkStatus();
  }
  if (lane_ != 0 && h->stripes != 1) {
    return absl::InvalidArgumentError(absl::StrCat("ring frame on lane ", lane_,
                                                   " is striped over ", h->stripes,
                                                   " lanes; only lane 0 carries a stripe count"));
  }
  return joiner_->Receive(src_, lane_, *h, reader);
}

}  // namespace meshrun
