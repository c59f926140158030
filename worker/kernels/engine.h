// The process-wide oneDNN CPU engine and helpers shared by the kernels (internal to kernels/).
#ifndef MESHRUN_WORKER_KERNELS_ENGINE_H_
#define MESHRUN_WORKER_KERNELS_ENGINE_H_

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "core/tensor.h"
#include "dnnl.hpp"

namespace meshrun::kernels {

dnnl::engine& CpuEngine();

// oneDNN's data type for f32 and bf16 Tensors; nullopt for any other dtype.
std::optional<dnnl::memory::data_type> FloatType(DType dtype);

// A unary fn as a oneDNN eltwise algorithm with its alpha and beta (CreateUnary's fns that oneDNN
// computes, and matmul post-ops).
struct EltwiseAlg {
  dnnl::algorithm alg;
  float alpha, beta;
};
// Every such fn: tanh exp log sqrt rsqrt neg abs square relu logistic silu, and pow (x **
// exponent).
const std::map<std::string, EltwiseAlg>& EltwiseAlgs();
// The algorithm of `fn`, pow's beta being `exponent`; nullopt for a fn that is not in the table.
std::optional<EltwiseAlg> EltwiseAlgOf(const std::string& fn, float exponent = 1.0f);

// A row-major f32 memory descriptor for `dims` ({} becomes {1}).
dnnl::memory::desc RowMajorDesc(const Dims& dims);

// A primitive's argument over a Tensor. The memory is re-pointed at the tensor's current storage
// before every execution (Rebind), so an executor may swap a buffer's storage between runs (an
// input aliasing a stored shard, an output handed to the store) without recompiling.
struct BoundMemory {
  dnnl::memory memory;
  const Tensor* tensor = nullptr;
  void* handle = nullptr;  // what `memory` points at (kept here: asking oneDNN costs a call)
  void Rebind() {
    void* p = const_cast<void*>(tensor->raw());
    if (handle != p) {
      memory.set_data_handle(p);
      handle = p;
    }
  }
};
BoundMemory Bind(const dnnl::memory::desc& md, const Tensor& tensor);
// A primitive's arguments by DNNL_ARG_* id.
using Args = std::vector<std::pair<int, BoundMemory>>;

// Runs `fn`, converting dnnl::error (and any std::exception) into Internal naming `what`.
absl::Status Guard(const char* what, const std::function<void()>& fn);

}  // namespace meshrun::kernels

#endif  // MESHRUN_WORKER_KERNELS_ENGINE_H_
