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
#include "core/checkpoint/checkpoint_internal.h"
#include "core/sharding/named_sharding.h"
#include "nlohmann/json.hpp"

namespace meshrun::checkpoint {

// A JSON array of int64 integers.
std::vector<int64_t> Integers(const json& v) {
  if (!v.is_array())
    throw json::other_error::create(501, absl::StrCat("expected an array, got ", v.dump()),
                                    nullptr);
  std::vector<int64_t> out;
  for (const json& e : v) out.push_back(Integer<int64_t>(e));
  return out;
}

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

namespace fs = std::filesystem;

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
