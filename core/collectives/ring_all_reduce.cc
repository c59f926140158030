#include "core/collectives/ring_all_reduce.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/collectives/reduce_kernels.h"
#include "core/collectives/ring_util.h"

namespace meshrun {
using ring::Mod;
using ring::Segment;
using ring::SplitEvenly;

absl::Status RingAllReduce(Communicator& comm, void* data, int64_t count, DType dtype, ReduceOp op) {
  if (absl::Status s = CheckReducible(dtype, op); !s.ok()) return s;
  const int n = comm.size();
  const int p = comm.index();
  if (n == 1 || count == 0) return absl::OkStatus();

  const size_t elem = DTypeSize(dtype);
  const std::vector<Segment> segments = SplitEvenly(count, n);
  const auto [t, next, prev, tag_base, deadline, chunk_elems] = ring::MakePlan(comm, elem);
  char* bytes = static_cast<char*>(data);

  const int total_steps = 2 * (n - 1);
  if (absl::Status st = ring::SendChunks(t, next, tag_base, 0, bytes + segments[p].offset * elem, segments[p].count,
                                         elem, chunk_elems, deadline);
      !st.ok()) {
    return ring::Annotate(st, "all_reduce", n);
  }
  for (int step = 0; step < total_steps; ++step) {
    const bool reducing = step < n - 1;
    const int seg = reducing ? Mod(p - step - 1, n) : Mod(p - (step - (n - 1)), n);
    const bool last_reduce = step == n - 2;
    const bool forward = step + 1 < total_steps;
    const Segment& s = segments[seg];
    for (int64_t c = 0, i = 0; c < s.count; c += chunk_elems, ++i) {
      const int64_t len = std::min(chunk_elems, s.count - c);
      char* dst = bytes + (s.offset + c) * elem;
      // Received in place: reduced (or, in the all-gather phase, copied) straight into dst.
      absl::Status received = t->RecvInto(
          prev, tag_base + (uint64_t(step) << 16) + i, len * elem, deadline,
          [&](size_t offset, const char* piece, size_t piece_bytes) {
            if (reducing) {
              Reduce(dtype, op, dst + offset, piece, piece_bytes / elem);
            } else {
              std::memcpy(dst + offset, piece, piece_bytes);
            }
          });
      if (!received.ok()) {
        return absl::Status(received.code(), absl::StrCat("all_reduce over ranks of size ", n,
                                                          " at ring step ", step, ": ",
                                                          received.message()));
      }
      if (last_reduce && op == ReduceOp::kMean) Scale(dtype, dst, len, 1.0f / n);
      if (forward) {
        absl::string_view payload(dst, len * elem);
        if (absl::Status st = t->Send(next, tag_base + (uint64_t(step + 1) << 16) + i, payload, deadline);
            !st.ok()) {
          return st;
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status RecursiveDoublingAllReduce(Communicator& comm, void* data, int64_t count, DType dtype,
                                        ReduceOp op) {
  if (absl::Status s = CheckReducible(dtype, op); !s.ok()) return s;
  const int n = comm.size();
  const int p = comm.index();
  if (n == 1 || count == 0) return absl::OkStatus();
  if ((n & (n - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("recursive doubling all_reduce needs a power-of-two group; got ", n, " ranks"));
  }
  const size_t elem = DTypeSize(dtype);
  const int64_t bytes = count * static_cast<int64_t>(elem);
  Transport* t = comm.transport();
  const uint64_t tag_base = comm.NextTagBase();
  const absl::Time deadline = absl::Now() + comm.options().timeout;
  char* buf = static_cast<char*>(data);
  for (int step = 0, distance = 1; distance < n; ++step, distance <<= 1) {
    const int partner = comm.group()[p ^ distance];
    const uint64_t tag = tag_base + (uint64_t(step) << 16);
    if (absl::Status st = t->Send(partner, tag, absl::string_view(buf, bytes), deadline); !st.ok()) {
      return ring::Annotate(st, "all_reduce", n);
    }
    // The send copied buf out already: the partner's values reduce into it where they lie.
    absl::Status received =
        t->RecvInto(partner, tag, bytes, deadline,
                    [&](size_t offset, const char* piece, size_t piece_bytes) {
                      Reduce(dtype, op, buf + offset, piece, piece_bytes / elem);
                    });
    if (!received.ok()) {
      return absl::Status(received.code(),
                          absl::StrCat("all_reduce over ranks of size ", n, " at butterfly step ",
                                       step, ": ", received.message()));
    }
  }
  if (op == ReduceOp::kMean) Scale(dtype, buf, count, 1.0f / n);
  return absl::OkStatus();
}

}  // namespace meshrun
