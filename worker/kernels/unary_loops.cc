// Unary element-wise fns computed by loops rather than oneDNN's eltwise primitive (kernel.h's
// CreateLoopUnary): tanh, exp and logistic as XLA's CPU backend computes them, libm's functions,
// XLA's erf_inv polynomial, and round_bf16.
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/casts.h"
#include "core/collectives/reduce_kernels.h"
#include "core/float_ops.h"
#include "core/random/threefry.h"
#include "worker/kernels/kernel.h"

namespace meshrun {
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

// lax.neg: the sign bit flipped, a NaN's too (oneDNN's eltwise_linear with alpha -1 multiplies,
// which keeps a NaN's sign).
__attribute__((always_inline)) inline float Neg(float x) { return -x; }

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

// y = RoundToBf16(x) (core/float_ops.h): "round_bf16", a convert to bf16 and back in one pass.
class RoundToBf16Kernel : public Kernel {
 public:
  RoundToBf16Kernel(const Tensor& x, Tensor& y) : x_(x), y_(y) {}
  absl::Status Run() override {
    RoundToBf16(x_.data<float>(), y_.data<float>(), x_.num_elements());
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

bool IsLoopUnary(const std::string& fn) {
  return fn == "tanh" || fn == "exp" || fn == "logistic" || fn == "round_bf16" || fn == "neg" ||
         LibmFns().count(fn) > 0;
}

std::vector<std::string> LoopUnaryFns() {
  std::vector<std::string> fns = {"tanh", "exp", "logistic", "round_bf16", "neg"};
  for (const auto& [name, _] : LibmFns()) fns.push_back(name);
  return fns;
}

std::unique_ptr<Kernel> CreateLoopUnary(const std::string& fn, const Tensor& x, Tensor& y) {
  if (fn == "tanh") return std::make_unique<XlaUnaryKernel<XlaTanh>>(x, y);
  if (fn == "exp") return std::make_unique<XlaUnaryKernel<XlaExp>>(x, y);
  if (fn == "logistic") return std::make_unique<XlaUnaryKernel<XlaLogistic>>(x, y);
  if (fn == "round_bf16") return std::make_unique<RoundToBf16Kernel>(x, y);
  if (fn == "neg") return std::make_unique<XlaUnaryKernel<Neg>>(x, y);
  auto libm = LibmFns().find(fn);
  if (libm == LibmFns().end()) return nullptr;
  return std::make_unique<LibmKernel>(libm->second, x, y);
}

}  // namespace meshrun
