// Helpers shared by the ring algorithms (internal to core/collectives).
#ifndef MESHRUN_CORE_COLLECTIVES_RING_UTIL_H_
#define MESHRUN_CORE_COLLECTIVES_RING_UTIL_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/collectives/communicator.h"

namespace meshrun::ring {

struct Segment {
  int64_t offset;  // elements
  int64_t count;
};

// `count` elements cut into `parts` segments whose sizes differ by at most one.
inline std::vector<Segment> SplitEvenly(int64_t count, int parts) {
  std::vector<Segment> out;
  int64_t base = count / parts, extra = count % parts, offset = 0;
  for (int i = 0; i < parts; ++i) {
    int64_t n = base + (i < extra ? 1 : 0);
    out.push_back({offset, n});
    offset += n;
  }
  return out;
}

// `parts` equal blocks of `block` elements.
inline std::vector<Segment> EqualBlocks(int64_t block, int parts) {
  std::vector<Segment> out;
  for (int i = 0; i < parts; ++i) out.push_back({i * block, block});
  return out;
}

inline int Mod(int a, int n) { return ((a % n) + n) % n; }

// What every ring algorithm starts from: the transport, this rank's ring neighbours in the
// group, the collective's tag base (consumed here, once per collective), its deadline and the
// chunk size in elements.
struct Plan {
  Transport* transport;
  int next;
  int prev;
  uint64_t tag_base;
  absl::Time deadline;
  int64_t chunk_elems;
};
inline Plan MakePlan(Communicator& comm, size_t elem) {
  const int n = comm.size(), p = comm.index();
  return Plan{comm.transport(),
              comm.group()[Mod(p + 1, n)],
              comm.group()[Mod(p - 1, n)],
              comm.NextTagBase(),
              absl::Now() + comm.options().timeout,
              std::max<int64_t>(1, static_cast<int64_t>(comm.options().chunk_bytes / elem))};
}

// Tag of chunk `chunk` at ring step `step` of the collective with tag base `base`.
inline uint64_t Tag(uint64_t base, int step, int64_t chunk) {
  return base + (static_cast<uint64_t>(step) << 16) + static_cast<uint64_t>(chunk);
}

// Sends `count` elements at `data` to `peer` in chunks of `chunk_elems`, chunk i tagged
// (base, step, i).
inline absl::Status SendChunks(Transport* t, int peer, uint64_t base, int step, const char* data, int64_t count,
                               size_t elem, int64_t chunk_elems, absl::Time deadline) {
  for (int64_t c = 0, i = 0; c < count; c += chunk_elems, ++i) {
    const int64_t len = std::min(chunk_elems, count - c);
    absl::string_view payload(data + c * static_cast<int64_t>(elem), len * elem);
    if (absl::Status s = t->Send(peer, Tag(base, step, i), payload, deadline); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// Prefixes a transport error with the collective's name and group size.
inline absl::Status Annotate(const absl::Status& s, const char* what, int group_size) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(what, " over ", group_size, " ranks: ", s.message()));
}

}  // namespace meshrun::ring

#endif  // MESHRUN_CORE_COLLECTIVES_RING_UTIL_H_
