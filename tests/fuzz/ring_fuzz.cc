// libFuzzer target for the Ring service's frames (worker/ring_frame.h), in process: the fuzzer's
// bytes are raw frames, each [u16 length][u8 slice size - 1][length bytes], the
// frame's bytes split into gRPC slices of that size (as a TCP read splits them anywhere). Each
// accepted data frame is then taken from the Mailbox as a collective would, through RecvInto's
// sink (the queued Cord of slices, stitched into whole 8-byte words), checking the sink's
// promise. Frames whose flags name another lane go to that lane's stream, and frames that carry
// a stripe count are joined with their pieces (worker/stripe_joiner.h); once an input uses lanes,
// what is delivered is taken without comparing it with one frame. A crash, a sanitizer report, a
// leak, a hang or a broken promise is a bug; a frame refused with an error Status (the stream
// ends) is not.
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "core/collectives/mailbox.h"
#include "worker/ring_frame.h"
#include "worker/stripe_joiner.h"

namespace meshrun {
namespace {

constexpr int kWorld = 4;

uint64_t LittleEndian(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

// Takes the frame just delivered, as a RecvInto of its tag and size would.
void TakeAsACollective(Mailbox& mailbox, int src, const uint8_t* frame, size_t size) {
  if (size < kFrameHeaderBytes) return;
  const uint64_t tag = LittleEndian(frame + 16, 8);
  const size_t id_bytes = LittleEndian(frame + 6, 2);
  const size_t payload = size - kFrameHeaderBytes - id_bytes;
  std::string got;
  auto sink = [&](size_t offset, const char* data, size_t n) {
    if (offset != got.size() || offset % 8 != 0 || (offset + n < payload && n % 8 != 0)) abort();
    got.append(data, n);
  };
  absl::Status s = mailbox.TakeInto(src, tag, payload, absl::Now(), sink);
  // Taken: every payload byte reached the sink, as sent. (Frames of a later epoch stay queued:
  // Aborted; a frame left behind by an earlier error is reported as the wrong tag or size.)
  if (s.ok() && std::string(reinterpret_cast<const char*>(frame) + kFrameHeaderBytes + id_bytes,
                            payload) != got) {
    abort();
  }
}

}  // namespace
}  // namespace meshrun

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshrun;
  Mailbox mailbox(kWorld);
  auto joiner = std::make_shared<StripeJoiner>(&mailbox, kWorld);
  // One stream per lane, as a striping sender opens them; a frame goes to the lane its flags name.
  std::unique_ptr<RingStreamReceiver> streams[kMaxLanes];
  bool ended[kMaxLanes] = {};
  bool striped = false;  // some frame was on a lane other than 0 or carried a stripe count
  size_t at = 0;
  while (at + 3 <= size) {
    const size_t length = std::min<size_t>(LittleEndian(data + at, 2), size - at - 3);
    const size_t slice = data[at + 2] + size_t{1};
    const uint8_t* frame = data + at + 3;
    at += 3 + length;
    const uint64_t flags = length >= 6 ? LittleEndian(frame + 4, 2) : 0;
    const int lane = static_cast<int>((flags >> 4) & 0xf);
    striped = striped || (flags & 0xff0) != 0;
    if (ended[lane]) continue;
    if (streams[lane] == nullptr) {
      streams[lane] = std::make_unique<RingStreamReceiver>(joiner, kWorld, "c");
    }
    RingStreamReceiver& stream = *streams[lane];
    std::vector<grpc::Slice> slices;
    for (size_t i = 0; i < length; i += slice) {
      slices.emplace_back(frame + i, std::min(slice, length - i));
    }
    if (!stream.Receive(std::move(slices)).ok()) {  // the stream ends
      ended[lane] = true;
      continue;
    }
    if (stream.goodbye()) continue;
    if (!striped) {
      TakeAsACollective(mailbox, stream.src(), frame, length);
    } else {
      // Joined messages have no one frame to compare with: take whatever was delivered.
      for (int i = 0; i < 64; ++i) {
        const absl::Status s = mailbox.Take(stream.src(), 0, absl::Now()).status();
        if (!s.ok() && s.code() != absl::StatusCode::kInternal) break;  // nothing more (or later)
      }
    }
  }
  return 0;
}
