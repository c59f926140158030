#include "core/collectives/ring_reduce_scatter.h"

#include <cstring>

#include "core/collectives/reduce_kernels.h"
#include "core/collectives/ring_util.h"

namespace meshrun {

using ring::Mod;
using ring::Tag;

absl::Status RingReduceScatter(Communicator& comm, const void* in, int64_t count, DType dtype, ReduceOp op,
                               void* out) {
  if (absl::Status s = CheckReducible(dtype, op); !s.ok()) return s;
  const int n = comm.size();
  const int p = comm.index();
  const size_t elem = DTypeSize(dtype);
  const int64_t block_bytes = count * static_cast<int64_t>(elem);
  if (n == 1 || count == 0) {
    if (count > 0) std::memcpy(out, in, block_bytes);
    return absl::OkStatus();
  }
  // Each received chunk is reduced with this rank's input in its place in `out` and forwarded
  // from there, so the input is never copied whole.
  const char* input = static_cast<const char*>(in);
  const auto [t, next, prev, base, deadline, chunk_elems] = ring::MakePlan(comm, elem);

  const int first = Mod(p - 1, n);
  if (absl::Status s = ring::SendChunks(t, next, base, 0, input + first * count * elem, count, elem, chunk_elems,
                                       deadline);
      !s.ok()) {
    return ring::Annotate(s, "psum_scatter", n);
  }
  for (int step = 0; step < n - 1; ++step) {
    const int block = Mod(p - 2 - step, n);
    const bool last = step == n - 2;
    for (int64_t c = 0, i = 0; c < count; c += chunk_elems, ++i) {
      const int64_t len = std::min(chunk_elems, count - c);
      // The chunk's partial sum lands in out's chunk c (a scratch buffer of the right size until
      // the last step, when it is the result) and is reduced there with this rank's block.
      char* acc = static_cast<char*>(out) + c * elem;
      absl::Status received = t->RecvInto(prev, Tag(base, step, i), len * elem, deadline,
                                          [&](size_t offset, const char* piece, size_t piece_bytes) {
                                            std::memcpy(acc + offset, piece, piece_bytes);
                                          });
      if (!received.ok()) return ring::Annotate(received, "psum_scatter", n);
      Reduce(dtype, op, acc, input + (block * count + c) * elem, len);
      if (last) {
        if (op == ReduceOp::kMean) Scale(dtype, acc, len, 1.0f / n);
      } else if (absl::Status s = t->Send(next, Tag(base, step + 1, i), absl::string_view(acc, len * elem), deadline);
                 !s.ok()) {
        return ring::Annotate(s, "psum_scatter", n);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace meshrun
