// A .npy file (NumPy's format 1.0, C order) for the fuzz targets' small datasets.
#ifndef MESHRUN_TESTS_FUZZ_NPY_H_
#define MESHRUN_TESTS_FUZZ_NPY_H_

#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"

namespace meshrun {

// Writes `bytes` (the array's data) to `path` as an array of dtype `descr` ("<f4", "|u1") and
// shape `shape` (a Python tuple: "(16, 3)").
inline void WriteNpy(const std::string& path, const std::string& descr, const std::string& shape,
                     const std::string& bytes) {
  std::string header =
      absl::StrCat("{'descr': '", descr, "', 'fortran_order': False, 'shape': ", shape, ", }");
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::string file = "\x93NUMPY";
  file += '\x01';
  file += '\x00';
  file += static_cast<char>(header.size() & 0xff);
  file += static_cast<char>(header.size() >> 8);
  std::ofstream(path, std::ios::binary) << file << header << bytes;
}

}  // namespace meshrun

#endif  // MESHRUN_TESTS_FUZZ_NPY_H_
