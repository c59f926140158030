// Binary element-wise fns oneDNN's binary primitive lacks, as loops: f32 pow, nextafter, rem
// (C's fmod, as lax.rem), atan2, max / min (NaN-propagating, as XLA's: core/float_ops.h) and the
// comparisons (IEEE's: oneDNN's binary_gt / ge hold for a NaN operand), and integer
// (i32, u32) arithmetic, bitwise ops and shifts with jax.lax's semantics, which JAX's PRNG builds
// its floats from (random bits shifted, or-ed with an exponent, bitcast) and which integer `//` and
// `%` use (lax.div and lax.rem: truncated, with XLA's results for a zero divisor and for INT_MIN /
// -1).
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/float_ops.h"
#include "worker/kernels/kernel.h"

namespace meshrun {
namespace {

// out = fn(a, b) element-wise in T, b broadcast over a's dims of size 1.
template <typename T>
class BroadcastLoopKernel : public Kernel {
 public:
  using Fn = T (*)(T, T);
  BroadcastLoopKernel(Fn fn, const Tensor& a, const Tensor& b, Tensor& out)
      : fn_(fn), a_(a), b_(b), out_(out) {}
  absl::Status Run() override {
    const T* a = a_.data<T>();
    const T* b = b_.data<T>();
    T* out = out_.data<T>();
    const int64_t n = a_.num_elements();
    if (b_.dims() == a_.dims()) {
      for (int64_t i = 0; i < n; ++i) out[i] = fn_(a[i], b[i]);
      return absl::OkStatus();
    }
    const Dims& ad = a_.dims();
    const Dims& bd = b_.dims();
    std::vector<int64_t> index(ad.size(), 0);
    for (int64_t i = 0; i < n; ++i) {
      int64_t j = 0;  // b's flat index of a's element i
      for (size_t d = 0; d < ad.size(); ++d) j = j * bd[d] + (bd[d] == 1 ? 0 : index[d]);
      out[i] = fn_(a[i], b[j]);
      for (size_t d = ad.size(); d-- > 0;) {
        if (++index[d] < ad[d]) break;
        index[d] = 0;
      }
    }
    return absl::OkStatus();
  }

 private:
  Fn fn_;
  const Tensor& a_;
  const Tensor& b_;
  Tensor& out_;
};

const std::map<std::string, float (*)(float, float)>& FloatFns() {
  static const auto* fns = new std::map<std::string, float (*)(float, float)>{
      {"pow", [](float x, float y) { return std::pow(x, y); }},
      {"nextafter", [](float x, float y) { return std::nextafter(x, y); }},
      {"rem", [](float x, float y) { return std::fmod(x, y); }},
      {"atan2", [](float x, float y) { return std::atan2(x, y); }},
      {"max", &NanPropagatingMax},
      {"min", &NanPropagatingMin},
      {"eq", [](float x, float y) { return x == y ? 1.0f : 0.0f; }},
      {"ne", [](float x, float y) { return x != y ? 1.0f : 0.0f; }},
      {"lt", [](float x, float y) { return x < y ? 1.0f : 0.0f; }},
      {"le", [](float x, float y) { return x <= y ? 1.0f : 0.0f; }},
      {"gt", [](float x, float y) { return x > y ? 1.0f : 0.0f; }},
      {"ge", [](float x, float y) { return x >= y ? 1.0f : 0.0f; }}};
  return *fns;
}

// lax.div and lax.rem over T as XLA defines them where C++ does not: x / 0 is -1 (all bits set)
// and x % 0 is x; INT_MIN / -1 is INT_MIN and INT_MIN % -1 is 0 (no overflow trap).
template <typename T>
T IntegerDiv(T x, T y) {
  if (y == 0) return static_cast<T>(-1);
  if (std::is_signed_v<T> && x == std::numeric_limits<T>::min() && y == static_cast<T>(-1))
    return x;
  return x / y;
}

template <typename T>
T IntegerRem(T x, T y) {
  if (y == 0) return x;
  if (std::is_signed_v<T> && x == std::numeric_limits<T>::min() && y == static_cast<T>(-1))
    return 0;
  return x % y;
}

// Integer fns over T (int32_t or uint32_t); arithmetic wraps modulo 2^32, as XLA's does.
template <typename T>
const std::map<std::string, T (*)(T, T)>& IntegerFns() {
  using U = uint32_t;
  static const auto* fns = new std::map<std::string, T (*)(T, T)>{
      {"add", [](T x, T y) { return static_cast<T>(U(x) + U(y)); }},
      {"sub", [](T x, T y) { return static_cast<T>(U(x) - U(y)); }},
      {"mul", [](T x, T y) { return static_cast<T>(U(x) * U(y)); }},
      {"div", &IntegerDiv<T>},
      {"rem", &IntegerRem<T>},
      {"max", [](T x, T y) { return x > y ? x : y; }},
      {"min", [](T x, T y) { return x < y ? x : y; }},
      {"and", [](T x, T y) { return static_cast<T>(x & y); }},
      {"or", [](T x, T y) { return static_cast<T>(x | y); }},
      {"xor", [](T x, T y) { return static_cast<T>(x ^ y); }},
      {"eq", [](T x, T y) { return static_cast<T>(x == y); }},
      {"ne", [](T x, T y) { return static_cast<T>(x != y); }},
      {"lt", [](T x, T y) { return static_cast<T>(x < y); }},
      {"le", [](T x, T y) { return static_cast<T>(x <= y); }},
      {"gt", [](T x, T y) { return static_cast<T>(x > y); }},
      {"ge", [](T x, T y) { return static_cast<T>(x >= y); }},
      {"shift_left", [](T x, T y) { return U(y) >= 32 ? T(0) : static_cast<T>(U(x) << U(y)); }},
      {"shift_right_logical",
       [](T x, T y) { return U(y) >= 32 ? T(0) : static_cast<T>(U(x) >> U(y)); }},
      {"shift_right_arithmetic", [](T x, T y) {
         const int32_t s = static_cast<int32_t>(x);
         return static_cast<T>(U(y) >= 32 ? (s < 0 ? -1 : 0) : s >> U(y));
       }}};
  return *fns;
}

template <typename M>
std::string Names(const M& m) {
  std::string out;
  for (const auto& [name, _] : m) absl::StrAppend(&out, out.empty() ? "" : " ", name);
  return out;
}

}  // namespace

bool IsLoopBinary(const std::string& fn, DType dtype) {
  switch (dtype) {
    case v1::DTYPE_F32:
      return FloatFns().count(fn) > 0;
    case v1::DTYPE_I32:
    case v1::DTYPE_U32:
      return true;  // every integer fn is a loop; CreateLoopBinary names an unknown one
    default:
      return false;
  }
}

std::string LoopBinaryFns(DType dtype) {
  return dtype == v1::DTYPE_F32 ? Names(FloatFns()) : Names(IntegerFns<uint32_t>());
}

absl::StatusOr<std::unique_ptr<Kernel>> CreateLoopBinary(const std::string& fn, const Tensor& a,
                                                         const Tensor& b, Tensor& out) {
  const DType dt = a.dtype();
  if (b.dtype() != dt || out.dtype() != dt) {
    return absl::InvalidArgumentError(
        absl::StrCat("binary ", fn, ": operands ", DTypeName(dt), " and ", DTypeName(b.dtype()),
                     ", output ", DTypeName(out.dtype()), "; expected one dtype (convert first)"));
  }
  switch (dt) {
    case v1::DTYPE_F32: {
      auto it = FloatFns().find(fn);
      if (it == FloatFns().end()) break;
      return std::unique_ptr<Kernel>(
          std::make_unique<BroadcastLoopKernel<float>>(it->second, a, b, out));
    }
    case v1::DTYPE_I32: {
      auto it = IntegerFns<int32_t>().find(fn);
      if (it == IntegerFns<int32_t>().end()) break;
      return std::unique_ptr<Kernel>(
          std::make_unique<BroadcastLoopKernel<int32_t>>(it->second, a, b, out));
    }
    case v1::DTYPE_U32: {
      auto it = IntegerFns<uint32_t>().find(fn);
      if (it == IntegerFns<uint32_t>().end()) break;
      return std::unique_ptr<Kernel>(
          std::make_unique<BroadcastLoopKernel<uint32_t>>(it->second, a, b, out));
    }
    default:
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown binary fn '", fn, "' for ", DTypeName(dt),
                                                 "; allowed: ", LoopBinaryFns(dt)));
}

}  // namespace meshrun
