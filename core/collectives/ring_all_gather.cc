#include "core/collectives/ring_all_gather.h"

#include <cstring>

#include "core/collectives/ring_util.h"

namespace meshrun {

using ring::Mod;
using ring::Tag;

absl::Status RingAllGather(Communicator& comm, const void* in, int64_t count, DType dtype,
                           void* out) {
  const int n = comm.size();
  const int p = comm.index();
  const size_t elem = DTypeSize(dtype);
  if (elem == 0) return absl::InvalidArgumentError("all_gather: dtype has no size");
  char* bytes = static_cast<char*>(out);
  const int64_t block_bytes = count * static_cast<int64_t>(elem);
  if (count > 0) std::memcpy(bytes + p * block_bytes, in, block_bytes);
  if (n == 1 || count == 0) return absl::OkStatus();

  const auto [t, next, prev, base, deadline, chunk_elems] = ring::MakePlan(comm, elem);

  if (absl::Status s = ring::SendChunks(t, next, base, 0, bytes + p * count * elem, count, elem,
                                        chunk_elems, deadline);
      !s.ok()) {
    return ring::Annotate(s, "all_gather", n);
  }
  for (int step = 0; step < n - 1; ++step) {
    const int block = Mod(p - step - 1, n);
    for (int64_t c = 0, i = 0; c < count; c += chunk_elems, ++i) {
      const int64_t len = std::min(chunk_elems, count - c);
      char* dst = bytes + (block * count + c) * elem;
      absl::Status received =
          step + 1 < n - 1 ? t->Forward(prev, Tag(base, step, i), dst, len * elem, next,
                                        Tag(base, step + 1, i), deadline)
                           : t->RecvInto(prev, Tag(base, step, i), len * elem, deadline,
                                         [&](size_t offset, const char* piece, size_t piece_bytes) {
                                           std::memcpy(dst + offset, piece, piece_bytes);
                                         });
      if (!received.ok()) return ring::Annotate(received, "all_gather", n);
    }
  }
  return absl::OkStatus();
}

}  // namespace meshrun
