// The process-wide oneDNN CPU engine and helpers shared by the kernels (internal to kernels/).
#ifndef MESHRUN_WORKER_KERNELS_ENGINE_H_
#define MESHRUN_WORKER_KERNELS_ENGINE_H_

#include <functional>

#include "absl/status/status.h"
#include "core/tensor.h"
#include "dnnl.hpp"

namespace meshrun::kernels {

dnnl::engine& CpuEngine();

// A row-major f32 memory descriptor for `dims` ({} becomes {1}).
dnnl::memory::desc RowMajorDesc(const Dims& dims);
dnnl::memory MemoryFor(const dnnl::memory::desc& md, const void* data);

// Runs `fn`, converting dnnl::error (and any std::exception) into Internal naming `what`.
absl::Status Guard(const char* what, const std::function<void()>& fn);

}  // namespace meshrun::kernels

#endif  // MESHRUN_WORKER_KERNELS_ENGINE_H_
