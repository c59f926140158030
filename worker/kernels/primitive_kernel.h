// A Kernel that executes one oneDNN primitive with a fixed argument map (internal to kernels/).
#ifndef MESHRUN_WORKER_KERNELS_PRIMITIVE_KERNEL_H_
#define MESHRUN_WORKER_KERNELS_PRIMITIVE_KERNEL_H_

#include <string>
#include <unordered_map>
#include <utility>

#include "worker/kernels/engine.h"
#include "worker/kernels/kernel.h"

namespace meshrun::kernels {

class PrimitiveKernel : public Kernel {
 public:
  PrimitiveKernel(const char* name, dnnl::primitive prim, std::unordered_map<int, dnnl::memory> args)
      : name_(name), prim_(std::move(prim)), args_(std::move(args)), stream_(CpuEngine()) {}

  absl::Status Run() override {
    return Guard(name_, [&] {
      prim_.execute(stream_, args_);
      stream_.wait();
    });
  }

 private:
  const char* name_;
  dnnl::primitive prim_;
  std::unordered_map<int, dnnl::memory> args_;
  dnnl::stream stream_;
};

}  // namespace meshrun::kernels

#endif  // MESHRUN_WORKER_KERNELS_PRIMITIVE_KERNEL_H_
