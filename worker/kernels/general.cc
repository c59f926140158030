// Element-wise and reduction kernels for shard_map programs: oneDNN eltwise, binary (with
// broadcasting) and reduction primitives; the unary fns oneDNN lacks are loops
// (unary_loops.cc).
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/array_ops.h"
#include "worker/kernels/primitive_kernel.h"

namespace meshrun {

using kernels::Bind;
using kernels::CpuEngine;
using kernels::Guard;
using kernels::PrimitiveKernel;
using kernels::RowMajorDesc;

namespace {

absl::Status RequireF32(const char* op, const Tensor& t) {
  if (t.dtype() != v1::DTYPE_F32) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, " supports f32; got ", DTypeName(t.dtype()), " (convert it first)"));
  }
  return absl::OkStatus();
}

template <typename V>
std::string Keys(const std::map<std::string, V>& m) {
  std::vector<std::string> k;
  for (const auto& [name, _] : m) k.push_back(name);
  return absl::StrJoin(k, ", ");
}

}  // namespace

absl::StatusOr<std::unique_ptr<Kernel>> CreateUnaryGrad(const std::string& fn, const Tensor& x,
                                                        const Tensor& dy, Tensor& dx,
                                                        bool from_output) {
  std::map<std::string, kernels::EltwiseAlg> algs;
  for (const char* name :
       {"tanh", "exp", "log", "sqrt", "abs", "square", "relu", "logistic", "silu"}) {
    if (!from_output || std::string(name) == "relu") algs[name] = *kernels::EltwiseAlgOf(name);
  }
  auto it = algs.find(fn);
  if (it == algs.end()) {
    return absl::InvalidArgumentError(absl::StrCat("unknown unary_grad fn '", fn, "'",
                                                   from_output ? " from the output" : "",
                                                   "; allowed: ", Keys(algs)));
  }
  if (absl::Status s = RequireF32("unary_grad", x); !s.ok()) return s;
  if (absl::Status s = RequireF32("unary_grad", dy); !s.ok()) return s;
  if (x.dims() != dy.dims() || x.dims() != dx.dims()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unary_grad ", fn, ": x ", DimsToString(x.dims()), ", dy ", DimsToString(dy.dims()),
        " and dx ", DimsToString(dx.dims()), " must have one shape"));
  }
  if (x.num_elements() == 0) return std::unique_ptr<Kernel>(nullptr);
  std::unique_ptr<Kernel> kernel;
  absl::Status s = Guard("unary_grad", [&] {
    auto md = RowMajorDesc(x.dims());
    kernels::EltwiseAlg a = it->second;
    // relu'(x) from y = relu(x): y > 0 exactly where x > 0, so dx is bitwise the same.
    if (from_output) a.alg = dnnl::algorithm::eltwise_relu_use_dst_for_bwd;
    dnnl::eltwise_forward::primitive_desc hint(
        dnnl::eltwise_forward::desc(dnnl::prop_kind::forward_training, a.alg, md, a.alpha, a.beta),
        CpuEngine());
    dnnl::eltwise_backward::primitive_desc pd(
        dnnl::eltwise_backward::desc(a.alg, md, md, a.alpha, a.beta), CpuEngine(), hint);
    kernel = std::make_unique<PrimitiveKernel>(
        "unary_grad", dnnl::eltwise_backward(pd),
        kernels::Args{{from_output ? DNNL_ARG_DST : DNNL_ARG_SRC, Bind(md, x)},
                      {DNNL_ARG_DIFF_DST, Bind(md, dy)},
                      {DNNL_ARG_DIFF_SRC, Bind(md, dx)}});
  });
  if (!s.ok()) return s;
  return kernel;
}

absl::StatusOr<std::unique_ptr<Kernel>> CreateUnary(const std::string& fn, const Tensor& x,
                                                    Tensor& y, float exponent) {
  std::map<std::string, kernels::EltwiseAlg> algs = kernels::EltwiseAlgs();
  algs["pow"] = *kernels::EltwiseAlgOf("pow", exponent);
  auto it = algs.find(fn);
  if (it == algs.end() && !IsLoopUnary(fn)) {
    std::set<std::string> allowed;
    for (const auto& [name, _] : algs) allowed.insert(name);
    for (const std::string& name : LoopUnaryFns()) allowed.insert(name);
    return absl::InvalidArgumentError(
        absl::StrCat("unknown unary fn '", fn, "'; allowed: ", absl::StrJoin(allowed, ", ")));
  }
  if (absl::Status s = RequireF32("unary", x); !s.ok()) return s;
  if (x.dims() != y.dims())
    return absl::InvalidArgumentError("unary: output shape differs from input");
  if (IsLoopUnary(fn)) return CreateLoopUnary(fn, x, y);
  std::unique_ptr<Kernel> kernel;
  if (x.num_elements() == 0) return std::unique_ptr<Kernel>(nullptr);
  absl::Status s = Guard("unary", [&] {
    auto md = RowMajorDesc(x.dims());
    dnnl::eltwise_forward::primitive_desc pd(
        dnnl::eltwise_forward::desc(dnnl::prop_kind::forward_inference, it->second.alg, md,
                                    it->second.alpha, it->second.beta),
        CpuEngine());
    kernel = std::make_unique<PrimitiveKernel>(
        "unary", dnnl::eltwise_forward(pd),
        kernels::Args{{DNNL_ARG_SRC, Bind(md, x)}, {DNNL_ARG_DST, Bind(md, y)}});
  });
  if (!s.ok()) return s;
  return kernel;
}

absl::StatusOr<std::unique_ptr<Kernel>> CreateBinary(const std::string& fn, const Tensor& a,
                                                     const Tensor& b, Tensor& out) {
  const std::map<std::string, dnnl::algorithm> algs = {{"add", dnnl::algorithm::binary_add},
                                                       {"sub", dnnl::algorithm::binary_sub},
                                                       {"mul", dnnl::algorithm::binary_mul},
                                                       {"div", dnnl::algorithm::binary_div}};
  auto it = algs.find(fn);
  bool ok = a.dims().size() == b.dims().size() && a.dims() == out.dims();
  for (size_t d = 0; ok && d < a.dims().size(); ++d)
    ok = b.dims()[d] == a.dims()[d] || b.dims()[d] == 1;
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat("binary ", fn, ": ", DimsToString(b.dims()),
                                                   " does not broadcast to ",
                                                   DimsToString(a.dims())));
  }
  if (IsLoopBinary(fn, a.dtype())) return CreateLoopBinary(fn, a, b, out);
  if (it == algs.end()) {
    return absl::InvalidArgumentError(absl::StrCat("unknown binary fn '", fn,
                                                   "' for f32; allowed: ", Keys(algs), ", ",
                                                   LoopBinaryFns(v1::DTYPE_F32)));
  }
  if (absl::Status s = RequireF32("binary", a); !s.ok()) return s;
  if (absl::Status s = RequireF32("binary", b); !s.ok()) return s;
  if (a.num_elements() == 0) return std::unique_ptr<Kernel>(nullptr);
  std::unique_ptr<Kernel> kernel;
  bool reference = false;
  absl::Status s = Guard("binary", [&] {
    auto a_md = RowMajorDesc(a.dims());
    auto b_md = RowMajorDesc(b.dims());
    dnnl::binary::primitive_desc pd(dnnl::binary::desc(it->second, a_md, b_md, a_md), CpuEngine());
    // oneDNN 2.6 falls back to its reference code for some broadcasts (b along the last dim).
    reference = absl::StartsWith(pd.impl_info_str(), "ref");
    if (reference) return;
    kernel = std::make_unique<PrimitiveKernel>("binary", dnnl::binary(pd),
                                               kernels::Args{{DNNL_ARG_SRC_0, Bind(a_md, a)},
                                                             {DNNL_ARG_SRC_1, Bind(b_md, b)},
                                                             {DNNL_ARG_DST, Bind(a_md, out)}});
  });
  if (!s.ok()) return s;
  if (reference) return CreateArithmeticLoop(fn, a, b, out);
  return kernel;
}

absl::StatusOr<std::unique_ptr<Kernel>> CreateReduce(const std::string& fn, const Tensor& x,
                                                     Tensor& out) {
  // max and min are loops (CreateLoopReduce): oneDNN's reduction drops NaN; so are integer
  // reductions, which f32 would round.
  const std::map<std::string, dnnl::algorithm> algs = {{"sum", dnnl::algorithm::reduction_sum},
                                                       {"mean", dnnl::algorithm::reduction_mean}};
  auto it = algs.find(fn);
  const bool integral = x.dtype() == v1::DTYPE_I32 || x.dtype() == v1::DTYPE_U32;
  const bool loop = fn == "max" || fn == "min" || integral;
  if (it == algs.end() && fn != "max" && fn != "min") {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown reduce fn '", fn, "'; allowed: max, ", Keys(algs), ", min"));
  }
  if (!integral) {
    if (absl::Status s = RequireF32("reduce", x); !s.ok()) return s;
  }
  bool fits = x.dims().size() == out.dims().size() && out.dtype() == x.dtype();
  for (size_t d = 0; fits && d < x.dims().size(); ++d)
    fits = out.dims()[d] == x.dims()[d] || out.dims()[d] == 1;
  if (!fits) {
    return absl::InvalidArgumentError(
        absl::StrCat("reduce ", fn, ": output ", DTypeName(out.dtype()), DimsToString(out.dims()),
                     " for input ", DTypeName(x.dtype()), DimsToString(x.dims()),
                     "; expected its dtype and rank, each dim its own or 1"));
  }
  if (x.num_elements() == 0) return std::unique_ptr<Kernel>(nullptr);
  // Only dims of size 1 reduced (oneDNN's reduction refuses that): a copy, whatever the fn.
  if (x.dims() == out.dims() && !integral) return CreateConvert(x, out);
  if (loop) return CreateLoopReduce(fn, x, out);
  // A sum or mean over leading dims (a bias gradient, a batch mean) runs as a GEMM.
  size_t lead = 0;
  while (lead < x.dims().size() && out.dims()[lead] == 1) ++lead;
  bool leading = lead > 0 && (fn == "sum" || fn == "mean");
  for (size_t d = lead; leading && d < x.dims().size(); ++d) leading = out.dims()[d] == x.dims()[d];
  if (leading) {
    int64_t rows = 1;
    for (size_t d = 0; d < lead; ++d) rows *= x.dims()[d];
    return CreateLeadingSum(x, rows, out, fn == "mean" ? 1.0f / static_cast<float>(rows) : 1.0f);
  }
  std::unique_ptr<Kernel> kernel;
  absl::Status s = Guard("reduce", [&] {
    auto src_md = RowMajorDesc(x.dims());
    auto dst_md = RowMajorDesc(out.dims());
    dnnl::reduction::primitive_desc pd(
        dnnl::reduction::desc(it->second, src_md, dst_md, 0.0f, 0.0f), CpuEngine());
    kernel = std::make_unique<PrimitiveKernel>(
        "reduce", dnnl::reduction(pd),
        kernels::Args{{DNNL_ARG_SRC, Bind(src_md, x)}, {DNNL_ARG_DST, Bind(dst_md, out)}});
  });
  if (!s.ok()) return s;
  return kernel;
}

namespace {

// y = x between f32 and bf16 by array_ops.h's Convert, in bulk.
class ConvertKernel : public Kernel {
 public:
  ConvertKernel(const Tensor& x, Tensor& y) : x_(x), y_(y) {}
  absl::Status Run() override {
    Convert(x_, y_);
    return absl::OkStatus();
  }

 private:
  const Tensor& x_;
  Tensor& y_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Kernel>> CreateConvert(const Tensor& x, Tensor& y) {
  if (!kernels::FloatType(x.dtype()) || !kernels::FloatType(y.dtype()) || x.dims() != y.dims()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "convert: ", DTypeName(x.dtype()), DimsToString(x.dims()), " to ", DTypeName(y.dtype()),
        DimsToString(y.dims()), "; expected f32 <-> bf16 of one shape"));
  }
  if (x.num_elements() == 0) return std::unique_ptr<Kernel>(nullptr);
  return std::unique_ptr<Kernel>(std::make_unique<ConvertKernel>(x, y));
}

}  // namespace meshrun
