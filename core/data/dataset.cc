#include "core/data/dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/data/idx_dataset.h"

namespace meshrun {
namespace {

namespace fs = std::filesystem;

// IDX: the split's two files, decompressed into memory.
class IdxDataset : public Dataset {
 public:
  static absl::StatusOr<std::unique_ptr<Dataset>> Open(const std::string& dir,
                                                       const std::string& split) {
    std::string prefix;
    if (split == "train") {
      prefix = "train";
    } else if (split == "test") {
      prefix = "t10k";
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("idx split '", split, "': expected train or test"));
    }
    auto ds = std::unique_ptr<IdxDataset>(new IdxDataset);
    absl::StatusOr<IdxArray> images = ReadSplitFile(dir, prefix + "-images-idx3-ubyte");
    if (!images.ok()) return images.status();
    absl::StatusOr<IdxArray> labels = ReadSplitFile(dir, prefix + "-labels-idx1-ubyte");
    if (!labels.ok()) return labels.status();
    if (images->dims.size() != 3 || labels->dims.size() != 1 ||
        images->dims[0] != labels->dims[0]) {
      return absl::DataLossError(absl::StrCat(
          "idx split ", split, " in ", dir, ": images ", DimsToString(images->dims), " and labels ",
          DimsToString(labels->dims), " disagree on the example count"));
    }
    ds->num_examples_ = images->dims[0];
    ds->fields_ = {{"image", v1::DTYPE_U8, {images->dims[1], images->dims[2]}},
                   {"label", v1::DTYPE_U8, {}}};
    ds->data_[0] = std::move(images->data);
    ds->data_[1] = std::move(labels->data);
    return std::unique_ptr<Dataset>(std::move(ds));
  }

  int64_t num_examples() const override { return num_examples_; }
  const std::vector<DatasetField>& fields() const override { return fields_; }
  void CopyElements(int field, int64_t index, int64_t begin, int64_t count,
                    void* dst) const override {
    const int64_t size = NumElements(fields_[field].example_dims);
    std::memcpy(dst, data_[field].data() + index * size + begin, static_cast<size_t>(count));
  }

 private:
  // `name`.gz, or `name` uncompressed when only that exists.
  static absl::StatusOr<IdxArray> ReadSplitFile(const std::string& dir, const std::string& name) {
    const std::string gz = absl::StrCat(dir, "/", name, ".gz");
    const std::string plain = absl::StrCat(dir, "/", name);
    std::error_code ec;
    if (!fs::exists(gz, ec) && fs::exists(plain, ec)) return ReadIdxFile(plain);
    return ReadIdxFile(gz);
  }

  int64_t num_examples_ = 0;
  std::vector<DatasetField> fields_;
  std::vector<uint8_t> data_[2];
};

// A memory-mapped file, unmapped on destruction.
class MappedFile {
 public:
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile() {
    if (base_ != nullptr) munmap(base_, static_cast<size_t>(size_));
  }
  static absl::StatusOr<std::unique_ptr<MappedFile>> Open(const std::string& path) {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      return absl::NotFoundError(
          absl::StrCat("dataset file ", path, " cannot be opened: ", std::strerror(errno)));
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      close(fd);
      return absl::DataLossError(absl::StrCat("dataset file ", path, " is not a regular file"));
    }
    auto f = std::unique_ptr<MappedFile>(new MappedFile);
    f->size_ = st.st_size;
    if (f->size_ > 0) {
      f->base_ = mmap(nullptr, static_cast<size_t>(f->size_), PROT_READ, MAP_SHARED, fd, 0);
      if (f->base_ == MAP_FAILED) {
        f->base_ = nullptr;
        close(fd);
        return absl::InternalError(absl::StrCat("mmap ", path, ": ", std::strerror(errno)));
      }
    }
    close(fd);
    return f;
  }
  const char* data() const { return static_cast<const char*>(base_); }
  int64_t size() const { return size_; }

 private:
  MappedFile() = default;
  void* base_ = nullptr;
  int64_t size_ = 0;
};

// A directory of <field>.npy files.
class NpyDataset : public Dataset {
 public:
  static absl::StatusOr<std::unique_ptr<Dataset>> Open(const std::string& dir) {
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) {
      return absl::NotFoundError(
          absl::StrCat("npy dataset directory ", dir, " does not exist or is not a directory"));
    }
    std::vector<std::string> paths;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      if (e.path().extension() == ".npy") paths.push_back(e.path().string());
    }
    std::sort(paths.begin(), paths.end());
    if (paths.empty()) {
      return absl::NotFoundError(absl::StrCat("npy dataset directory ", dir,
                                              " holds no .npy files (one per field expected)"));
    }
    auto ds = std::unique_ptr<NpyDataset>(new NpyDataset);
    for (const std::string& path : paths) {
      absl::StatusOr<std::unique_ptr<MappedFile>> file = MappedFile::Open(path);
      if (!file.ok()) return file.status();
      absl::StatusOr<NpyHeader> h = ParseNpyHeader(path, (*file)->data(), (*file)->size());
      if (!h.ok()) return h.status();
      if (h->dims.empty()) {
        return absl::DataLossError(
            absl::StrCat(path, ": a scalar array; a field needs a leading dim of examples"));
      }
      const std::string name = fs::path(path).stem().string();
      if (!ds->fields_.empty() && h->dims[0] != ds->num_examples_) {
        return absl::DataLossError(absl::StrCat(
            "npy dataset ", dir, ": field '", name, "' has ", h->dims[0], " examples but field '",
            ds->fields_[0].name, "' has ", ds->num_examples_, " (the leading dims must agree)"));
      }
      ds->num_examples_ = h->dims[0];
      ds->fields_.push_back({name, h->dtype, Dims(h->dims.begin() + 1, h->dims.end())});
      ds->data_.push_back((*file)->data() + h->data_offset);
      ds->files_.push_back(*std::move(file));
    }
    return std::unique_ptr<Dataset>(std::move(ds));
  }

  int64_t num_examples() const override { return num_examples_; }
  const std::vector<DatasetField>& fields() const override { return fields_; }
  void CopyElements(int field, int64_t index, int64_t begin, int64_t count,
                    void* dst) const override {
    const DatasetField& f = fields_[field];
    const int64_t esize = static_cast<int64_t>(DTypeSize(f.dtype));
    std::memcpy(dst, data_[field] + (index * NumElements(f.example_dims) + begin) * esize,
                static_cast<size_t>(count * esize));
  }

 private:
  int64_t num_examples_ = 0;
  std::vector<DatasetField> fields_;
  std::vector<const char*> data_;
  std::vector<std::unique_ptr<MappedFile>> files_;
};

absl::StatusOr<DType> NpyDType(const std::string& path, const std::string& descr) {
  if (descr == "<f4") return v1::DTYPE_F32;
  if (descr == "<i4") return v1::DTYPE_I32;
  if (descr == "<u4") return v1::DTYPE_U32;
  if (descr == "|u1" || descr == "<u1") return v1::DTYPE_U8;
  return absl::DataLossError(absl::StrCat(path, ": npy dtype '", descr,
                                          "' is not supported; expected <f4 (float32), <i4 "
                                          "(int32), <u4 (uint32) or |u1 (uint8)"));
}

// The value of `key` in the header dict: the text after "'key':" up to the next top-level comma
// or closing brace.
absl::StatusOr<std::string> HeaderValue(const std::string& path, absl::string_view dict,
                                        const std::string& key) {
  const std::string quoted = absl::StrCat("'", key, "'");
  size_t at = dict.find(quoted);
  if (at == absl::string_view::npos) {
    return absl::DataLossError(absl::StrCat(path, ": npy header has no '", key, "'"));
  }
  at = dict.find(':', at + quoted.size());
  if (at == absl::string_view::npos) {
    return absl::DataLossError(absl::StrCat(path, ": npy header's '", key, "' has no value"));
  }
  int depth = 0;
  size_t end = at + 1;
  for (; end < dict.size(); ++end) {
    const char c = dict[end];
    if (c == '(' || c == '[') {
      ++depth;
    } else if (c == ')' || c == ']') {
      --depth;
    } else if (depth == 0 && (c == ',' || c == '}')) {
      break;
    }
  }
  return std::string(absl::StripAsciiWhitespace(dict.substr(at + 1, end - at - 1)));
}

}  // namespace

absl::StatusOr<NpyHeader> ParseNpyHeader(const std::string& path, const char* bytes,
                                         int64_t file_size) {
  static constexpr char kMagic[] = "\x93NUMPY";
  if (file_size < 10 || std::memcmp(bytes, kMagic, 6) != 0) {
    return absl::DataLossError(absl::StrCat(path, ": not a .npy file (bad magic)"));
  }
  const int major = static_cast<unsigned char>(bytes[6]);
  int64_t header_len = 0, prefix = 0;
  if (major == 1) {
    header_len = static_cast<unsigned char>(bytes[8]) | (static_cast<unsigned char>(bytes[9]) << 8);
    prefix = 10;
  } else if (major == 2 || major == 3) {
    if (file_size < 12) return absl::DataLossError(absl::StrCat(path, ": .npy header cut short"));
    for (int i = 3; i >= 0; --i)
      header_len = (header_len << 8) | static_cast<unsigned char>(bytes[8 + i]);
    prefix = 12;
  } else {
    return absl::DataLossError(
        absl::StrCat(path, ": .npy format version ", major, " is not supported (1, 2 or 3)"));
  }
  if (prefix + header_len > file_size) {
    return absl::DataLossError(absl::StrCat(path, ": .npy header of ", header_len,
                                            " bytes runs past the end of the file (", file_size,
                                            " bytes)"));
  }
  const absl::string_view dict(bytes + prefix, static_cast<size_t>(header_len));
  absl::StatusOr<std::string> descr = HeaderValue(path, dict, "descr");
  if (!descr.ok()) return descr.status();
  absl::StatusOr<std::string> fortran = HeaderValue(path, dict, "fortran_order");
  if (!fortran.ok()) return fortran.status();
  absl::StatusOr<std::string> shape = HeaderValue(path, dict, "shape");
  if (!shape.ok()) return shape.status();
  NpyHeader h;
  absl::StatusOr<DType> dtype =
      NpyDType(path, std::string(absl::StripAsciiWhitespace(
                         absl::StripSuffix(absl::StripPrefix(*descr, "'"), "'"))));
  if (!dtype.ok()) return dtype.status();
  h.dtype = *dtype;
  if (*fortran != "False") {
    return absl::DataLossError(
        absl::StrCat(path, ": Fortran-ordered array; save it in C order (np.ascontiguousarray)"));
  }
  absl::string_view dims_text = absl::StripAsciiWhitespace(*shape);
  if (!absl::ConsumePrefix(&dims_text, "(") || !absl::ConsumeSuffix(&dims_text, ")")) {
    return absl::DataLossError(absl::StrCat(path, ": npy shape '", *shape, "' is not a tuple"));
  }
  for (absl::string_view d : absl::StrSplit(dims_text, ',', absl::SkipWhitespace())) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(d), &v) || v < 0) {
      return absl::DataLossError(absl::StrCat(path, ": npy shape '", *shape, "' has a bad dim"));
    }
    h.dims.push_back(v);
  }
  absl::StatusOr<int64_t> data_bytes = CheckedByteSize(h.dtype, h.dims);
  if (!data_bytes.ok()) {
    return absl::DataLossError(absl::StrCat(path, ": ", data_bytes.status().message()));
  }
  h.data_offset = prefix + header_len;
  if (h.data_offset + *data_bytes > file_size) {
    return absl::DataLossError(absl::StrCat(
        path, ": truncated: the header declares ", DTypeName(h.dtype), DimsToString(h.dims), " (",
        *data_bytes, " bytes of data) but the file holds ", file_size - h.data_offset));
  }
  return h;
}

absl::StatusOr<int> Dataset::FieldIndex(const std::string& name) const {
  std::vector<std::string> names;
  for (size_t i = 0; i < fields().size(); ++i) {
    if (fields()[i].name == name) return static_cast<int>(i);
    names.push_back(fields()[i].name);
  }
  return absl::NotFoundError(absl::StrCat("dataset has no field '", name, "'; its fields are ",
                                          absl::StrJoin(names, ", ")));
}

absl::StatusOr<std::unique_ptr<Dataset>> Dataset::Open(const std::string& format,
                                                       const std::string& path,
                                                       const std::string& split) {
  if (format == "idx") return IdxDataset::Open(path, split);
  if (format == "npy") return NpyDataset::Open(path);
  return absl::InvalidArgumentError(
      absl::StrCat("dataset format '", format, "': expected idx or npy"));
}

}  // namespace meshrun
