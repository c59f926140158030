// A tensor of normally distributed f32 values, reproducible from its seed, for the kernel tests.
#ifndef MESHRUN_TESTS_WORKER_RANDOM_TENSOR_H_
#define MESHRUN_TESTS_WORKER_RANDOM_TENSOR_H_

#include <cstdint>
#include <random>
#include <utility>

#include "core/tensor.h"

namespace meshrun {
namespace testing {

// f32 `dims` drawn from N(0, scale^2) by std::mt19937(seed), row-major.
inline Tensor Random(Dims dims, uint32_t seed, float scale = 1.0f) {
  Tensor t(v1::DTYPE_F32, std::move(dims));
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  for (int64_t i = 0; i < t.num_elements(); ++i) t.data<float>()[i] = dist(rng);
  return t;
}

}  // namespace testing
}  // namespace meshrun

#endif  // MESHRUN_TESTS_WORKER_RANDOM_TENSOR_H_
