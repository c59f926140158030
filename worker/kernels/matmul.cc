// Matmul (GEMM with alpha and beta in {0, 1}, optional bias) and row sums, all on oneDNN's matmul
// primitive. Transposes are expressed as strides, so no operand is ever copied.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/array_ops.h"
#include "worker/kernels/primitive_kernel.h"

namespace meshrun {

using kernels::Bind;
using kernels::CpuEngine;
using kernels::Guard;
using kernels::PrimitiveKernel;

namespace {

using Desc = dnnl::memory::desc;

// oneDNN's type for a matmul operand: f32, or bf16 (computed on AVX512-BF16 or AMX where the CPU
// has them, oneDNN's emulation elsewhere; accumulated in f32 either way).
absl::StatusOr<dnnl::memory::data_type> MatmulType(const Tensor& t, const char* what) {
  if (std::optional<dnnl::memory::data_type> type = kernels::FloatType(t.dtype())) return *type;
  return absl::InvalidArgumentError(absl::StrCat("matmul ", what, " is ", DTypeName(t.dtype()),
                                                 DimsToString(t.dims()), "; expected f32 or bf16"));
}

// A row-major [rows, cols] view, or the transposed view of a stored [cols, rows] array.
Desc MatrixDesc(int64_t rows, int64_t cols, bool transposed_storage,
                dnnl::memory::data_type type = dnnl::memory::data_type::f32) {
  if (!transposed_storage) return Desc({rows, cols}, type, {cols, 1});
  return Desc({rows, cols}, type, {1, rows});
}

// The primitive for c = alpha * a @ b (+ bias) (+ c), over the given views of fixed buffers.
absl::StatusOr<std::unique_ptr<Kernel>> BuildMatmul(const Desc& a_md, const Tensor& a,
                                                    const Desc& b_md, const Tensor& b,
                                                    const Tensor* bias, int64_t n, const Desc& c_md,
                                                    Tensor& c, const MatmulOptions& options) {
  if (bias != nullptr && options.alpha != 1.0f) {
    return absl::InvalidArgumentError("matmul: a bias with alpha != 1 is not supported");
  }
  std::optional<kernels::EltwiseAlg> activation;
  if (!options.activation.empty()) {
    activation = kernels::EltwiseAlgOf(options.activation);
    // Not pow (its exponent), nor log: oneDNN's eltwise_log is accurate only to ~1.4e-6
    // absolute, and the unary log is libm's (CreateUnary).
    if (!activation || options.activation == "pow" || options.activation == "log") {
      std::vector<std::string> fns;
      for (const auto& [fn, _] : kernels::EltwiseAlgs())
        if (fn != "pow" && fn != "log") fns.push_back(fn);
      return absl::InvalidArgumentError(absl::StrCat("matmul activation '", options.activation,
                                                     "'; allowed: ", absl::StrJoin(fns, ", ")));
    }
    if (options.accumulate || options.alpha != 1.0f) {
      return absl::InvalidArgumentError(absl::StrCat("matmul activation '", options.activation,
                                                     "' with accumulate or alpha != 1"));
    }
  }
  std::unique_ptr<Kernel> kernel;
  absl::Status s = Guard("matmul", [&] {
    dnnl::primitive_attr attr;
    if (options.alpha != 1.0f) attr.set_output_scales(0, {options.alpha});
    dnnl::post_ops ops;
    if (options.accumulate) ops.append_sum(1.0f);
    if (activation) ops.append_eltwise(1.0f, activation->alg, activation->alpha, activation->beta);
    if (ops.len() > 0) attr.set_post_ops(ops);
    kernels::Args args = {{DNNL_ARG_SRC, Bind(a_md, a)},
                          {DNNL_ARG_WEIGHTS, Bind(b_md, b)},
                          {DNNL_ARG_DST, Bind(c_md, c)}};
    dnnl::matmul::primitive_desc pd;
    if (bias != nullptr) {
      Desc bias_md({1, n}, *kernels::FloatType(bias->dtype()), {n, 1});  // checked by the caller
      args.emplace_back(DNNL_ARG_BIAS, Bind(bias_md, *bias));
      pd = dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md, b_md, bias_md, c_md), attr,
                                        CpuEngine());
    } else {
      pd = dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md, b_md, c_md), attr, CpuEngine());
    }
    kernel = std::make_unique<PrimitiveKernel>("matmul", dnnl::matmul(pd), std::move(args));
  });
  if (!s.ok()) return s;
  return kernel;
}

// out [1, cols] = alpha * ones [1, rows] @ x [rows, cols]: a sum over leading dims as a GEMM
// (oneDNN's reduction primitive has only a slow reference kernel for it).
class LeadingSumKernel : public Kernel {
 public:
  explicit LeadingSumKernel(int64_t rows) : ones_(v1::DTYPE_F32, {1, rows}) {
    std::fill_n(ones_.data<float>(), rows, 1.0f);
  }
  absl::Status Init(const Tensor& x, int64_t rows, Tensor& out, float alpha) {
    const int64_t cols = x.num_elements() / rows;
    MatmulOptions o;
    o.alpha = alpha;
    absl::StatusOr<std::unique_ptr<Kernel>> m =
        BuildMatmul(MatrixDesc(1, rows, false), ones_, MatrixDesc(rows, cols, false), x, nullptr,
                    cols, MatrixDesc(1, cols, false), out, o);
    if (!m.ok()) return m.status();
    matmul_ = *std::move(m);
    return absl::OkStatus();
  }
  absl::Status Run() override { return matmul_->Run(); }

 private:
  Tensor ones_;
  std::unique_ptr<Kernel> matmul_;
};

}  // namespace

namespace {

absl::StatusOr<std::unique_ptr<Kernel>> CreateNativeMatmul(const Tensor& a, const Tensor& b,
                                                           const Tensor* bias, Tensor& c,
                                                           const MatmulOptions& options);

// A matmul with bf16 operands on a CPU where oneDNN has no bf16 matmul (no AVX512 core): the
// bf16 operands are widened to f32 (exactly) and the f32 GEMM accumulates their products, as the
// bf16 GEMM does; a bf16 result is rounded once at the end. Operands and a result that are f32
// already (a weight gradient accumulated in f32 over minibatches) are used where they lie.
class WidenedMatmul : public Kernel {
 public:
  WidenedMatmul(const Tensor& a, const Tensor& b, const Tensor* bias, Tensor& c)
      : a_(a), b_(b), bias_(bias), c_(c) {}
  absl::Status Init(const MatmulOptions& options) {
    const Tensor& a32 = Widened(a_, a32_);
    const Tensor& b32 = Widened(b_, b32_);
    const Tensor* bias32 = bias_ != nullptr ? &Widened(*bias_, bias32_) : nullptr;
    Tensor& c32 = c_.dtype() == v1::DTYPE_F32 ? c_ : (c32_ = Wide(c_));
    absl::StatusOr<std::unique_ptr<Kernel>> k = CreateNativeMatmul(a32, b32, bias32, c32, options);
    if (!k.ok()) return k.status();
    matmul_ = *std::move(k);
    accumulate_ = options.accumulate;
    return absl::OkStatus();
  }
  absl::Status Run() override {
    WidenIfBf16(a_, a32_);
    WidenIfBf16(b_, b32_);
    if (bias_ != nullptr) WidenIfBf16(*bias_, bias32_);
    const bool narrow_c = c_.dtype() != v1::DTYPE_F32;
    if (accumulate_ && narrow_c) Convert(c_, c32_);
    if (absl::Status s = matmul_->Run(); !s.ok()) return s;
    if (narrow_c) Convert(c32_, c_);
    return absl::OkStatus();
  }

 private:
  static Tensor Wide(const Tensor& t) { return Tensor::Uninitialized(v1::DTYPE_F32, t.dims()); }
  // `t` itself if it is f32, else `wide` made its f32 twin.
  static const Tensor& Widened(const Tensor& t, Tensor& wide) {
    if (t.dtype() == v1::DTYPE_F32) return t;
    wide = Wide(t);
    return wide;
  }
  static void WidenIfBf16(const Tensor& t, Tensor& wide) {
    if (t.dtype() != v1::DTYPE_F32) Convert(t, wide);
  }
  const Tensor& a_;
  const Tensor& b_;
  const Tensor* bias_;
  Tensor& c_;
  Tensor a32_, b32_, bias32_, c32_;
  bool accumulate_ = false;
  std::unique_ptr<Kernel> matmul_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Kernel>> CreateMatmul(const Tensor& a, const Tensor& b,
                                                     const Tensor* bias, Tensor& c,
                                                     const MatmulOptions& options) {
  absl::StatusOr<std::unique_ptr<Kernel>> k = CreateNativeMatmul(a, b, bias, c, options);
  const bool bf16 = a.dtype() == v1::DTYPE_BF16 || c.dtype() == v1::DTYPE_BF16 ||
                    (bias != nullptr && bias->dtype() == v1::DTYPE_BF16);
  // Bad shapes and dtypes are InvalidArgument; anything else is oneDNN lacking the primitive.
  if (k.ok() || !bf16 || k.status().code() == absl::StatusCode::kInvalidArgument) return k;
  auto widened = std::make_unique<WidenedMatmul>(a, b, bias, c);
  if (absl::Status s = widened->Init(options); !s.ok()) return s;
  return std::unique_ptr<Kernel>(std::move(widened));
}

namespace {

absl::StatusOr<std::unique_ptr<Kernel>> CreateNativeMatmul(const Tensor& a, const Tensor& b,
                                                           const Tensor* bias, Tensor& c,
                                                           const MatmulOptions& options) {
  absl::StatusOr<dnnl::memory::data_type> ta = MatmulType(a, "lhs"), tb = MatmulType(b, "rhs"),
                                          tc = MatmulType(c, "result");
  for (const auto* t : {&ta, &tb, &tc}) {
    if (!t->ok()) return t->status();
  }
  if (bias != nullptr) {
    if (absl::StatusOr<dnnl::memory::data_type> t = MatmulType(*bias, "bias"); !t.ok())
      return t.status();
  }
  if (a.dtype() != b.dtype()) {
    return absl::InvalidArgumentError(absl::StrCat("matmul operands are ", DTypeName(a.dtype()),
                                                   " and ", DTypeName(b.dtype()),
                                                   "; expected one dtype (both f32 or both bf16)"));
  }
  if (a.dims().size() == 3 && b.dims().size() == 3 && c.dims().size() == 3) {
    // Batched: [B, M, K] @ [B, K, N] -> [B, M, N].
    const int64_t bt = a.dims()[0], m = a.dims()[1], k = a.dims()[2], n = b.dims()[2];
    if (options.transpose_a || options.transpose_b || bias != nullptr || b.dims()[0] != bt ||
        b.dims()[1] != k || c.dims() != Dims{bt, m, n}) {
      return absl::InvalidArgumentError(absl::StrCat(
          "batched matmul shapes do not agree: ", DimsToString(a.dims()), " @ ",
          DimsToString(b.dims()), " -> ", DimsToString(c.dims()), " (no transposes or bias)"));
    }
    auto desc = [](int64_t b0, int64_t r, int64_t c0, dnnl::memory::data_type t) {
      return Desc({b0, r, c0}, t, {r * c0, c0, 1});
    };
    return BuildMatmul(desc(bt, m, k, *ta), a, desc(bt, k, n, *tb), b, nullptr, n,
                       desc(bt, m, n, *tc), c, options);
  }
  if (a.dims().size() != 2 || b.dims().size() != 2 || c.dims().size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("matmul needs 2-D operands; got a ", DimsToString(a.dims()), ", b ",
                     DimsToString(b.dims()), ", c ", DimsToString(c.dims())));
  }
  const int64_t m = options.transpose_a ? a.dims()[1] : a.dims()[0];
  const int64_t k = options.transpose_a ? a.dims()[0] : a.dims()[1];
  const int64_t kb = options.transpose_b ? b.dims()[1] : b.dims()[0];
  const int64_t n = options.transpose_b ? b.dims()[0] : b.dims()[1];
  if (k != kb || c.dims()[0] != m || c.dims()[1] != n) {
    return absl::InvalidArgumentError(absl::StrCat("matmul shapes do not agree: op(a) [", m, ", ",
                                                   k, "] @ op(b) [", kb, ", ", n, "] -> c ",
                                                   DimsToString(c.dims())));
  }
  if (bias != nullptr && bias->num_elements() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("matmul bias has shape ", DimsToString(bias->dims()), "; expected [", n, "]"));
  }
  return BuildMatmul(MatrixDesc(m, k, options.transpose_a, *ta), a,
                     MatrixDesc(k, n, options.transpose_b, *tb), b, bias, n,
                     MatrixDesc(m, n, false, *tc), c, options);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Kernel>> CreateLeadingSum(const Tensor& x, int64_t rows, Tensor& out,
                                                         float alpha) {
  if (rows <= 0 || x.num_elements() % rows != 0 || out.num_elements() * rows != x.num_elements()) {
    return absl::InvalidArgumentError(absl::StrCat("leading sum: input ", DimsToString(x.dims()),
                                                   " over ", rows, " rows into ",
                                                   DimsToString(out.dims())));
  }
  auto kernel = std::make_unique<LeadingSumKernel>(rows);
  if (absl::Status s = kernel->Init(x, rows, out, alpha); !s.ok()) return s;
  return std::unique_ptr<Kernel>(std::move(kernel));
}

}  // namespace meshrun
