// libFuzzer target for the Ring service's frames (worker/ring_frame.h), in process: the fuzzer's
// bytes are one stream of raw frames, each [u16 length][u8 slice size - 1][length bytes], the
// frame's bytes split into gRPC slices of that size (as a TCP read splits them anywhere). Each
// accepted data frame is then taken from the Mailbox as a collective would, through RecvInto's
// sink (the queued Cord of slices, stitched into whole 8-byte words), checking the sink's
// promise. A crash, a sanitizer report, a leak, a hang or a broken promise is a bug; a frame
// refused with an error Status (the stream ends) is not.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/collectives/mailbox.h"
#include "worker/ring_frame.h"

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
  RingStreamReceiver stream(&mailbox, kWorld, "c");
  size_t at = 0;
  while (at + 3 <= size) {
    const size_t length = std::min<size_t>(LittleEndian(data + at, 2), size - at - 3);
    const size_t slice = data[at + 2] + size_t{1};
    const uint8_t* frame = data + at + 3;
    at += 3 + length;
    std::vector<grpc::Slice> slices;
    for (size_t i = 0; i < length; i += slice) {
      slices.emplace_back(frame + i, std::min(slice, length - i));
    }
    if (!stream.Receive(std::move(slices)).ok()) break;  // the stream ends
    if (!stream.goodbye()) TakeAsACollective(mailbox, stream.src(), frame, length);
  }
  return 0;
}
