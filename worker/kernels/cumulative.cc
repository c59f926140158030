// Reductions as loops: cumulative ones along one dim (jax.lax.cumsum, cumprod, cummax, cummin,
// cumlogsumexp),
// as oneDNN has no scan primitive; f32 max / min over dims (reduce_max, reduce_min), whose NaN
// oneDNN's reduction primitive drops (core/float_ops.h); and integer sum / max / min, which
// oneDNN's f32 reduction would round above 2^24.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/float_ops.h"
#include "worker/kernels/kernel.h"

namespace meshrun {
namespace {

// T: float, or int32_t / uint32_t (sum and prod wrapping modulo 2^32).
template <typename T>
class CumulativeKernel : public Kernel {
 public:
  CumulativeKernel(int fn, int64_t dim, bool reverse, const Tensor& x, Tensor& y)
      : fn_(fn), reverse_(reverse), x_(x), y_(y) {
    const Dims& d = x.dims();
    outer_ = 1;
    for (int64_t i = 0; i < dim; ++i) outer_ *= d[i];
    n_ = d[dim];
    inner_ = 1;
    for (size_t i = dim + 1; i < d.size(); ++i) inner_ *= d[i];
  }

  absl::Status Run() override {
    const T* x = x_.data<T>();
    T* y = y_.data<T>();
    for (int64_t o = 0; o < outer_; ++o) {
      const int64_t base = o * n_ * inner_;
      for (int64_t k = 0; k < n_; ++k) {
        const int64_t i = reverse_ ? n_ - 1 - k : k;
        const T* xi = x + base + i * inner_;
        T* yi = y + base + i * inner_;
        if (k == 0) {
          std::copy(xi, xi + inner_, yi);
          continue;
        }
        const T* prev = y + base + (reverse_ ? i + 1 : i - 1) * inner_;
        for (int64_t j = 0; j < inner_; ++j) yi[j] = Combine(prev[j], xi[j]);
      }
    }
    return absl::OkStatus();
  }

 private:
  T Combine(T acc, T v) const {
    if constexpr (std::is_floating_point_v<T>) {
      switch (fn_) {
        case 0:
          return acc + v;
        case 1:
          return acc * v;
        case 2:
          return NanPropagatingMax(acc, v);
        case 3:
          return NanPropagatingMin(acc, v);
        default:
          return LogAddExp(acc, v);
      }
    } else {
      switch (fn_) {
        case 0:
          return static_cast<T>(uint32_t(acc) + uint32_t(v));
        case 1:
          return static_cast<T>(uint32_t(acc) * uint32_t(v));
        case 2:
          return std::max(acc, v);
        default:
          return std::min(acc, v);
      }
    }
  }

  // jnp.logaddexp's definition: max(a, b) + log1p(exp(-|a - b|)), and a + b where a - b is NaN
  // (a NaN operand, or infinities of one sign: -inf stays -inf, +inf stays +inf).
  static float LogAddExp(float a, float b) {
    const float delta = a - b;
    if (std::isnan(delta)) return a + b;
    return std::max(a, b) + std::log1p(std::exp(-std::abs(delta)));
  }

  int fn_;
  bool reverse_;
  const Tensor& x_;
  Tensor& y_;
  int64_t outer_ = 1, n_ = 1, inner_ = 1;
};

enum class LoopReduction { kSum, kMax, kMin };

// out = the sum, max or min of x (T) over the dims where out has size 1: f32 max / min
// NaN-propagating, integer sums wrapping modulo 2^32. The last dim is a contiguous run: folded
// element-wise into out's row when kept, into one value when reduced.
template <typename T>
class LoopReduceKernel : public Kernel {
 public:
  LoopReduceKernel(LoopReduction fn, const Tensor& x, Tensor& out) : fn_(fn), x_(x), out_(out) {}

  absl::Status Run() override {
    const Dims& xd = x_.dims();
    const Dims& od = out_.dims();
    const size_t r = xd.size();
    T* out = out_.data<T>();
    if (r == 0) {  // a scalar: itself
      out[0] = x_.data<T>()[0];
      return absl::OkStatus();
    }
    std::fill_n(out, out_.num_elements(), Identity());
    std::vector<int64_t> stride(r, 0);  // out's stride along each dim of x (0 where reduced)
    for (size_t d = r, s = 1; d-- > 0; s *= od[d]) stride[d] = od[d] == 1 ? 0 : s;
    const int64_t run = xd[r - 1];
    const bool kept = stride[r - 1] != 0;
    std::vector<int64_t> index(r, 0);  // over x's dims but the last
    const T* x = x_.data<T>();
    for (int64_t at = 0, n = x_.num_elements(); at < n; at += run) {
      int64_t j = 0;
      for (size_t d = 0; d + 1 < r; ++d) j += index[d] * stride[d];
      if (kept) {
        for (int64_t i = 0; i < run; ++i) out[j + i] = Combine(out[j + i], x[at + i]);
      } else {
        T acc = out[j];
        for (int64_t i = 0; i < run; ++i) acc = Combine(acc, x[at + i]);
        out[j] = acc;
      }
      for (size_t d = r - 1; d-- > 0;) {
        if (++index[d] < xd[d]) break;
        index[d] = 0;
      }
    }
    return absl::OkStatus();
  }

 private:
  T Identity() const {
    if (fn_ == LoopReduction::kSum) return T(0);
    if constexpr (std::is_floating_point_v<T>)
      return fn_ == LoopReduction::kMax ? -INFINITY : INFINITY;
    return fn_ == LoopReduction::kMax ? std::numeric_limits<T>::lowest()
                                      : std::numeric_limits<T>::max();
  }
  T Combine(T a, T b) const {
    if constexpr (std::is_floating_point_v<T>) {
      if (fn_ == LoopReduction::kSum) return a + b;
      return fn_ == LoopReduction::kMax ? NanPropagatingMax(a, b) : NanPropagatingMin(a, b);
    } else {
      if (fn_ == LoopReduction::kSum) return static_cast<T>(uint32_t(a) + uint32_t(b));
      return fn_ == LoopReduction::kMax ? std::max(a, b) : std::min(a, b);
    }
  }

  LoopReduction fn_;
  const Tensor& x_;
  Tensor& out_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Kernel>> CreateLoopReduce(const std::string& fn, const Tensor& x,
                                                         Tensor& out) {
  const DType dt = x.dtype();
  const bool integral = dt == v1::DTYPE_I32 || dt == v1::DTYPE_U32;
  const LoopReduction r = fn == "sum"   ? LoopReduction::kSum
                          : fn == "max" ? LoopReduction::kMax
                                        : LoopReduction::kMin;
  if (!((integral && (fn == "sum" || fn == "max" || fn == "min")) ||
        (dt == v1::DTYPE_F32 && (fn == "max" || fn == "min")))) {
    return absl::InvalidArgumentError(absl::StrCat("reduce ", fn, " of ", DTypeName(dt),
                                                   " as a loop; expected max or min of f32, or "
                                                   "sum, max or min of i32 or u32"));
  }
  switch (dt) {
    case v1::DTYPE_I32:
      return std::unique_ptr<Kernel>(std::make_unique<LoopReduceKernel<int32_t>>(r, x, out));
    case v1::DTYPE_U32:
      return std::unique_ptr<Kernel>(std::make_unique<LoopReduceKernel<uint32_t>>(r, x, out));
    default:
      return std::unique_ptr<Kernel>(std::make_unique<LoopReduceKernel<float>>(r, x, out));
  }
}

absl::StatusOr<std::unique_ptr<Kernel>> CreateCumulative(const std::string& fn, int64_t dim,
                                                         bool reverse, const Tensor& x, Tensor& y) {
  const int code = fn == "sum"         ? 0
                   : fn == "prod"      ? 1
                   : fn == "max"       ? 2
                   : fn == "min"       ? 3
                   : fn == "logsumexp" ? 4
                                       : -1;
  if (code < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown cumulative fn '", fn, "'; allowed: sum prod max min logsumexp"));
  }
  const DType dt = x.dtype();
  if (code == 4 && dt != v1::DTYPE_F32) {
    return absl::InvalidArgumentError(absl::StrCat("cumulative logsumexp of ", DTypeName(dt),
                                                   "; expected f32 (as lax.cumlogsumexp)"));
  }
  if ((dt != v1::DTYPE_F32 && dt != v1::DTYPE_I32 && dt != v1::DTYPE_U32) || y.dtype() != dt ||
      x.dims() != y.dims() || dim < 0 || dim >= static_cast<int64_t>(x.dims().size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("cumulative ", fn, " along dim ", dim, ": x ", DTypeName(x.dtype()),
                     DimsToString(x.dims()), ", y ", DTypeName(y.dtype()), DimsToString(y.dims()),
                     "; expected f32, i32 or u32 of one shape and a dim of it"));
  }
  if (dt == v1::DTYPE_I32)
    return std::unique_ptr<Kernel>(
        std::make_unique<CumulativeKernel<int32_t>>(code, dim, reverse, x, y));
  if (dt == v1::DTYPE_U32)
    return std::unique_ptr<Kernel>(
        std::make_unique<CumulativeKernel<uint32_t>>(code, dim, reverse, x, y));
  return std::unique_ptr<Kernel>(
      std::make_unique<CumulativeKernel<float>>(code, dim, reverse, x, y));
}

}  // namespace meshrun
