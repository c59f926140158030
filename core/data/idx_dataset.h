// Reading IDX files (the MNIST / Fashion-MNIST format), gzip-compressed, with zlib.
#ifndef MESHRUN_CORE_DATA_IDX_DATASET_H_
#define MESHRUN_CORE_DATA_IDX_DATASET_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace meshrun {

// An IDX array of unsigned bytes: dims from the header, elements row-major.
struct IdxArray {
  std::vector<int64_t> dims;
  std::vector<uint8_t> data;
};

// Reads a gzip-compressed (or plain) IDX file of u8 elements (type code 0x08).
// Errors: NotFound naming the path; DataLoss for a bad magic, an unsupported type or a short file.
absl::StatusOr<IdxArray> ReadIdxFile(const std::string& path);

// One split of Fashion-MNIST: images [n, 28 * 28] u8 row-major, labels [n] in 0..9.
struct ImageDataset {
  int64_t num_examples = 0;
  int64_t image_size = 0;  // 784
  std::vector<uint8_t> images;
  std::vector<uint8_t> labels;
};

// Loads "train" (60,000 examples) or "test" (10,000) from `dir`, which holds the Debian package
// dataset-fashion-mnist's files ({train,t10k}-{images-idx3,labels-idx1}-ubyte.gz).
// Errors: InvalidArgument for another split; those of ReadIdxFile; DataLoss if counts disagree.
absl::StatusOr<ImageDataset> LoadFashionMnist(const std::string& dir, absl::string_view split);

}  // namespace meshrun

#endif  // MESHRUN_CORE_DATA_IDX_DATASET_H_
