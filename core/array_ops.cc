#include "core/array_ops.h"

#include <cstring>

#include "core/collectives/reduce_kernels.h"

namespace meshrun {
namespace {

std::vector<int64_t> Strides(const Dims& dims) {
  std::vector<int64_t> s(dims.size(), 1);
  for (int i = static_cast<int>(dims.size()) - 2; i >= 0; --i) s[i] = s[i + 1] * dims[i + 1];
  return s;
}

}  // namespace

void SwapLeadingAxes(const void* src, int64_t a, int64_t b, int64_t inner, size_t elem, void* dst) {
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  const int64_t row = inner * static_cast<int64_t>(elem);
  for (int64_t i = 0; i < a; ++i) {
    for (int64_t j = 0; j < b; ++j) std::memcpy(d + (j * a + i) * row, s + (i * b + j) * row, row);
  }
}

void Broadcast(const Tensor& x, Tensor& out) {
  const size_t elem = DTypeSize(x.dtype());
  const Dims& od = out.dims();
  const std::vector<int64_t> xs = Strides(x.dims());
  const int64_t n = out.num_elements();
  std::vector<int64_t> idx(od.size(), 0);
  const char* src = static_cast<const char*>(x.raw());
  char* dst = static_cast<char*>(out.raw());
  for (int64_t i = 0; i < n; ++i) {
    int64_t flat = 0;
    for (size_t d = 0; d < od.size(); ++d) flat += (x.dims()[d] == 1 ? 0 : idx[d]) * xs[d];
    std::memcpy(dst + i * elem, src + flat * elem, elem);
    for (int d = static_cast<int>(od.size()) - 1; d >= 0; --d) {
      if (++idx[d] < od[d]) break;
      idx[d] = 0;
    }
  }
}

void Transpose(const Tensor& x, const std::vector<int64_t>& perm, Tensor& out) {
  const size_t elem = DTypeSize(x.dtype());
  const std::vector<int64_t> xs = Strides(x.dims());
  const Dims& od = out.dims();
  std::vector<int64_t> idx(od.size(), 0);
  const char* src = static_cast<const char*>(x.raw());
  char* dst = static_cast<char*>(out.raw());
  for (int64_t i = 0; i < out.num_elements(); ++i) {
    int64_t flat = 0;
    for (size_t d = 0; d < od.size(); ++d) flat += idx[d] * xs[perm[d]];
    std::memcpy(dst + i * elem, src + flat * elem, elem);
    for (int d = static_cast<int>(od.size()) - 1; d >= 0; --d) {
      if (++idx[d] < od[d]) break;
      idx[d] = 0;
    }
  }
}

void Concatenate(const std::vector<const Tensor*>& inputs, int64_t dim, Tensor& out) {
  const size_t elem = DTypeSize(out.dtype());
  int64_t outer = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= out.dims()[d];
  const int64_t out_row = out.num_elements() / std::max<int64_t>(1, outer) * static_cast<int64_t>(elem);
  char* dst = static_cast<char*>(out.raw());
  int64_t offset = 0;
  for (const Tensor* t : inputs) {
    const int64_t row = t->num_elements() / std::max<int64_t>(1, outer) * static_cast<int64_t>(elem);
    const char* src = static_cast<const char*>(t->raw());
    for (int64_t o = 0; o < outer; ++o) std::memcpy(dst + o * out_row + offset, src + o * row, row);
    offset += row;
  }
}

void Slice(const Tensor& x, const std::vector<int64_t>& starts, Tensor& out) {
  const size_t elem = DTypeSize(x.dtype());
  const std::vector<int64_t> xs = Strides(x.dims());
  const Dims& od = out.dims();
  std::vector<int64_t> idx(od.size(), 0);
  const char* src = static_cast<const char*>(x.raw());
  char* dst = static_cast<char*>(out.raw());
  for (int64_t i = 0; i < out.num_elements(); ++i) {
    int64_t flat = 0;
    for (size_t d = 0; d < od.size(); ++d) flat += (starts[d] + idx[d]) * xs[d];
    std::memcpy(dst + i * elem, src + flat * elem, elem);
    for (int d = static_cast<int>(od.size()) - 1; d >= 0; --d) {
      if (++idx[d] < od[d]) break;
      idx[d] = 0;
    }
  }
}

double GetAsDouble(const Tensor& x, int64_t i) {
  switch (x.dtype()) {
    case v1::DTYPE_F32: return x.data<float>()[i];
    case v1::DTYPE_BF16: return Bf16ToF32(x.data<uint16_t>()[i]);
    case v1::DTYPE_I32: return x.data<int32_t>()[i];
    case v1::DTYPE_U32: return x.data<uint32_t>()[i];
    default: return 0;
  }
}

void SetFromDouble(Tensor& x, int64_t i, double v) {
  switch (x.dtype()) {
    case v1::DTYPE_F32: x.data<float>()[i] = static_cast<float>(v); break;
    case v1::DTYPE_BF16: x.data<uint16_t>()[i] = F32ToBf16(static_cast<float>(v)); break;
    case v1::DTYPE_I32: x.data<int32_t>()[i] = static_cast<int32_t>(v); break;
    case v1::DTYPE_U32: x.data<uint32_t>()[i] = static_cast<uint32_t>(static_cast<int64_t>(v)); break;
    default: break;
  }
}

void Convert(const Tensor& x, Tensor& out) {
  if (x.dtype() == out.dtype()) {
    std::memcpy(out.raw(), x.raw(), x.size_bytes());
    return;
  }
  for (int64_t i = 0; i < x.num_elements(); ++i) SetFromDouble(out, i, GetAsDouble(x, i));
}

}  // namespace meshrun
