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

// out = Fn(a, b) element-wise in T, b broadcast over a's dims of size 1. Fn is a template
// argument, so each fn's loop is compiled on its own (inlined, vectorised where it can be) rather
// than calling through a pointer per element. Broadcasting walks a's rows (its last dim): b's row
// is found once per row, and read along it, or held as one value where b's last dim is 1.
template <typename T, T (*Fn)(T, T)>
class BroadcastLoopKernel : public Kernel {
 public:
  BroadcastLoopKernel(const Tensor& a, const Tensor& b, Tensor& out) : a_(a), b_(b), out_(out) {}
  absl::Status Run() override {
    const T* a = a_.data<T>();
    const T* b = b_.data<T>();
    T* out = out_.data<T>();
    const int64_t n = a_.num_elements();
    const Dims& ad = a_.dims();
    const Dims& bd = b_.dims();
    if (bd == ad) {
      for (int64_t i = 0; i < n; ++i) out[i] = Fn(a[i], b[i]);
      return absl::OkStatus();
    }
    if (b_.num_elements() == 1) {
      const T v = b[0];
      for (int64_t i = 0; i < n; ++i) out[i] = Fn(a[i], v);
      return absl::OkStatus();
    }
    // (a has rank >= 1 here: a scalar a has a scalar b, caught above.)
    const size_t rank = ad.size();
    const int64_t len = ad[rank - 1];
    if (len == 0) return absl::OkStatus();
    std::vector<int64_t> index(rank - 1, 0);  // of the row, over a's leading dims
    for (int64_t row = 0; row < n / len; ++row) {
      int64_t j = 0;  // b's flat index of the row's first element
      for (size_t d = 0; d + 1 < rank; ++d) j = j * bd[d] + (bd[d] == 1 ? 0 : index[d]);
      j *= bd[rank - 1];
      const T* x = a + row * len;
      T* y = out + row * len;
      if (bd[rank - 1] == 1) {
        const T v = b[j];
        for (int64_t k = 0; k < len; ++k) y[k] = Fn(x[k], v);
      } else {
        const T* z = b + j;
        for (int64_t k = 0; k < len; ++k) y[k] = Fn(x[k], z[k]);
      }
      for (size_t d = rank - 1; d-- > 0;) {
        if (++index[d] < ad[d]) break;
        index[d] = 0;
      }
    }
    return absl::OkStatus();
  }

 private:
  const Tensor& a_;
  const Tensor& b_;
  Tensor& out_;
};

using LoopFactory = std::unique_ptr<Kernel> (*)(const Tensor&, const Tensor&, Tensor&);

template <typename T, T (*Fn)(T, T)>
std::unique_ptr<Kernel> MakeLoop(const Tensor& a, const Tensor& b, Tensor& out) {
  return std::make_unique<BroadcastLoopKernel<T, Fn>>(a, b, out);
}

float Add(float x, float y) { return x + y; }
float Sub(float x, float y) { return x - y; }
float Mul(float x, float y) { return x * y; }
float Div(float x, float y) { return x / y; }
float Pow(float x, float y) { return std::pow(x, y); }
float NextAfter(float x, float y) { return std::nextafter(x, y); }
float Fmod(float x, float y) { return std::fmod(x, y); }
float Atan2(float x, float y) { return std::atan2(x, y); }
float FloatEq(float x, float y) { return x == y ? 1.0f : 0.0f; }
float FloatNe(float x, float y) { return x != y ? 1.0f : 0.0f; }
float FloatLt(float x, float y) { return x < y ? 1.0f : 0.0f; }
float FloatLe(float x, float y) { return x <= y ? 1.0f : 0.0f; }
float FloatGt(float x, float y) { return x > y ? 1.0f : 0.0f; }
float FloatGe(float x, float y) { return x >= y ? 1.0f : 0.0f; }

const std::map<std::string, LoopFactory>& FloatFns() {
  using F = float;
  static const auto* fns =
      new std::map<std::string, LoopFactory>{{"pow", &MakeLoop<F, &Pow>},
                                             {"nextafter", &MakeLoop<F, &NextAfter>},
                                             {"rem", &MakeLoop<F, &Fmod>},
                                             {"atan2", &MakeLoop<F, &Atan2>},
                                             {"max", &MakeLoop<F, &NanPropagatingMax>},
                                             {"min", &MakeLoop<F, &NanPropagatingMin>},
                                             {"eq", &MakeLoop<F, &FloatEq>},
                                             {"ne", &MakeLoop<F, &FloatNe>},
                                             {"lt", &MakeLoop<F, &FloatLt>},
                                             {"le", &MakeLoop<F, &FloatLe>},
                                             {"gt", &MakeLoop<F, &FloatGt>},
                                             {"ge", &MakeLoop<F, &FloatGe>}};
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
struct Int {
  using U = uint32_t;
  static T Add(T x, T y) { return static_cast<T>(U(x) + U(y)); }
  static T Sub(T x, T y) { return static_cast<T>(U(x) - U(y)); }
  static T Mul(T x, T y) { return static_cast<T>(U(x) * U(y)); }
  static T Max(T x, T y) { return x > y ? x : y; }
  static T Min(T x, T y) { return x < y ? x : y; }
  static T And(T x, T y) { return static_cast<T>(x & y); }
  static T Or(T x, T y) { return static_cast<T>(x | y); }
  static T Xor(T x, T y) { return static_cast<T>(x ^ y); }
  static T Eq(T x, T y) { return static_cast<T>(x == y); }
  static T Ne(T x, T y) { return static_cast<T>(x != y); }
  static T Lt(T x, T y) { return static_cast<T>(x < y); }
  static T Le(T x, T y) { return static_cast<T>(x <= y); }
  static T Gt(T x, T y) { return static_cast<T>(x > y); }
  static T Ge(T x, T y) { return static_cast<T>(x >= y); }
  static T ShiftLeft(T x, T y) { return U(y) >= 32 ? T(0) : static_cast<T>(U(x) << U(y)); }
  static T ShiftRightLogical(T x, T y) { return U(y) >= 32 ? T(0) : static_cast<T>(U(x) >> U(y)); }
  static T ShiftRightArithmetic(T x, T y) {
    const int32_t s = static_cast<int32_t>(x);
    return static_cast<T>(U(y) >= 32 ? (s < 0 ? -1 : 0) : s >> U(y));
  }
};

template <typename T>
const std::map<std::string, LoopFactory>& IntegerFns() {
  using I = Int<T>;
  static const auto* fns = new std::map<std::string, LoopFactory>{
      {"add", &MakeLoop<T, &I::Add>},
      {"sub", &MakeLoop<T, &I::Sub>},
      {"mul", &MakeLoop<T, &I::Mul>},
      {"div", &MakeLoop<T, &IntegerDiv<T>>},
      {"rem", &MakeLoop<T, &IntegerRem<T>>},
      {"max", &MakeLoop<T, &I::Max>},
      {"min", &MakeLoop<T, &I::Min>},
      {"and", &MakeLoop<T, &I::And>},
      {"or", &MakeLoop<T, &I::Or>},
      {"xor", &MakeLoop<T, &I::Xor>},
      {"eq", &MakeLoop<T, &I::Eq>},
      {"ne", &MakeLoop<T, &I::Ne>},
      {"lt", &MakeLoop<T, &I::Lt>},
      {"le", &MakeLoop<T, &I::Le>},
      {"gt", &MakeLoop<T, &I::Gt>},
      {"ge", &MakeLoop<T, &I::Ge>},
      {"shift_left", &MakeLoop<T, &I::ShiftLeft>},
      {"shift_right_logical", &MakeLoop<T, &I::ShiftRightLogical>},
      {"shift_right_arithmetic", &MakeLoop<T, &I::ShiftRightArithmetic>}};
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

absl::StatusOr<std::unique_ptr<Kernel>> CreateArithmeticLoop(const std::string& fn, const Tensor& a,
                                                             const Tensor& b, Tensor& out) {
  static const auto* fns = new std::map<std::string, LoopFactory>{{"add", &MakeLoop<float, &Add>},
                                                                  {"sub", &MakeLoop<float, &Sub>},
                                                                  {"mul", &MakeLoop<float, &Mul>},
                                                                  {"div", &MakeLoop<float, &Div>}};
  auto it = fns->find(fn);
  if (it == fns->end() || a.dtype() != v1::DTYPE_F32 || b.dtype() != v1::DTYPE_F32 ||
      out.dtype() != v1::DTYPE_F32) {
    return absl::InvalidArgumentError(
        absl::StrCat("arithmetic loop ", fn, " over ", DTypeName(a.dtype()), " and ",
                     DTypeName(b.dtype()), "; expected add, sub, mul or div over f32"));
  }
  return it->second(a, b, out);
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
  const std::map<std::string, LoopFactory>* fns = dt == v1::DTYPE_F32   ? &FloatFns()
                                                  : dt == v1::DTYPE_I32 ? &IntegerFns<int32_t>()
                                                  : dt == v1::DTYPE_U32 ? &IntegerFns<uint32_t>()
                                                                        : nullptr;
  if (fns != nullptr) {
    auto it = fns->find(fn);
    if (it != fns->end()) return it->second(a, b, out);
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown binary fn '", fn, "' for ", DTypeName(dt),
                                                 "; allowed: ", LoopBinaryFns(dt)));
}

}  // namespace meshrun
