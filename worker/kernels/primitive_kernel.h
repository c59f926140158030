// A Kernel that executes one oneDNN primitive over Tensors, re-pointed at their storage each run (internal to kernels/).
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
  PrimitiveKernel(const char* name, dnnl::primitive prim, Args args)
      : name_(name), prim_(std::move(prim)), bound_(std::move(args)), stream_(CpuEngine()) {
    for (const auto& [id, b] : bound_) args_.emplace(id, b.memory);  // handles share the memory objects
  }

  absl::Status Run() override {
    return Guard(name_, [&] {
      for (auto& [id, b] : bound_) b.Rebind();
      prim_.execute(stream_, args_);
      stream_.wait();
    });
  }

 private:
  const char* name_;
  dnnl::primitive prim_;
  Args bound_;
  std::unordered_map<int, dnnl::memory> args_;
  dnnl::stream stream_;
};

}  // namespace meshrun::kernels

#endif  // MESHRUN_WORKER_KERNELS_PRIMITIVE_KERNEL_H_
