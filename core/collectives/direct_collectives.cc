#include "core/collectives/direct_collectives.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/collectives/reduce_kernels.h"
#include "core/collectives/ring_util.h"

namespace meshrun {
namespace {

// One direct collective's messages: its tags, deadline and group.
class Session {
 public:
  Session(Communicator& comm, const char* what)
      : comm_(comm),
        what_(what),
        tag_base_(comm.NextTagBase()),
        deadline_(absl::Now() + comm.options().timeout) {}

  // Phase 1: for each member (by group position), its addresses of the buffers `mine` ((address,
  // bytes) of each; this rank's own at index()), or nullopt if some member's buffers are not all
  // shareable. One message per peer: the handles joined by spaces, or "" if any is unshareable.
  using Buffers = std::vector<std::vector<char*>>;
  absl::StatusOr<std::optional<Buffers>> Exchange(
      const std::vector<std::pair<const void*, size_t>>& mine) {
    PeerMemory* memory = comm_.transport()->peer_memory();
    std::vector<std::string> exported;
    for (const auto& [data, bytes] : mine) exported.push_back(memory->Export(data, bytes));
    const bool shareable = std::none_of(exported.begin(), exported.end(),
                                        [](const std::string& h) { return h.empty(); });
    const std::string message = shareable ? absl::StrJoin(exported, " ") : "";
    absl::StatusOr<std::vector<std::string>> messages = WithEveryOther(tag_base_ + 1, message);
    if (!messages.ok()) return messages.status();
    const int p = comm_.index();
    (*messages)[p] = message;
    if (std::any_of(messages->begin(), messages->end(),
                    [](const std::string& m) { return m.empty(); })) {
      return std::optional<Buffers>();
    }
    Buffers buffers(comm_.size());
    for (const auto& [data, bytes] : mine)
      buffers[p].push_back(static_cast<char*>(const_cast<void*>(data)));
    for (int q = 0; q < comm_.size(); ++q) {
      if (q == p) continue;
      const std::vector<std::string> handles = absl::StrSplit((*messages)[q], ' ');
      if (handles.size() != mine.size()) {
        return Annotate(
            absl::InternalError(absl::StrCat("rank ", comm_.group()[q], " sent ", handles.size(),
                                             " memory handles; expected ", mine.size())));
      }
      for (const std::string& h : handles) {
        absl::StatusOr<void*> b = memory->Import(comm_.group()[q], h);
        if (!b.ok()) return Annotate(b.status());
        buffers[q].push_back(static_cast<char*>(*b));
      }
    }
    return std::optional<Buffers>(std::move(buffers));
  }

  // Phase 1 for one buffer per member: each member's address of it.
  absl::StatusOr<std::optional<std::vector<char*>>> Exchange(const void* mine, size_t bytes) {
    absl::StatusOr<std::optional<Buffers>> all = Exchange({{mine, bytes}});
    if (!all.ok()) return all.status();
    if (!all->has_value()) return std::optional<std::vector<char*>>();
    std::vector<char*> firsts;
    for (const std::vector<char*>& b : **all) firsts.push_back(b[0]);
    return std::optional<std::vector<char*>>(std::move(firsts));
  }

  // Phase 3: returns once every member is done with every buffer.
  absl::Status Finish() { return WithEveryOther(tag_base_ + 2, "").status(); }

  // Elements per chunk of phase 2.
  int64_t ChunkElems(size_t elem) const {
    const size_t bytes = std::min<size_t>(comm_.options().chunk_bytes, 64 * 1024);
    return std::max<int64_t>(1, static_cast<int64_t>(bytes / elem));
  }

 private:
  // Sends `payload` to every other member, then receives one message tagged `tag` from each:
  // theirs by group position (this rank's own entry left empty).
  absl::StatusOr<std::vector<std::string>> WithEveryOther(uint64_t tag,
                                                          const std::string& payload) {
    const int n = comm_.size(), p = comm_.index();
    Transport* t = comm_.transport();
    for (int q = 0; q < n; ++q) {
      if (q == p) continue;
      if (absl::Status s = t->Send(comm_.group()[q], tag, payload, deadline_); !s.ok()) {
        return Annotate(s);
      }
    }
    std::vector<std::string> received(n);
    for (int q = 0; q < n; ++q) {
      if (q == p) continue;
      absl::StatusOr<std::string> m = t->Recv(comm_.group()[q], tag, deadline_);
      if (!m.ok()) return Annotate(m.status());
      received[q] = *std::move(m);
    }
    return received;
  }

  absl::Status Annotate(const absl::Status& s) const {
    return ring::Annotate(s, what_, comm_.size());
  }

  Communicator& comm_;
  const char* const what_;
  const uint64_t tag_base_;
  const absl::Time deadline_;
};

// dst = reduction over q of src[q] + offset, in group order; len elements.
void ReduceAll(DType dtype, ReduceOp op, char* dst, const std::vector<char*>& src, size_t offset,
               int64_t len) {
  const size_t elem = DTypeSize(dtype);
  size_t q = 1;
  if (op != ReduceOp::kMax && src.size() >= 2) {
    Add(dtype, dst, src[0] + offset, src[1] + offset, len);  // (the bits of copy, then add)
    q = 2;
  } else {
    std::memcpy(dst, src[0] + offset, len * elem);
  }
  for (; q < src.size(); ++q) Reduce(dtype, op, dst, src[q] + offset, len);
  if (op == ReduceOp::kMean) Scale(dtype, dst, len, 1.0f / src.size());
}

}  // namespace

absl::StatusOr<DirectResult> DirectAllReduce(Communicator& comm, void* data, int64_t count,
                                             DType dtype, ReduceOp op) {
  if (absl::Status s = CheckReducible(dtype, op); !s.ok()) return s;
  const size_t elem = DTypeSize(dtype);
  Session session(comm, "direct all_reduce");
  absl::StatusOr<std::optional<std::vector<char*>>> buffers = session.Exchange(data, count * elem);
  if (!buffers.ok()) return buffers.status();
  if (!buffers->has_value()) return DirectResult::kFellBack;
  const std::vector<char*>& b = **buffers;
  const ring::Segment seg = ring::SplitEvenly(count, comm.size())[comm.index()];
  const int64_t chunk = session.ChunkElems(elem);
  std::vector<char> scratch(std::min(chunk, std::max<int64_t>(seg.count, 1)) * elem);
  for (int64_t c = 0; c < seg.count; c += chunk) {
    const int64_t len = std::min(chunk, seg.count - c);
    const size_t offset = (seg.offset + c) * elem;
    ReduceAll(dtype, op, scratch.data(), b, offset, len);
    for (char* buffer : b) std::memcpy(buffer + offset, scratch.data(), len * elem);
  }
  if (absl::Status s = session.Finish(); !s.ok()) return s;
  return DirectResult::kDone;
}

absl::StatusOr<DirectResult> DirectAllReduceUpdate(
    Communicator& comm, const void* partial, int64_t count, DType dtype, ReduceOp op,
    const std::vector<void*>& outputs, const std::vector<size_t>& out_elems,
    absl::FunctionRef<void(int64_t begin, int64_t len, const void* reduced)> update,
    const DirectExtraSum* extra) {
  if (absl::Status s = CheckReducible(dtype, op); !s.ok()) return s;
  if (out_elems.size() != outputs.size()) {
    return absl::InvalidArgumentError(absl::StrCat("direct all_reduce + update: ", outputs.size(),
                                                   " outputs but ", out_elems.size(),
                                                   " element sizes"));
  }
  const size_t elem = DTypeSize(dtype);
  Session session(comm, "direct all_reduce + update");
  std::vector<std::pair<const void*, size_t>> mine = {{partial, count * elem}};
  for (size_t k = 0; k < outputs.size(); ++k) mine.emplace_back(outputs[k], count * out_elems[k]);
  if (extra != nullptr) {
    if (absl::Status s = CheckReducible(extra->dtype, ReduceOp::kSum); !s.ok()) return s;
    mine.emplace_back(extra->partial, extra->count * DTypeSize(extra->dtype));
  }
  absl::StatusOr<std::optional<std::vector<std::vector<char*>>>> buffers = session.Exchange(mine);
  if (!buffers.ok()) return buffers.status();
  if (!buffers->has_value()) return DirectResult::kFellBack;
  std::vector<std::vector<char*>> b = **std::move(buffers);
  const int p = comm.index();
  if (extra != nullptr) {
    std::vector<char*> extras;
    for (std::vector<char*>& member : b) {
      extras.push_back(member.back());
      member.pop_back();
    }
    ReduceAll(extra->dtype, ReduceOp::kSum, static_cast<char*>(extra->out), extras, 0,
              extra->count);
  }
  std::vector<char*> partials;
  for (const std::vector<char*>& member : b) partials.push_back(member[0]);
  const ring::Segment seg = ring::SplitEvenly(count, comm.size())[p];
  const int64_t chunk = session.ChunkElems(elem);
  std::vector<char> scratch(std::min(chunk, std::max<int64_t>(seg.count, 1)) * elem);
  for (int64_t c = 0; c < seg.count; c += chunk) {
    const int64_t begin = seg.offset + c, len = std::min(chunk, seg.count - c);
    ReduceAll(dtype, op, scratch.data(), partials, begin * elem, len);
    update(begin, len, scratch.data());  // into this rank's outputs
    for (int q = 0; q < comm.size(); ++q) {
      if (q == p) continue;
      for (size_t k = 1; k < b[q].size(); ++k) {
        const size_t e = out_elems[k - 1];
        StreamCopy(b[q][k] + begin * e, b[p][k] + begin * e, len * e);
      }
    }
  }
  if (absl::Status s = session.Finish(); !s.ok()) return s;
  return DirectResult::kDone;
}

absl::StatusOr<DirectResult> DirectReduceScatter(Communicator& comm, const void* in, int64_t count,
                                                 DType dtype, ReduceOp op, void* out) {
  if (absl::Status s = CheckReducible(dtype, op); !s.ok()) return s;
  const size_t elem = DTypeSize(dtype);
  Session session(comm, "direct reduce_scatter");
  absl::StatusOr<std::optional<std::vector<char*>>> buffers =
      session.Exchange(in, comm.size() * count * elem);
  if (!buffers.ok()) return buffers.status();
  if (!buffers->has_value()) return DirectResult::kFellBack;
  const int64_t chunk = session.ChunkElems(elem);
  const size_t block = comm.index() * count * elem;
  for (int64_t c = 0; c < count; c += chunk) {
    const int64_t len = std::min(chunk, count - c);
    ReduceAll(dtype, op, static_cast<char*>(out) + c * elem, **buffers, block + c * elem, len);
  }
  if (absl::Status s = session.Finish(); !s.ok()) return s;
  return DirectResult::kDone;
}

absl::StatusOr<DirectResult> DirectAllGather(Communicator& comm, const void* in, int64_t count,
                                             DType dtype, void* out) {
  const size_t bytes = count * DTypeSize(dtype);
  Session session(comm, "direct all_gather");
  absl::StatusOr<std::optional<std::vector<char*>>> buffers = session.Exchange(in, bytes);
  if (!buffers.ok()) return buffers.status();
  if (!buffers->has_value()) return DirectResult::kFellBack;
  for (int q = 0; q < comm.size(); ++q) {
    std::memcpy(static_cast<char*>(out) + q * bytes, (**buffers)[q], bytes);
  }
  if (absl::Status s = session.Finish(); !s.ok()) return s;
  return DirectResult::kDone;
}

}  // namespace meshrun
