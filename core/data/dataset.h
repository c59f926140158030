// Datasets a job reads its examples from, random access by example index: the fields of one
// example (an image and its label, or any user's columns), each an array of one dtype and a fixed
// example shape. A worker's input pipeline (core/data/input_pipeline.h) copies from here only the
// examples, and of them only the elements, of its own block of each global batch.
//
// Two sources:
//  - IDX (MNIST / Fashion-MNIST, `*-ubyte.gz` or plain): fields "image" (u8 [rows, cols]) and
//    "label" (u8 []); split "train" reads train-*, "test" reads t10k-*. The files are gzip streams,
//    so each worker decompresses the split into memory once (47 MB for Fashion-MNIST's train).
//  - A directory of `.npy` files, one per field (`<field>.npy`, any name), all with the same
//    leading dim (the examples), C order, little-endian, of the dtypes `<f4` (f32), `<i4` (i32),
//    `<u4` (u32) or `|u1` (u8) (numpy has no standard bf16). Memory-mapped: only the pages of the
//    examples a worker reads are ever loaded. Written with numpy as:
//
//      import numpy as np, os
//      os.makedirs("data/train", exist_ok=True)
//      n = 4096
//      x = np.random.default_rng(0).normal(size=(n, 1024)).astype(np.float32)
//      w = np.random.default_rng(1).normal(size=(1024, 1024)).astype(np.float32) / 32
//      np.save("data/train/input.npy", x)                       # field "input": f32 [1024]
//      np.save("data/train/label.npy", x @ w)                   # field "label": f32 [1024]
//      np.save("data/train/class.npy", (x[:, 0] > 0).astype(np.int32))   # i32 []
//      # a job then names {"format": "npy", "path": "data/train"}
//
// Thread-safe after Open: CopyExample only reads.
#ifndef MESHRUN_CORE_DATA_DATASET_H_
#define MESHRUN_CORE_DATA_DATASET_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/tensor.h"

namespace meshrun {

// One field of every example.
struct DatasetField {
  std::string name;
  DType dtype = v1::DTYPE_UNSPECIFIED;
  Dims example_dims;  // the shape of one example's value ([] for a scalar label)
  int64_t example_bytes() const { return NumElements(example_dims) * DTypeSize(dtype); }
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  // Opens `format` ("idx" or "npy") at `path`: for idx a directory with the four
  // {train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz] files and split "train" or "test"; for npy a
  // directory of <field>.npy files (split unused). Every file is checked before anything is read
  // for a batch. Errors: InvalidArgument naming an unknown format or split; NotFound naming a
  // missing directory or file; DataLoss naming the file for a bad header, a truncated file, an
  // unsupported dtype or Fortran order, or fields whose example counts differ (naming both).
  static absl::StatusOr<std::unique_ptr<Dataset>> Open(const std::string& format,
                                                       const std::string& path,
                                                       const std::string& split);

  virtual int64_t num_examples() const = 0;
  virtual const std::vector<DatasetField>& fields() const = 0;
  // Copies elements [begin, begin + count) of example `index`'s value of field `field` (its
  // elements row-major, flattened) to `dst`. REQUIRES: valid field, index and range.
  virtual void CopyElements(int field, int64_t index, int64_t begin, int64_t count,
                            void* dst) const = 0;

  // The index of field `name`. Errors: NotFound naming the field and the fields there are.
  absl::StatusOr<int> FieldIndex(const std::string& name) const;
};

// A parsed .npy header (format versions 1.0, 2.0 and 3.0).
struct NpyHeader {
  DType dtype = v1::DTYPE_UNSPECIFIED;
  Dims dims;
  int64_t data_offset = 0;  // bytes before the first element
};
// Parses the header at the start of `bytes` (of a file of `file_size` bytes named `path`) and
// checks the file holds all the elements it declares. Errors: DataLoss naming the path for a bad
// magic or header, an unsupported dtype (naming it and the supported ones), Fortran order, or a
// file shorter than the header declares (naming both sizes).
absl::StatusOr<NpyHeader> ParseNpyHeader(const std::string& path, const char* bytes,
                                         int64_t file_size);

}  // namespace meshrun

#endif  // MESHRUN_CORE_DATA_DATASET_H_
