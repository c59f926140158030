#include "core/collectives/permute.h"

#include <cstring>

#include "absl/strings/str_join.h"
#include "core/collectives/ring_util.h"

namespace meshrun {
namespace {

std::string PermToString(const std::vector<std::pair<int, int>>& perm) {
  return absl::StrCat("[", absl::StrJoin(perm, ", ", [](std::string* out, const std::pair<int, int>& p) {
                        absl::StrAppend(out, "(", p.first, ", ", p.second, ")");
                      }), "]");
}

// Sends `bytes` to `peer` in chunks tagged (base, 0, i).
absl::Status SendChunked(Transport* t, int peer, uint64_t base, const char* data, int64_t bytes, int64_t chunk,
                         absl::Time deadline) {
  for (int64_t off = 0, i = 0; off < bytes; off += chunk, ++i) {
    const int64_t len = std::min(chunk, bytes - off);
    if (absl::Status s = t->Send(peer, ring::Tag(base, 0, i), absl::string_view(data + off, len), deadline); !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

absl::Status RecvChunked(Transport* t, int peer, uint64_t base, char* data, int64_t bytes, int64_t chunk,
                         absl::Time deadline) {
  for (int64_t off = 0, i = 0; off < bytes; off += chunk, ++i) {
    const int64_t len = std::min(chunk, bytes - off);
    char* dst = data + off;
    if (absl::Status s = t->RecvInto(peer, ring::Tag(base, 0, i), len, deadline,
                                     [dst](size_t offset, const char* piece, size_t n) {
                                       std::memcpy(dst + offset, piece, n);
                                     });
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidatePermutation(const std::vector<std::pair<int, int>>& perm, int size) {
  std::vector<bool> src_seen(size, false), dst_seen(size, false);
  for (const auto& [src, dst] : perm) {
    if (src < 0 || src >= size || dst < 0 || dst >= size) {
      return absl::InvalidArgumentError(absl::StrCat("perm ", PermToString(perm), " has pair (", src, ", ", dst,
                                                     ") outside the axis of size ", size));
    }
    if (src_seen[src]) {
      return absl::InvalidArgumentError(
          absl::StrCat("perm ", PermToString(perm), " is not a permutation: source ", src, " appears twice"));
    }
    if (dst_seen[dst]) {
      return absl::InvalidArgumentError(
          absl::StrCat("perm ", PermToString(perm), " is not a permutation: destination ", dst, " appears twice"));
    }
    src_seen[src] = dst_seen[dst] = true;
  }
  return absl::OkStatus();
}

absl::Status Permute(Communicator& comm, const void* in, int64_t count, DType dtype,
                     const std::vector<std::pair<int, int>>& perm, void* out) {
  const int n = comm.size();
  if (absl::Status s = ValidatePermutation(perm, n); !s.ok()) return s;
  const int p = comm.index();
  const int64_t bytes = count * static_cast<int64_t>(DTypeSize(dtype));
  const int64_t chunk = std::max<size_t>(1, comm.options().chunk_bytes);
  const uint64_t base = comm.NextTagBase();
  const absl::Time deadline = absl::Now() + comm.options().timeout;
  Transport* t = comm.transport();
  int source = -1;
  for (const auto& [src, dst] : perm) {
    if (dst == p) source = src;
  }
  for (const auto& [src, dst] : perm) {
    if (src != p || dst == p || bytes == 0) continue;
    if (absl::Status s = SendChunked(t, comm.group()[dst], base, static_cast<const char*>(in), bytes, chunk, deadline);
        !s.ok()) {
      return ring::Annotate(s, "ppermute", n);
    }
  }
  if (bytes == 0) return absl::OkStatus();  // buffers may be null
  if (source < 0) {
    std::memset(out, 0, bytes);
  } else if (source == p) {
    std::memcpy(out, in, bytes);
  } else {
    if (absl::Status s = RecvChunked(t, comm.group()[source], base, static_cast<char*>(out), bytes, chunk, deadline);
        !s.ok()) {
      return ring::Annotate(s, "ppermute", n);
    }
  }
  return absl::OkStatus();
}

absl::Status AllToAll(Communicator& comm, const void* in, int64_t count, DType dtype, void* out) {
  const int n = comm.size();
  const int p = comm.index();
  const int64_t block = count * static_cast<int64_t>(DTypeSize(dtype));
  const int64_t chunk = std::max<size_t>(1, comm.options().chunk_bytes);
  const uint64_t base = comm.NextTagBase();
  const absl::Time deadline = absl::Now() + comm.options().timeout;
  Transport* t = comm.transport();
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  if (block > 0) std::memcpy(dst + p * block, src + p * block, block);
  if (n == 1 || block == 0) return absl::OkStatus();
  for (int k = 1; k < n; ++k) {  // staggered, so ranks do not all send to position 0 first
    const int j = ring::Mod(p + k, n);
    if (absl::Status s = SendChunked(t, comm.group()[j], base, src + j * block, block, chunk, deadline); !s.ok()) {
      return ring::Annotate(s, "all_to_all", n);
    }
  }
  for (int k = 1; k < n; ++k) {
    const int i = ring::Mod(p - k, n);
    if (absl::Status s = RecvChunked(t, comm.group()[i], base, dst + i * block, block, chunk, deadline); !s.ok()) {
      return ring::Annotate(s, "all_to_all", n);
    }
  }
  return absl::OkStatus();
}

}  // namespace meshrun
