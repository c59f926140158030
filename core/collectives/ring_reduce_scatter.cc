#include "core/collectives/ring_reduce_scatter.h"

#include <cstring>

#include "core/collectives/reduce_kernels.h"
#include "core/collectives/ring_util.h"

namespace meshrun {

using ring::Mod;
using ring::Tag;

absl::Status RingReduceScatter(Communicator& comm, const void* in, int64_t count, DType dtype,
                               ReduceOp op, void* out) {
  if (absl::Status s = CheckReducible(dtype, op); !s.ok()) return s;
  const int n = comm.size();
  const int p = comm.index();
  const size_t elem = DTypeSize(dtype);
  const int64_t block_bytes = count * static_cast<int64_t>(elem);
  if (n == 1 || count == 0) {
    if (count > 0) std::memcpy(out, in, block_bytes);
    return absl::OkStatus();
  }
  // Each received chunk is reduced with this rank's input where the transport sends it from (or,
  // at the last step, into `out`), so the input is never copied whole.
  const char* input = static_cast<const char*>(in);
  const auto [t, next, prev, base, deadline, chunk_elems] = ring::MakePlan(comm, elem);

  const int first = Mod(p - 1, n);
  if (absl::Status s = ring::SendChunks(t, next, base, 0, input + first * count * elem, count, elem,
                                        chunk_elems, deadline);
      !s.ok()) {
    return ring::Annotate(s, "psum_scatter", n);
  }
  for (int step = 0; step < n - 1; ++step) {
    const int block = Mod(p - 2 - step, n);
    const bool last = step == n - 2;
    for (int64_t c = 0, i = 0; c < count; c += chunk_elems, ++i) {
      const int64_t len = std::min(chunk_elems, count - c);
      const char* mine = input + (block * count + c) * elem;
      // The received partial sum reduced with this rank's block, in one pass, into `acc`: at the
      // last step out's chunk c (the result); before it, the transport's send buffer, since a
      // partial sum is only passed on.
      // (The structured bindings are captured by copy: C++17 lambdas cannot capture them.)
      auto receive = [&, t = t, prev = prev, base = base,
                      deadline = deadline](char* acc) -> absl::Status {
        return t->RecvInto(prev, Tag(base, step, i), len * elem, deadline,
                           [&](size_t offset, const char* piece, size_t piece_bytes) {
                             ReduceTo(dtype, op, acc + offset, piece, mine + offset,
                                      piece_bytes / elem);
                           });
      };
      if (!last) {
        if (absl::Status s =
                t->SendFilled(next, Tag(base, step + 1, i), len * elem, deadline, receive);
            !s.ok()) {
          return ring::Annotate(s, "psum_scatter", n);
        }
        continue;
      }
      char* acc = static_cast<char*>(out) + c * elem;
      if (absl::Status s = receive(acc); !s.ok()) return ring::Annotate(s, "psum_scatter", n);
      if (op == ReduceOp::kMean) Scale(dtype, acc, len, 1.0f / n);
    }
  }
  return absl::OkStatus();
}

}  // namespace meshrun
