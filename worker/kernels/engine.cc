#include "worker/kernels/engine.h"

#include <omp.h>

#include "absl/strings/str_cat.h"
#include "worker/kernels/kernel.h"

namespace meshrun {

void SetComputeThreads(int num_threads) {
  if (num_threads > 0) omp_set_num_threads(num_threads);
}

namespace kernels {

dnnl::engine& CpuEngine() {
  static dnnl::engine* engine = new dnnl::engine(dnnl::engine::kind::cpu, 0);
  return *engine;
}

std::optional<dnnl::memory::data_type> FloatType(DType dtype) {
  if (dtype == v1::DTYPE_F32) return dnnl::memory::data_type::f32;
  if (dtype == v1::DTYPE_BF16) return dnnl::memory::data_type::bf16;
  return std::nullopt;
}

const std::map<std::string, EltwiseAlg>& EltwiseAlgs() {
  static const auto* algs =
      new std::map<std::string, EltwiseAlg>{{"tanh", {dnnl::algorithm::eltwise_tanh, 0, 0}},
                                            {"exp", {dnnl::algorithm::eltwise_exp, 0, 0}},
                                            {"log", {dnnl::algorithm::eltwise_log, 0, 0}},
                                            {"sqrt", {dnnl::algorithm::eltwise_sqrt, 0, 0}},
                                            {"rsqrt", {dnnl::algorithm::eltwise_pow, 1, -0.5f}},
                                            {"neg", {dnnl::algorithm::eltwise_linear, -1, 0}},
                                            {"abs", {dnnl::algorithm::eltwise_abs, 0, 0}},
                                            {"square", {dnnl::algorithm::eltwise_square, 0, 0}},
                                            {"relu", {dnnl::algorithm::eltwise_relu, 0, 0}},
                                            {"logistic", {dnnl::algorithm::eltwise_logistic, 0, 0}},
                                            {"silu", {dnnl::algorithm::eltwise_swish, 1, 0}},
                                            {"pow", {dnnl::algorithm::eltwise_pow, 1, 1}}};
  return *algs;
}

std::optional<EltwiseAlg> EltwiseAlgOf(const std::string& fn, float exponent) {
  auto it = EltwiseAlgs().find(fn);
  if (it == EltwiseAlgs().end()) return std::nullopt;
  EltwiseAlg a = it->second;
  if (fn == "pow") a.beta = exponent;
  return a;
}

dnnl::memory::desc RowMajorDesc(const Dims& dims) {
  dnnl::memory::dims d(dims.begin(), dims.end());
  if (d.empty()) d.push_back(1);
  dnnl::memory::dims strides(d.size(), 1);
  for (int i = static_cast<int>(d.size()) - 2; i >= 0; --i) strides[i] = strides[i + 1] * d[i + 1];
  return dnnl::memory::desc(d, dnnl::memory::data_type::f32, strides);
}

BoundMemory Bind(const dnnl::memory::desc& md, const Tensor& tensor) {
  void* p = const_cast<void*>(tensor.raw());
  return BoundMemory{dnnl::memory(md, CpuEngine(), p), &tensor, p};
}

absl::Status Guard(const char* what, const std::function<void()>& fn) {
  try {
    fn();
    return absl::OkStatus();
  } catch (const dnnl::error& e) {
    return absl::InternalError(
        absl::StrCat("oneDNN ", what, " failed: ", e.what(), " (status ", e.status, ")"));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(what, " failed: ", e.what()));
  }
}

}  // namespace kernels
}  // namespace meshrun
