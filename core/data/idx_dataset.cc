#include "core/data/idx_dataset.h"

#include <zlib.h>

#include <algorithm>
#include <memory>

#include "absl/strings/str_cat.h"
#include "core/tensor.h"

namespace meshrun {
namespace {

struct GzCloser {
  void operator()(gzFile_s* f) const { gzclose(f); }
};

absl::Status ReadExactly(gzFile f, void* dst, size_t n, const std::string& path) {
  auto* out = static_cast<char*>(dst);
  while (n > 0) {
    unsigned want = static_cast<unsigned>(std::min<size_t>(n, 1u << 30));
    int got = gzread(f, out, want);
    if (got <= 0) {
      int err = 0;
      const char* msg = gzerror(f, &err);
      return absl::DataLossError(absl::StrCat(path, ": file ends early (", n, " bytes missing",
                                              err != Z_OK ? absl::StrCat(", ", msg) : "", ")"));
    }
    out += got;
    n -= got;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<IdxArray> ReadIdxFile(const std::string& path) {
  std::unique_ptr<gzFile_s, GzCloser> f(gzopen(path.c_str(), "rb"));
  if (!f) return absl::NotFoundError(absl::StrCat("dataset file ", path, " cannot be opened"));
  uint8_t magic[4];
  if (absl::Status s = ReadExactly(f.get(), magic, 4, path); !s.ok()) return s;
  if (magic[0] != 0 || magic[1] != 0) {
    return absl::DataLossError(absl::StrCat(path, ": not an IDX file (bad magic)"));
  }
  if (magic[2] != 0x08) {
    return absl::DataLossError(absl::StrCat(path, ": IDX element type 0x", absl::Hex(magic[2]),
                                            " unsupported; expected 0x08 (u8)"));
  }
  IdxArray out;
  for (int i = 0; i < magic[3]; ++i) {
    uint8_t be[4];
    if (absl::Status s = ReadExactly(f.get(), be, 4, path); !s.ok()) return s;
    out.dims.push_back((int64_t{be[0]} << 24) | (be[1] << 16) | (be[2] << 8) | be[3]);
  }
  // Checked as u32 elements (IDX here is u8, so the bytes are a quarter of that).
  absl::StatusOr<int64_t> total = CheckedByteSize(v1::DTYPE_U32, out.dims);
  if (!total.ok()) {
    return absl::DataLossError(absl::StrCat(path, ": IDX header declares dims ",
                                            DimsToString(out.dims), ": ",
                                            total.status().message()));
  }
  // The header's size is only a claim: the bytes are read in pieces, so a header that declares
  // more than the file holds fails with "ends early" rather than allocating what it declares.
  const size_t bytes = static_cast<size_t>(*total / 4);
  constexpr size_t kPiece = size_t{64} << 20;
  for (size_t done = 0; done < bytes;) {
    const size_t n = std::min(kPiece, bytes - done);
    out.data.resize(done + n);
    if (absl::Status s = ReadExactly(f.get(), out.data.data() + done, n, path); !s.ok()) return s;
    done += n;
  }
  return out;
}

}  // namespace meshrun
