// Reading IDX files (the MNIST / Fashion-MNIST format), gzip-compressed, with zlib.
#ifndef MESHRUN_CORE_DATA_IDX_DATASET_H_
#define MESHRUN_CORE_DATA_IDX_DATASET_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace meshrun {

// An IDX array of unsigned bytes: dims from the header, elements row-major.
struct IdxArray {
  std::vector<int64_t> dims;
  std::vector<uint8_t> data;
};

// Reads a gzip-compressed (or plain) IDX file of u8 elements (type code 0x08).
// Errors: NotFound naming the path; DataLoss for a bad magic, an unsupported type or a short file.
absl::StatusOr<IdxArray> ReadIdxFile(const std::string& path);

}  // namespace meshrun

#endif  // MESHRUN_CORE_DATA_IDX_DATASET_H_
