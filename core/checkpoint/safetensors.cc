// safetensors files (huggingface/safetensors's format: an 8-byte little-endian header size, a
// JSON header of name -> dtype, shape and data_offsets, then the tensors' bytes): writing,
// reading, and a file seen as a one-block-per-array Manifest to restore from.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "core/checkpoint/checkpoint.h"
#include "core/checkpoint/checkpoint_internal.h"

namespace meshrun::checkpoint {

namespace fs = std::filesystem;

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

}  // namespace meshrun::checkpoint
