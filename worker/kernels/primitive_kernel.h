// A Kernel that executes one oneDNN primitive over Tensors, re-pointed at their storage each run
// (internal to kernels/).
#ifndef MESHRUN_WORKER_KERNELS_PRIMITIVE_KERNEL_H_
#define MESHRUN_WORKER_KERNELS_PRIMITIVE_KERNEL_H_

#include <string>
#include <utility>
#include <vector>

#include "worker/kernels/engine.h"
#include "worker/kernels/kernel.h"

namespace meshrun::kernels {

class PrimitiveKernel : public Kernel {
 public:
  PrimitiveKernel(const char* name, dnnl::primitive prim, Args args)
      : name_(name), prim_(std::move(prim)), bound_(std::move(args)), stream_(CpuEngine()) {
    // The C API's argument array, built once: the memory objects it names are re-pointed in
    // place by Rebind, so the array stays valid (dnnl::primitive::execute would rebuild it from
    // a map on every run).
    for (const auto& [id, b] : bound_) exec_args_.push_back({id, b.memory.get()});
  }

  absl::Status Run() override {
    return Guard(name_, [&] {
      for (auto& [id, b] : bound_) b.Rebind();
      dnnl::error::wrap_c_api(
          dnnl_primitive_execute(prim_.get(), stream_.get(), static_cast<int>(exec_args_.size()),
                                 exec_args_.data()),
          "could not execute a primitive");
      stream_.wait();
    });
  }

 private:
  const char* name_;
  dnnl::primitive prim_;
  Args bound_;
  std::vector<dnnl_exec_arg_t> exec_args_;
  dnnl::stream stream_;
};

}  // namespace meshrun::kernels

#endif  // MESHRUN_WORKER_KERNELS_PRIMITIVE_KERNEL_H_
