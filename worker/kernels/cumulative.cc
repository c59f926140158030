// Reductions as loops: cumulative ones along one dim (jax.lax.cumsum, cumprod, cummax, cummin),
// as oneDNN has no scan primitive, and max / min over dims (reduce_max, reduce_min), whose NaN
// oneDNN's reduction primitive drops (core/float_ops.h).
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/float_ops.h"
#include "worker/kernels/kernel.h"

namespace meshrun {
namespace {

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
    const float* x = x_.data<float>();
    float* y = y_.data<float>();
    for (int64_t o = 0; o < outer_; ++o) {
      const int64_t base = o * n_ * inner_;
      for (int64_t k = 0; k < n_; ++k) {
        const int64_t i = reverse_ ? n_ - 1 - k : k;
        const float* xi = x + base + i * inner_;
        float* yi = y + base + i * inner_;
        if (k == 0) {
          std::copy(xi, xi + inner_, yi);
          continue;
        }
        const float* prev = y + base + (reverse_ ? i + 1 : i - 1) * inner_;
        for (int64_t j = 0; j < inner_; ++j) yi[j] = Combine(prev[j], xi[j]);
      }
    }
    return absl::OkStatus();
  }

 private:
  float Combine(float acc, float v) const {
    switch (fn_) {
      case 0:
        return acc + v;
      case 1:
        return acc * v;
      case 2:
        return NanPropagatingMax(acc, v);
      default:
        return NanPropagatingMin(acc, v);
    }
  }

  int fn_;
  bool reverse_;
  const Tensor& x_;
  Tensor& y_;
  int64_t outer_ = 1, n_ = 1, inner_ = 1;
};

// out = the max (or min) of x over the dims where out has size 1, NaN-propagating. The last dim
// is a contiguous run: folded element-wise into out's row when kept, into one value when reduced.
class ExtremeReduceKernel : public Kernel {
 public:
  ExtremeReduceKernel(bool max, const Tensor& x, Tensor& out) : max_(max), x_(x), out_(out) {}

  absl::Status Run() override {
    const Dims& xd = x_.dims();
    const Dims& od = out_.dims();
    const size_t r = xd.size();
    float* out = out_.data<float>();
    std::fill_n(out, out_.num_elements(), max_ ? -INFINITY : INFINITY);
    std::vector<int64_t> stride(r, 0);  // out's stride along each dim of x (0 where reduced)
    for (size_t d = r, s = 1; d-- > 0; s *= od[d]) stride[d] = od[d] == 1 ? 0 : s;
    const int64_t run = xd[r - 1];
    const bool kept = stride[r - 1] != 0;
    std::vector<int64_t> index(r, 0);  // over x's dims but the last
    const float* x = x_.data<float>();
    for (int64_t at = 0, n = x_.num_elements(); at < n; at += run) {
      int64_t j = 0;
      for (size_t d = 0; d + 1 < r; ++d) j += index[d] * stride[d];
      if (kept) {
        for (int64_t i = 0; i < run; ++i) out[j + i] = Combine(out[j + i], x[at + i]);
      } else {
        float acc = out[j];
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
  float Combine(float a, float b) const {
    return max_ ? NanPropagatingMax(a, b) : NanPropagatingMin(a, b);
  }

  bool max_;
  const Tensor& x_;
  Tensor& out_;
};

}  // namespace

std::unique_ptr<Kernel> CreateExtremeReduce(bool max, const Tensor& x, Tensor& out) {
  return std::make_unique<ExtremeReduceKernel>(max, x, out);
}

absl::StatusOr<std::unique_ptr<Kernel>> CreateCumulative(const std::string& fn, int64_t dim,
                                                         bool reverse, const Tensor& x, Tensor& y) {
  const int code = fn == "sum" ? 0 : fn == "prod" ? 1 : fn == "max" ? 2 : fn == "min" ? 3 : -1;
  if (code < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown cumulative fn '", fn, "'; allowed: sum prod max min"));
  }
  if (x.dtype() != v1::DTYPE_F32 || y.dtype() != v1::DTYPE_F32 || x.dims() != y.dims() || dim < 0 ||
      dim >= static_cast<int64_t>(x.dims().size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("cumulative ", fn, " along dim ", dim, ": x ", DTypeName(x.dtype()),
                     DimsToString(x.dims()), ", y ", DTypeName(y.dtype()), DimsToString(y.dims()),
                     "; expected f32 of one shape and a dim of it"));
  }
  return std::unique_ptr<Kernel>(std::make_unique<CumulativeKernel>(code, dim, reverse, x, y));
}

}  // namespace meshrun
