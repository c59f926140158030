// Helpers shared by core/checkpoint/checkpoint.cc and safetensors.cc, not part of the API:
// strict JSON integers, safetensors' dtype names and POSIX writes with their errors as Status.
#ifndef MESHRUN_CORE_CHECKPOINT_CHECKPOINT_INTERNAL_H_
#define MESHRUN_CORE_CHECKPOINT_CHECKPOINT_INTERNAL_H_

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/tensor.h"
#include "nlohmann/json.hpp"

namespace meshrun::checkpoint {

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

// A JSON array of int64 integers; throws json::other_error naming the value otherwise.
std::vector<int64_t> Integers(const json& v);

// "F32", "BF16", "I32", "U32", "U8"; "" for another dtype.
std::string SafetensorsDType(DType d);
// The inverse; DataLoss naming the string for any other.
absl::StatusOr<DType> FromSafetensorsDType(const std::string& s);
// "`what` `path`: strerror(err)": ResourceExhausted for ENOSPC and EDQUOT, Internal otherwise.
absl::Status ErrnoStatus(const std::string& what, const std::string& path, int err);
// Writes all `n` bytes to `fd`, retrying after EINTR; ErrnoStatus on failure.
absl::Status WriteAll(int fd, const void* data, size_t n, const std::string& path);

}  // namespace meshrun::checkpoint

#endif  // MESHRUN_CORE_CHECKPOINT_CHECKPOINT_INTERNAL_H_
