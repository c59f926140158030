// Element-wise and reduction kernels for shard_map programs: oneDNN eltwise, binary (with
// broadcasting) and reduction primitives.
#include <cmath>
#include <limits>
#include <map>
#include <vector>

#include "absl/base/casts.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/array_ops.h"
#include "core/float_ops.h"
#include "core/random/threefry.h"
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

namespace {

// The digamma function psi(x) = d/dx log|Gamma(x)| in double: the reflection
// psi(x) = psi(1 - x) - pi / tan(pi x) below 1/2, the recurrence psi(x) = psi(x + 1) - 1/x up to
// 6, then the asymptotic series (Abramowitz & Stegun 6.3.18). NaN at the poles (0, -1, -2, ...)
// and at -inf, as XLA's (jax.lax.digamma); +inf at +inf.
float Digamma(float v) {
  double x = v, result = 0.0;
  if (x <= 0.0 && x == std::floor(x)) return std::numeric_limits<float>::quiet_NaN();
  if (x < 0.5) {
    result = -M_PI / std::tan(M_PI * x);
    x = 1.0 - x;
  }
  for (; x < 6.0; x += 1.0) result -= 1.0 / x;
  const double f = 1.0 / (x * x);
  const double tail =
      f * (1.0 / 12 - f * (1.0 / 120 - f * (1.0 / 252 - f * (1.0 / 240 - f * (1.0 / 132)))));
  return static_cast<float>(result + std::log(x) - 0.5 / x - tail);
}

// log|Gamma(x)| through glibc's reentrant lgammaf_r (lgammaf writes the global signgam).
float LogAbsGamma(float v) {
  int sign;
  return lgammaf_r(v, &sign);
}

// Unary fns oneDNN has no eltwise algorithm for: a loop over libm's (JAX's CPU lowering calls
// the same functions, or its own approximations of them, for these primitives). And log, which
// oneDNN 2.6's eltwise_log computes to about 1.4e-6 absolute, not relative: log(1.0001) was 1.4%
// off, so a small cross-entropy lost its digits; libm's logf is within an ulp.
const std::map<std::string, float (*)(float)>& LibmFns() {
  static const auto* fns = new std::map<std::string, float (*)(float)>{
      {"log", [](float v) { return std::log(v); }},
      {"erf", [](float v) { return std::erf(v); }},
      {"erfc", [](float v) { return std::erfc(v); }},
      {"sin", [](float v) { return std::sin(v); }},
      {"cos", [](float v) { return std::cos(v); }},
      {"tan", [](float v) { return std::tan(v); }},
      {"atan", [](float v) { return std::atan(v); }},
      {"asin", [](float v) { return std::asin(v); }},
      {"acos", [](float v) { return std::acos(v); }},
      {"sinh", [](float v) { return std::sinh(v); }},
      {"cosh", [](float v) { return std::cosh(v); }},
      {"atanh", [](float v) { return std::atanh(v); }},
      {"asinh", [](float v) { return std::asinh(v); }},
      {"acosh", [](float v) { return std::acosh(v); }},
      {"lgamma", LogAbsGamma},
      {"digamma", Digamma},
      {"log1p", [](float v) { return std::log1p(v); }},
      {"expm1", [](float v) { return std::expm1(v); }},
      {"exp2", [](float v) { return std::exp2(v); }},
      {"floor", [](float v) { return std::floor(v); }},
      {"ceil", [](float v) { return std::ceil(v); }},
      {"round_even", [](float v) { return std::nearbyint(v); }},  // the default rounding mode
      {"round_away", [](float v) { return std::round(v); }},
      {"erf_inv", [](float v) { return ErfInv(v); }}};  // XLA's polynomial
  return *fns;
}

// The elementwise fns below choose between values by bit masks rather than `?:`: GCC moves the
// arithmetic feeding a `?:` into a branch (where an FP op may trap, it then cannot make it
// branch-free again), which keeps the loops that call them from vectorising.
__attribute__((always_inline)) inline float Select(bool c, float a, float b) {
  const uint32_t m = c ? ~0u : 0u;
  return absl::bit_cast<float>((absl::bit_cast<uint32_t>(a) & m) |
                               (absl::bit_cast<uint32_t>(b) & ~m));
}

// x within [lo, hi] (x itself when NaN).
__attribute__((always_inline)) inline float Clamp(float x, float lo, float hi) {
  return Select(x < lo, lo, Select(x > hi, hi, x));
}

// XLA's CPU backend flushes denormal results to zero (its threads run with FTZ), keeping the sign.
__attribute__((always_inline)) inline float FlushDenormal(float v) {
  const float zero = absl::bit_cast<float>(absl::bit_cast<uint32_t>(v) & 0x80000000u);
  return Select(std::fabs(v) < std::numeric_limits<float>::min(), zero, v);
}

// jnp.tanh as XLA's CPU backend computes it (xla/codegen/intrinsic/tanh.cc, f32 with FMA):
// x itself below 4e-4 in magnitude, +-1 from 20 on, else a rational function of x clamped to
// +-7.99881172, evaluated by Horner's rule in fused multiply-adds. Bitwise equal to jax.jit's
// tanh on x86 (checked on 310k inputs), where oneDNN's eltwise_tanh differs by a few ulps and
// does not saturate to exactly 1 (1 - tanh(x)^2, GELU's tail, then differ from JAX's by far more
// than an ulp). always_inline: each loop below compiles it for its own instruction set.
__attribute__((always_inline)) inline float XlaTanh(float x) {
  constexpr float kClamp = 7.99881172180175781f;
  const float a = std::fabs(x);
  const float c = Clamp(x, -kClamp, kClamp);
  const float c2 = c * c;
  float p = -2.76076847742355e-16f;
  p = __builtin_fmaf(c2, p, 2.00018790482477e-13f);
  p = __builtin_fmaf(c2, p, -8.60467152213735e-11f);
  p = __builtin_fmaf(c2, p, 5.12229709037114e-08f);
  p = __builtin_fmaf(c2, p, 1.48572235717979e-05f);
  p = __builtin_fmaf(c2, p, 6.37261928875436e-04f);
  p = __builtin_fmaf(c2, p, 4.89352455891786e-03f);
  float q = 1.19825839466702e-06f;
  q = __builtin_fmaf(c2, q, 1.18534705686654e-04f);
  q = __builtin_fmaf(c2, q, 2.26843463243900e-03f);
  q = __builtin_fmaf(c2, q, 4.89352518554385e-03f);
  const float t = Select(a >= 20.0f, std::copysign(1.0f, x), c * p / q);
  return Select(a < 0.0004f || x != x, x, t);
}

// jnp.exp as XLA's CPU backend computes it: Cephes' range reduction x = n ln 2 + r (ln 2 in two
// parts) and degree-7 polynomial, in FMAs, scaled by 2^n, denormals flushed to zero. Bitwise
// jax.jit's for |x| < 88.4 (checked on 400k inputs); between 88.4 and 88.72 up to an ulp apart
// (XLA scales by 2^128 otherwise), then +inf. (floor of t as an integer: t is in [-150, 130).)
__attribute__((always_inline)) inline float XlaExp(float x) {
  const float c = Clamp(Select(x != x, 0.0f, x), -104.0f, 89.0f);
  const float t = __builtin_fmaf(c, 1.44269504088896341f, 0.5f);
  const int truncated = static_cast<int>(t);
  const int k = truncated - static_cast<int>(static_cast<float>(truncated) > t);  // floor(t)
  const float n = static_cast<float>(k);
  float r = __builtin_fmaf(n, -0.693359375f, c);
  r = __builtin_fmaf(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = __builtin_fmaf(p, r, 1.3981999507e-3f);
  p = __builtin_fmaf(p, r, 8.3334519073e-3f);
  p = __builtin_fmaf(p, r, 4.1665795894e-2f);
  p = __builtin_fmaf(p, r, 1.6666665459e-1f);
  p = __builtin_fmaf(p, r, 5.0000001201e-1f);
  const float y = __builtin_fmaf(p, r * r, r) + 1.0f;
  return Select(x != x, x, FlushDenormal(ScaleByPowerOfTwo(y, k)));
}

// jax.nn.sigmoid as JAX lowers it, 1 / (1 + exp(-x)), on XLA's exp; a denormal result is 0.
__attribute__((always_inline)) inline float XlaLogistic(float x) {
  return FlushDenormal(1.0f / (1.0f + XlaExp(-x)));
}

template <float (*F)(float)>
__attribute__((target("avx2,fma"))) void LoopFma(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = F(x[i]);
}

template <float (*F)(float)>
void LoopBaseline(const float* x, float* y, int64_t n) {  // fmaf: correctly rounded anywhere
  for (int64_t i = 0; i < n; ++i) y[i] = F(x[i]);
}

// y = F(x) over f32, in a loop compiled for AVX2 with FMA where the CPU has them (the same bits
// either way: every fused multiply-add is rounded once).
template <float (*F)(float)>
class XlaUnaryKernel : public Kernel {
 public:
  XlaUnaryKernel(const Tensor& x, Tensor& y) : x_(x), y_(y) {}
  absl::Status Run() override {
    static const bool fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    (fma ? LoopFma<F> : LoopBaseline<F>)(x_.data<float>(), y_.data<float>(), x_.num_elements());
    return absl::OkStatus();
  }

 private:
  const Tensor& x_;
  Tensor& y_;
};

class LibmKernel : public Kernel {
 public:
  LibmKernel(float (*fn)(float), const Tensor& x, Tensor& y) : fn_(fn), x_(x), y_(y) {}
  absl::Status Run() override {
    const float* x = x_.data<float>();
    float* y = y_.data<float>();
    for (int64_t i = 0, n = x_.num_elements(); i < n; ++i) y[i] = fn_(x[i]);
    return absl::OkStatus();
  }

 private:
  float (*fn_)(float);
  const Tensor& x_;
  Tensor& y_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Kernel>> CreateUnary(const std::string& fn, const Tensor& x,
                                                    Tensor& y, float exponent) {
  std::map<std::string, kernels::EltwiseAlg> algs = kernels::EltwiseAlgs();
  algs["pow"] = *kernels::EltwiseAlgOf("pow", exponent);
  auto it = algs.find(fn);
  auto libm = LibmFns().find(fn);
  if (it == algs.end() && libm == LibmFns().end()) {
    std::string more;
    for (const auto& [name, _] : LibmFns()) absl::StrAppend(&more, ", ", name);
    return absl::InvalidArgumentError(
        absl::StrCat("unknown unary fn '", fn, "'; allowed: ", Keys(algs), more));
  }
  if (absl::Status s = RequireF32("unary", x); !s.ok()) return s;
  if (x.dims() != y.dims())
    return absl::InvalidArgumentError("unary: output shape differs from input");
  if (fn == "tanh") return std::unique_ptr<Kernel>(std::make_unique<XlaUnaryKernel<XlaTanh>>(x, y));
  if (fn == "exp") return std::unique_ptr<Kernel>(std::make_unique<XlaUnaryKernel<XlaExp>>(x, y));
  if (fn == "logistic")
    return std::unique_ptr<Kernel>(std::make_unique<XlaUnaryKernel<XlaLogistic>>(x, y));
  if (libm != LibmFns().end())
    return std::unique_ptr<Kernel>(std::make_unique<LibmKernel>(libm->second, x, y));
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
