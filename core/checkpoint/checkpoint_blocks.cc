// Checkpoint blocks: which blocks of an array a region meets, copying their overlap, and
// reading and verifying blocks (sizes and CRC-32s) from their files.
#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/checkpoint/checkpoint.h"
#include "core/sharding/named_sharding.h"

namespace meshrun::checkpoint {

namespace fs = std::filesystem;

std::vector<const Block*> BlocksIntersecting(const ArrayEntry& a,
                                             const std::vector<int64_t>& offsets,
                                             const Dims& shape) {
  std::vector<const Block*> out;
  for (const Block& b : a.blocks) {
    bool overlaps = true;
    for (size_t d = 0; d < shape.size() && overlaps; ++d) {
      overlaps = b.offsets[d] < offsets[d] + shape[d] && offsets[d] < b.offsets[d] + b.shape[d];
    }
    if (overlaps) out.push_back(&b);
  }
  return out;
}

int64_t CopyIntersection(const Tensor& src, const std::vector<int64_t>& src_offsets, Tensor& dst,
                         const std::vector<int64_t>& dst_offsets) {
  const size_t rank = dst.dims().size();
  const int64_t esize = DTypeSize(dst.dtype());
  if (rank == 0) {
    std::memcpy(dst.raw(), src.raw(), esize);
    return 1;
  }
  std::vector<int64_t> lo(rank), hi(rank);
  for (size_t d = 0; d < rank; ++d) {
    lo[d] = std::max(src_offsets[d], dst_offsets[d]);
    hi[d] = std::min(src_offsets[d] + src.dims()[d], dst_offsets[d] + dst.dims()[d]);
    if (lo[d] >= hi[d]) return 0;
  }
  int64_t copied = 1;
  for (size_t d = 0; d < rank; ++d) copied *= hi[d] - lo[d];
  // Contiguous runs along the last dim, for every index of the leading dims.
  const int64_t run = (hi[rank - 1] - lo[rank - 1]) * esize;
  std::vector<int64_t> idx(lo.begin(), lo.end() - 1);
  const auto flat = [&](const Dims& dims, const std::vector<int64_t>& origin, int64_t last) {
    int64_t f = 0;
    for (size_t d = 0; d + 1 < rank; ++d) f = f * dims[d] + (idx[d] - origin[d]);
    return f * dims[rank - 1] + (last - origin[rank - 1]);
  };
  while (true) {
    std::memcpy(
        static_cast<char*>(dst.raw()) + flat(dst.dims(), dst_offsets, lo[rank - 1]) * esize,
        static_cast<const char*>(src.raw()) + flat(src.dims(), src_offsets, lo[rank - 1]) * esize,
        run);
    size_t d = rank - 1;
    while (d > 0) {
      --d;
      if (++idx[d] < hi[d]) break;
      idx[d] = lo[d];
      if (d == 0) return copied;
    }
    if (rank == 1) return copied;
  }
}

namespace {

// Reads `nbytes` at byte `offset` of `path` into `dst` when it is set, else in pieces through a
// small buffer; returns their CRC-32. Errors, naming the array and file: NotFound (cannot open),
// DataLoss (the file ends before the range does), Internal (a read error).
absl::StatusOr<uint32_t> ReadRangeCrc(const std::string& path, const std::string& array,
                                      int64_t offset, int64_t nbytes, char* dst) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(
        absl::StrCat("array ", array, ": cannot open ", path, ": ", std::strerror(errno)));
  }
  std::vector<char> piece(dst == nullptr ? std::min<int64_t>(nbytes, int64_t{4} << 20) : 0);
  uLong crc = crc32(0L, Z_NULL, 0);
  int64_t left = nbytes;
  absl::Status s;
  while (left > 0 && s.ok()) {
    char* p = dst != nullptr ? dst + (nbytes - left) : piece.data();
    const size_t want = dst != nullptr ? static_cast<size_t>(left)
                                       : static_cast<size_t>(std::min<int64_t>(left, piece.size()));
    const ssize_t r = ::pread(fd, p, want, offset);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      s = absl::InternalError(
          absl::StrCat("array ", array, ": read ", path, ": ", std::strerror(errno)));
    } else if (r == 0) {
      s = absl::DataLossError(absl::StrCat("array ", array, ": ", path, " is truncated: ", left,
                                           " bytes missing at offset ", offset));
    } else {
      crc = crc32_z(crc, reinterpret_cast<const Bytef*>(p), static_cast<size_t>(r));
      offset += r;
      left -= r;
    }
  }
  ::close(fd);
  if (!s.ok()) return s;
  return static_cast<uint32_t>(crc);
}

absl::Status CheckBlockSize(const std::string& path, const std::string& array, DType dtype,
                            const Dims& shape, int64_t nbytes) {
  absl::StatusOr<int64_t> want = CheckedByteSize(dtype, shape);
  if (!want.ok()) {
    return absl::DataLossError(
        absl::StrCat("array ", array, ": block in ", path, ": ", want.status().message()));
  }
  if (*want != nbytes) {
    return absl::DataLossError(absl::StrCat("array ", array, ": block in ", path, " has ", nbytes,
                                            " bytes; its shape needs ", *want));
  }
  return absl::OkStatus();
}

absl::Status ChecksumMismatch(const std::string& path, const std::string& array,
                              int64_t data_offset) {
  return absl::DataLossError(absl::StrCat("array ", array, ": the block at byte ", data_offset,
                                          " of ", path,
                                          " does not match its checksum (corrupted)"));
}

}  // namespace

absl::StatusOr<Tensor> ReadBlockAt(const std::string& path, const std::string& array, DType dtype,
                                   const Dims& shape, int64_t data_offset, int64_t nbytes,
                                   uint32_t crc32) {
  if (absl::Status s = CheckBlockSize(path, array, dtype, shape, nbytes); !s.ok()) return s;
  // The range is checked against the file before memory is taken for it: the offsets may come
  // from a request (LoadShards) as well as from a manifest.
  std::error_code ec;
  const uintmax_t file_bytes = fs::file_size(path, ec);
  if (ec) {
    return absl::NotFoundError(
        absl::StrCat("array ", array, ": cannot open ", path, ": ", ec.message()));
  }
  if (data_offset < 0 || static_cast<uintmax_t>(data_offset) > file_bytes ||
      static_cast<uintmax_t>(nbytes) > file_bytes - static_cast<uintmax_t>(data_offset)) {
    return absl::DataLossError(absl::StrCat("array ", array, ": the block's ", nbytes,
                                            " bytes at offset ", data_offset, " are not in ", path,
                                            " (", file_bytes, " bytes): truncated or misplaced"));
  }
  Tensor t = Tensor::Uninitialized(dtype, shape);
  absl::StatusOr<uint32_t> crc =
      ReadRangeCrc(path, array, data_offset, nbytes, static_cast<char*>(t.raw()));
  if (!crc.ok()) return crc.status();
  if (*crc != crc32) return ChecksumMismatch(path, array, data_offset);
  return t;
}

std::vector<std::string> VerifyBlocks(const std::string& dir, const Manifest& m) {
  std::vector<std::string> errors;
  for (const ArrayEntry& a : m.arrays) {
    for (const Block& b : a.blocks) {
      const std::string path = (fs::path(dir) / b.file).string();
      absl::Status s = CheckBlockSize(path, a.name, a.dtype, b.shape, b.nbytes);
      if (s.ok()) {
        absl::StatusOr<uint32_t> crc = ReadRangeCrc(path, a.name, b.data_offset, b.nbytes, nullptr);
        s = !crc.ok()         ? crc.status()
            : *crc != b.crc32 ? ChecksumMismatch(path, a.name, b.data_offset)
                              : s;
      }
      if (!s.ok()) errors.push_back(std::string(s.message()));
    }
  }
  return errors;
}

absl::StatusOr<Tensor> ReadBlock(const std::string& dir, const ArrayEntry& array,
                                 const Block& block) {
  return ReadBlockAt((fs::path(dir) / block.file).string(), array.name, array.dtype, block.shape,
                     block.data_offset, block.nbytes, block.crc32);
}

absl::StatusOr<Tensor> ReadArray(const std::string& dir, const ArrayEntry& array) {
  Tensor out(array.dtype, array.shape);
  const std::vector<int64_t> origin(array.shape.size(), 0);
  for (const Block& b : array.blocks) {
    absl::StatusOr<Tensor> t = ReadBlock(dir, array, b);
    if (!t.ok()) return t.status();
    CopyIntersection(*t, b.offsets, out, origin);
  }
  return out;
}

RestoreReport ValidateRestore(const Manifest& m, const std::vector<WantedArray>& wanted,
                              const Mesh& mesh) {
  RestoreReport r;
  r.bytes_per_worker.assign(mesh.size(), 0);
  std::vector<std::string> seen;
  for (const WantedArray& w : wanted) {
    const ArrayEntry* a = m.Find(w.name);
    if (a == nullptr) {
      r.errors.push_back(absl::StrCat("missing array ", w.name));
      continue;
    }
    seen.push_back(w.name);
    if (a->shape != w.shape || a->dtype != w.dtype) {
      r.errors.push_back(absl::StrCat("array ", w.name, ": saved as ", DTypeName(a->dtype), " (",
                                      absl::StrJoin(a->shape, ", "), "), wanted ",
                                      DTypeName(w.dtype), " (", absl::StrJoin(w.shape, ", "), ")"));
      continue;
    }
    const NamedSharding sharding(mesh, w.spec);
    if (absl::Status s = sharding.Validate(a->shape); !s.ok()) {
      r.errors.push_back(absl::StrCat("array ", w.name, ": cannot be laid out as ",
                                      w.spec.ToString(), ": ", s.message()));
      continue;
    }
    for (int rank = 0; rank < mesh.size(); ++rank) {
      for (const Block* b : BlocksIntersecting(*a, sharding.ShardOffsets(a->shape, rank),
                                               sharding.ShardDims(a->shape))) {
        r.bytes_per_worker[rank] += b->nbytes;
      }
    }
  }
  for (const ArrayEntry& a : m.arrays) {
    if (std::find(seen.begin(), seen.end(), a.name) == seen.end() &&
        std::none_of(wanted.begin(), wanted.end(),
                     [&](const WantedArray& w) { return w.name == a.name; })) {
      r.extra.push_back(a.name);
    }
  }
  return r;
}

}  // namespace meshrun::checkpoint
