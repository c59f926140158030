#include "core/collectives/ring_all_reduce.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/collectives/reduce_kernels.h"
#include "core/collectives/ring_util.h"

namespace meshrun {
using ring::Mod;
using ring::Segment;
using ring::SplitEvenly;

absl::Status RingAllReduce(Communicator& comm, void* data, int64_t count, DType dtype,
                           ReduceOp op) {
  if (absl::Status s = CheckReducible(dtype, op); !s.ok()) return s;
  const int n = comm.size();
  const int p = comm.index();
  if (n == 1 || count == 0) return absl::OkStatus();

  const size_t elem = DTypeSize(dtype);
  const std::vector<Segment> segments = SplitEvenly(count, n);
  const auto [t, next, prev, tag_base, deadline, chunk_elems] = ring::MakePlan(comm, elem);
  char* bytes = static_cast<char*>(data);

  const int total_steps = 2 * (n - 1);
  if (absl::Status st = ring::SendChunks(t, next, tag_base, 0, bytes + segments[p].offset * elem,
                                         segments[p].count, elem, chunk_elems, deadline);
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
      const uint64_t tag = tag_base + (uint64_t(step) << 16) + i;
      const uint64_t next_tag = tag_base + (uint64_t(step + 1) << 16) + i;
      // Receives the chunk straight into `out`: reduced with this rank's values at dst (or, in
      // the all-gather phase, copied).
      // (The structured bindings are captured by copy: C++17 lambdas cannot capture them.)
      auto at_step = [n, step](const absl::Status& s) {
        if (s.ok()) return s;
        return absl::Status(s.code(), absl::StrCat("all_reduce over ranks of size ", n,
                                                   " at ring step ", step, ": ", s.message()));
      };
      auto receive = [&, t = t, prev = prev, deadline = deadline](char* out) -> absl::Status {
        absl::Status received = t->RecvInto(
            prev, tag, len * elem, deadline,
            [&](size_t offset, const char* piece, size_t piece_bytes) {
              if (reducing) {
                ReduceTo(dtype, op, out + offset, dst + offset, piece, piece_bytes / elem);
              } else {
                std::memcpy(out + offset, piece, piece_bytes);
              }
            });
        return at_step(received);
      };
      if (!reducing && forward) {
        // An all-gather step that passes the block on: copied into dst and sent on from where
        // the transport received it.
        absl::Status st = t->Forward(prev, tag, dst, len * elem, next, next_tag, deadline);
        if (!st.ok()) return at_step(st);
        continue;
      }
      if (reducing && !last_reduce) {
        // A partial sum this rank only passes on: reduced straight into the transport's send
        // buffer (dst keeps this rank's own values, which nothing reads again).
        if (absl::Status st = t->SendFilled(next, next_tag, len * elem, deadline, receive);
            !st.ok()) {
          return st;
        }
        continue;
      }
      if (absl::Status st = receive(dst); !st.ok()) return st;
      if (last_reduce && op == ReduceOp::kMean) Scale(dtype, dst, len, 1.0f / n);
      if (forward) {
        if (absl::Status st = t->Send(next, next_tag, absl::string_view(dst, len * elem), deadline);
            !st.ok()) {
          return st;
        }
      }
    }
  }
  return absl::OkStatus();
}

namespace {

// The butterfly's largest power of two not above `n`.
int FloorPowerOfTwo(int n) {
  int pof2 = 1;
  while (pof2 * 2 <= n) pof2 *= 2;
  return pof2;
}

}  // namespace

absl::Status RecursiveDoublingAllReduce(Communicator& comm, void* data, int64_t count, DType dtype,
                                        ReduceOp op) {
  if (absl::Status s = CheckReducible(dtype, op); !s.ok()) return s;
  const int n = comm.size();
  const int p = comm.index();
  if (n == 1 || count == 0) return absl::OkStatus();
  const size_t elem = DTypeSize(dtype);
  const int64_t bytes = count * static_cast<int64_t>(elem);
  Transport* t = comm.transport();
  const uint64_t tag_base = comm.NextTagBase();
  const absl::Time deadline = absl::Now() + comm.options().timeout;
  char* buf = static_cast<char*>(data);
  const int pof2 = FloorPowerOfTwo(n);
  const int rem = n - pof2;
  // Step tags: 0 folds the first 2 * rem positions in pairs, 1..log2(pof2) are the butterfly's,
  // the last hands the result back to the folded-out positions.
  auto tag = [tag_base](int step) { return tag_base + (uint64_t(step) << 16); };
  auto fail = [n](const absl::Status& s, const std::string& where) {
    return absl::Status(s.code(), absl::StrCat("all_reduce over ranks of size ", n, " at ", where,
                                               ": ", s.message()));
  };
  auto reduce_from = [&](int peer, int step, const std::string& where) {
    absl::Status received =
        t->RecvInto(peer, tag(step), bytes, deadline,
                    [&](size_t offset, const char* piece, size_t piece_bytes) {
                      Reduce(dtype, op, buf + offset, piece, piece_bytes / elem);
                    });
    return received.ok() ? received : fail(received, where);
  };
  const bool folded = p < 2 * rem;
  int steps = 0;
  for (int d = 1; d < pof2; d <<= 1) ++steps;
  if (folded && p % 2 == 0) {
    // Folded out: hand this value to the odd neighbour, take the result back from it.
    const int keeper = comm.group()[p + 1];
    if (absl::Status st = t->Send(keeper, tag(0), absl::string_view(buf, bytes), deadline);
        !st.ok()) {
      return ring::Annotate(st, "all_reduce", n);
    }
    absl::Status received = t->RecvInto(keeper, tag(steps + 1), bytes, deadline,
                                        [&](size_t offset, const char* piece, size_t piece_bytes) {
                                          std::memcpy(buf + offset, piece, piece_bytes);
                                        });
    if (!received.ok()) return fail(received, "the result of the folded pair");
  } else {
    if (folded) {
      if (absl::Status st = reduce_from(comm.group()[p - 1], 0, "the fold of its pair"); !st.ok()) {
        return st;
      }
    }
    // Position among the butterfly's pof2 members, and back.
    const int v = folded ? p / 2 : p - rem;
    auto position = [rem](int w) { return w < rem ? 2 * w + 1 : w + rem; };
    for (int step = 1, distance = 1; distance < pof2; ++step, distance <<= 1) {
      const int partner = comm.group()[position(v ^ distance)];
      if (absl::Status st = t->Send(partner, tag(step), absl::string_view(buf, bytes), deadline);
          !st.ok()) {
        return ring::Annotate(st, "all_reduce", n);
      }
      // The send copied buf out already: the partner's values reduce into it where they lie.
      if (absl::Status st = reduce_from(partner, step, absl::StrCat("butterfly step ", step - 1));
          !st.ok()) {
        return st;
      }
    }
    if (folded) {
      if (absl::Status st =
              t->Send(comm.group()[p - 1], tag(steps + 1), absl::string_view(buf, bytes), deadline);
          !st.ok()) {
        return ring::Annotate(st, "all_reduce", n);
      }
    }
  }
  // Every position scales the same bits the same way, so all end equal.
  if (op == ReduceOp::kMean) Scale(dtype, buf, count, 1.0f / n);
  return absl::OkStatus();
}

absl::Status OneShotAllReduce(Communicator& comm, void* data, int64_t count, DType dtype,
                              ReduceOp op) {
  if (absl::Status s = CheckReducible(dtype, op); !s.ok()) return s;
  const int n = comm.size();
  const int p = comm.index();
  if (n == 1 || count == 0) return absl::OkStatus();
  const size_t elem = DTypeSize(dtype);
  const size_t bytes = static_cast<size_t>(count) * elem;
  Transport* t = comm.transport();
  const uint64_t tag = comm.NextTagBase();
  const absl::Time deadline = absl::Now() + comm.options().timeout;
  char* buf = static_cast<char*>(data);
  // Sent to the positions after this one first, so that not every rank starts with position 0.
  for (int k = 1; k < n; ++k) {
    if (absl::Status st =
            t->Send(comm.group()[(p + k) % n], tag, absl::string_view(buf, bytes), deadline);
        !st.ok()) {
      return ring::Annotate(st, "all_reduce", n);
    }
  }
  const std::string mine(buf, bytes);
  for (int q = 0; q < n; ++q) {
    // Position 0's values first, then each next position's reduced in: the same order on every
    // rank.
    if (q == p) {
      if (q == 0) continue;  // already in buf
      Reduce(dtype, op, buf, mine.data(), count);
      continue;
    }
    absl::Status received =
        t->RecvInto(comm.group()[q], tag, bytes, deadline,
                    [&](size_t offset, const char* piece, size_t piece_bytes) {
                      if (q == 0) {
                        std::memcpy(buf + offset, piece, piece_bytes);
                      } else {
                        Reduce(dtype, op, buf + offset, piece, piece_bytes / elem);
                      }
                    });
    if (!received.ok()) {
      return absl::Status(received.code(), absl::StrCat("one-shot all_reduce over ranks of size ",
                                                        n, ": ", received.message()));
    }
  }
  if (op == ReduceOp::kMean) Scale(dtype, buf, count, 1.0f / n);
  return absl::OkStatus();
}

}  // namespace meshrun
