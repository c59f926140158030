#include "core/checkpoint/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/sharding/named_sharding.h"
#include "nlohmann/json.hpp"

namespace meshrun::checkpoint {
namespace {

using json = nlohmann::json;

// A JSON integer within T's range. nlohmann's get<int>() converts any number with a plain cast,
// undefined for a float past the type's range: a file must not decide that. Throws
// json::other_error naming the value.
template <typename T>
T Integer(const json& v) {
  bool ok = v.is_number_integer();
  if (ok && v.is_number_unsigned()) {
    ok = v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<T>::max());
  } else if (ok) {
    ok = v.get<int64_t>() >= static_cast<int64_t>(std::numeric_limits<T>::min()) &&
         (std::numeric_limits<T>::max() >
              static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
          v.get<int64_t>() <= static_cast<int64_t>(std::numeric_limits<T>::max()));
  }
  if (!ok)
    throw json::other_error::create(
        501, absl::StrCat("expected an integer in range, got ", v.dump()), nullptr);
  return v.is_number_unsigned() ? static_cast<T>(v.get<uint64_t>())
                                : static_cast<T>(v.get<int64_t>());
}

// A JSON array of int64 integers.
std::vector<int64_t> Integers(const json& v) {
  if (!v.is_array())
    throw json::other_error::create(501, absl::StrCat("expected an array, got ", v.dump()),
                                    nullptr);
  std::vector<int64_t> out;
  for (const json& e : v) out.push_back(Integer<int64_t>(e));
  return out;
}
namespace fs = std::filesystem;

std::string SafetensorsDType(DType d) {
  switch (d) {
    case v1::DTYPE_F32:
      return "F32";
    case v1::DTYPE_BF16:
      return "BF16";
    case v1::DTYPE_I32:
      return "I32";
    case v1::DTYPE_U32:
      return "U32";
    case v1::DTYPE_U8:
      return "U8";
    default:
      return "";
  }
}

absl::StatusOr<DType> FromSafetensorsDType(const std::string& s) {
  if (s == "F32") return v1::DTYPE_F32;
  if (s == "BF16") return v1::DTYPE_BF16;
  if (s == "I32") return v1::DTYPE_I32;
  if (s == "U32") return v1::DTYPE_U32;
  if (s == "U8") return v1::DTYPE_U8;
  return absl::DataLossError(absl::StrCat("dtype '", s, "': expected F32, BF16, I32, U32 or U8"));
}

absl::Status ErrnoStatus(const std::string& what, const std::string& path, int err) {
  const std::string msg = absl::StrCat(what, " ", path, ": ", std::strerror(err));
  if (err == ENOSPC || err == EDQUOT) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

absl::Status WriteAll(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus("write", path, errno);
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

}  // namespace

const ArrayEntry* Manifest::Find(const std::string& name) const {
  for (const ArrayEntry& a : arrays)
    if (a.name == name) return &a;
  return nullptr;
}

std::string ToJson(const Manifest& m) {
  json arrays = json::array();
  for (const ArrayEntry& a : m.arrays) {
    json spec = json::array();
    for (const auto& e : a.spec.entries()) spec.push_back(e);
    json blocks = json::array();
    for (const Block& b : a.blocks) {
      blocks.push_back({{"offsets", b.offsets},
                        {"shape", b.shape},
                        {"file", b.file},
                        {"tensor", b.tensor},
                        {"data_offset", b.data_offset},
                        {"nbytes", b.nbytes},
                        {"crc32", b.crc32}});
    }
    arrays.push_back({{"name", a.name},
                      {"dtype", SafetensorsDType(a.dtype)},
                      {"shape", a.shape},
                      {"spec", spec},
                      {"blocks", blocks}});
  }
  json j = {{"format", "meshrun-checkpoint"},
            {"format_version", m.format_version},
            {"step", m.step},
            {"mesh", m.mesh},
            {"arrays", arrays}};
  return j.dump(1);
}

absl::StatusOr<Manifest> ParseManifest(const std::string& text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    return absl::DataLossError("manifest.json is not a JSON object");
  Manifest m;
  try {
    m.format_version = Integer<int>(j.at("format_version"));
    if (m.format_version != kFormatVersion) {
      return absl::FailedPreconditionError(
          absl::StrCat("manifest format_version ", m.format_version,
                       " is not supported (this meshrun reads version ", kFormatVersion, ")"));
    }
    m.step = Integer<int64_t>(j.at("step"));
    m.mesh = j.at("mesh").get<std::string>();
    for (const json& ja : j.at("arrays")) {
      ArrayEntry a;
      a.name = ja.at("name").get<std::string>();
      absl::StatusOr<DType> dtype = FromSafetensorsDType(ja.at("dtype").get<std::string>());
      if (!dtype.ok())
        return absl::DataLossError(absl::StrCat("array ", a.name, ": ", dtype.status().message()));
      a.dtype = *dtype;
      a.shape = Integers(ja.at("shape"));
      std::vector<PartitionSpec::Entry> entries;
      for (const json& e : ja.at("spec")) entries.push_back(e.get<std::vector<std::string>>());
      a.spec = PartitionSpec(entries);
      for (const json& jb : ja.at("blocks")) {
        Block b;
        b.offsets = Integers(jb.at("offsets"));
        b.shape = Integers(jb.at("shape"));
        b.file = jb.at("file").get<std::string>();
        b.tensor = jb.at("tensor").get<std::string>();
        b.data_offset = Integer<int64_t>(jb.at("data_offset"));
        b.nbytes = Integer<int64_t>(jb.at("nbytes"));
        b.crc32 = Integer<uint32_t>(jb.at("crc32"));
        const absl::StatusOr<int64_t> block_bytes = CheckedByteSize(a.dtype, b.shape);
        if (b.offsets.size() != a.shape.size() || b.shape.size() != a.shape.size() ||
            !CheckedByteSize(a.dtype, a.shape).ok() || !block_bytes.ok() ||
            b.nbytes != *block_bytes || b.file.find('/') != std::string::npos) {
          return absl::DataLossError(absl::StrCat("array ", a.name, ": block ", b.tensor, " in ",
                                                  b.file,
                                                  " does not fit the array's shape and dtype"));
        }
        a.blocks.push_back(std::move(b));
      }
      m.arrays.push_back(std::move(a));
    }
  } catch (const json::exception& e) {
    return absl::DataLossError(absl::StrCat("manifest.json: ", e.what()));
  }
  return m;
}

absl::StatusOr<Manifest> ReadManifest(const std::string& dir) {
  const std::string path = (fs::path(dir) / "manifest.json").string();
  std::ifstream in(path);
  if (!in)
    return absl::NotFoundError(
        absl::StrCat("no committed checkpoint at ", dir, " (", path, " is missing)"));
  std::stringstream ss;
  ss << in.rdbuf();
  absl::StatusOr<Manifest> m = ParseManifest(ss.str());
  if (!m.ok())
    return absl::Status(m.status().code(), absl::StrCat(path, ": ", m.status().message()));
  return m;
}

std::string StepDirName(int64_t step) { return absl::StrFormat("step_%08d", step); }

std::vector<std::pair<int64_t, std::string>> ListCheckpoints(const std::string& root) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    int64_t step;
    if (name.rfind("step_", 0) != 0 || !absl::SimpleAtoi(name.substr(5), &step)) continue;
    if (!fs::exists(entry.path() / "manifest.json", ec)) continue;
    out.emplace_back(step, entry.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

absl::StatusOr<std::string> LatestCheckpoint(const std::string& root) {
  auto all = ListCheckpoints(root);
  if (all.empty()) return absl::NotFoundError(absl::StrCat("no committed checkpoint under ", root));
  return all.back().second;
}

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

absl::StatusOr<std::vector<int64_t>> WriteSafetensors(
    const std::string& path, const std::vector<std::pair<std::string, const Tensor*>>& tensors,
    const std::vector<std::pair<std::string, std::string>>& metadata) {
  json header = json::object();
  json meta = json::object();
  for (const auto& [k, v] : metadata) meta[k] = v;
  if (!metadata.empty()) header["__metadata__"] = meta;
  int64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    header[name] = {{"dtype", SafetensorsDType(t->dtype())},
                    {"shape", t->dims()},
                    {"data_offsets", {offset, offset + static_cast<int64_t>(t->size_bytes())}}};
    offset += static_cast<int64_t>(t->size_bytes());
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8,
           ' ');  // data starts 8-byte aligned, as the reference writer does
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus("open", path, errno);
  uint8_t size_le[8];
  for (int i = 0; i < 8; ++i)
    size_le[i] = static_cast<uint8_t>(static_cast<uint64_t>(h.size()) >> (8 * i));
  absl::Status s = WriteAll(fd, size_le, 8, path);
  if (s.ok()) s = WriteAll(fd, h.data(), h.size(), path);
  std::vector<int64_t> offsets;
  const int64_t base = 8 + static_cast<int64_t>(h.size());
  int64_t at = base;
  for (const auto& [name, t] : tensors) {
    if (!s.ok()) break;
    offsets.push_back(at);
    s = WriteAll(fd, t->raw(), t->size_bytes(), path);
    at += static_cast<int64_t>(t->size_bytes());
  }
  if (s.ok() && ::fsync(fd) != 0) s = ErrnoStatus("fsync", path, errno);
  if (::close(fd) != 0 && s.ok()) s = ErrnoStatus("close", path, errno);
  if (!s.ok()) return s;
  return offsets;
}

namespace {

// A tensor of a safetensors file: where its bytes lie in the file.
struct SafetensorsEntry {
  std::string name;
  DType dtype;
  Dims shape;
  int64_t data_offset;  // absolute
  int64_t nbytes;
};

// Parses the header of `bytes` (a whole file); entries in file order.
absl::StatusOr<std::vector<SafetensorsEntry>> ParseSafetensors(const std::string& path,
                                                               const std::string& bytes) {
  if (bytes.size() < 8)
    return absl::DataLossError(absl::StrCat(path, " is not a safetensors file (too short)"));
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[i]);
  if (n > bytes.size() - 8)
    return absl::DataLossError(absl::StrCat(path, ": header size ", n, " exceeds the file"));
  json header = json::parse(bytes.substr(8, n), nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object())
    return absl::DataLossError(absl::StrCat(path, ": bad JSON header"));
  std::vector<std::pair<int64_t, std::string>> order;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    try {
      order.emplace_back(Integer<int64_t>(it.value().at("data_offsets").at(0)), it.key());
    } catch (const json::exception& e) {
      return absl::DataLossError(absl::StrCat(path, ": tensor ", it.key(), ": ", e.what()));
    }
  }
  std::sort(order.begin(), order.end());
  std::vector<SafetensorsEntry> out;
  const int64_t base = static_cast<int64_t>(8 + n);
  for (const auto& [begin, name] : order) {
    const json& t = header[name];
    absl::StatusOr<DType> dtype;
    Dims shape;
    int64_t end = 0;
    try {
      dtype = FromSafetensorsDType(t.at("dtype").get<std::string>());
      shape = Integers(t.at("shape"));
      end = Integer<int64_t>(t.at("data_offsets").at(1));
    } catch (const json::exception& e) {
      return absl::DataLossError(absl::StrCat(path, ": tensor ", name, ": ", e.what()));
    }
    if (!dtype.ok())
      return absl::DataLossError(
          absl::StrCat(path, ": tensor ", name, ": ", dtype.status().message()));
    const absl::StatusOr<int64_t> nbytes = CheckedByteSize(*dtype, shape);
    if (!nbytes.ok()) {
      return absl::DataLossError(
          absl::StrCat(path, ": tensor ", name, ": ", nbytes.status().message()));
    }
    if (begin < 0 || end < begin || end - begin != *nbytes ||
        end > static_cast<int64_t>(bytes.size()) - base) {
      return absl::DataLossError(absl::StrCat(path, ": tensor ", name, " has data_offsets [", begin,
                                              ", ", end,
                                              ") that do not fit its shape or the file"));
    }
    out.push_back({name, *dtype, shape, base + begin, *nbytes});
  }
  return out;
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

absl::StatusOr<std::vector<std::pair<std::string, Tensor>>> ReadSafetensors(
    const std::string& path) {
  absl::StatusOr<std::string> bytes = ReadWholeFile(path);
  if (!bytes.ok()) return bytes.status();
  absl::StatusOr<std::vector<SafetensorsEntry>> entries = ParseSafetensors(path, *bytes);
  if (!entries.ok()) return entries.status();
  std::vector<std::pair<std::string, Tensor>> out;
  for (const SafetensorsEntry& e : *entries) {
    Tensor tensor(e.dtype, e.shape);
    std::memcpy(tensor.raw(), bytes->data() + e.data_offset, e.nbytes);
    out.emplace_back(e.name, std::move(tensor));
  }
  return out;
}

absl::StatusOr<Manifest> ReadRestoreSource(const std::string& path) {
  std::error_code ec;
  return fs::is_regular_file(path, ec) ? SafetensorsManifest(path) : ReadManifest(path);
}

absl::StatusOr<Manifest> SafetensorsManifest(const std::string& path) {
  const std::string abs = std::filesystem::absolute(path).string();
  absl::StatusOr<std::string> bytes = ReadWholeFile(abs);
  if (!bytes.ok()) return bytes.status();
  absl::StatusOr<std::vector<SafetensorsEntry>> entries = ParseSafetensors(abs, *bytes);
  if (!entries.ok()) return entries.status();
  Manifest m;
  for (const SafetensorsEntry& e : *entries) {
    ArrayEntry a;
    a.name = e.name;
    a.dtype = e.dtype;
    a.shape = e.shape;
    a.blocks.push_back({std::vector<int64_t>(e.shape.size(), 0), e.shape, abs, e.name,
                        e.data_offset, e.nbytes, Crc32(bytes->data() + e.data_offset, e.nbytes)});
    m.arrays.push_back(std::move(a));
  }
  return m;
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

absl::Status WriteFileSynced(const std::string& path, const std::string& data) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus("open", path, errno);
  absl::Status s = WriteAll(fd, data.data(), data.size(), path);
  if (s.ok() && ::fsync(fd) != 0) s = ErrnoStatus("fsync", path, errno);
  if (::close(fd) != 0 && s.ok()) s = ErrnoStatus("close", path, errno);
  return s;
}

absl::Status SyncDir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus("open", dir, errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  return rc == 0 ? absl::OkStatus() : ErrnoStatus("fsync", dir, err);
}

uint32_t Crc32(const void* data, int64_t nbytes) {
  uLong crc = crc32(0L, Z_NULL, 0);
  const Bytef* p = static_cast<const Bytef*>(data);
  while (nbytes > 0) {
    const uInt n = static_cast<uInt>(std::min<int64_t>(nbytes, 1 << 30));
    crc = crc32(crc, p, n);
    p += n;
    nbytes -= n;
  }
  return static_cast<uint32_t>(crc);
}

}  // namespace meshrun::checkpoint
