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

// Calls fn(i, idx) for every element i of `dims` in row-major order, idx its coordinates.
template <typename Fn>
void ForEachIndex(const Dims& dims, int64_t count, Fn fn) {
  std::vector<int64_t> idx(dims.size(), 0);
  for (int64_t i = 0; i < count; ++i) {
    fn(i, idx);
    for (int d = static_cast<int>(dims.size()) - 1; d >= 0; --d) {
      if (++idx[d] < dims[d]) break;
      idx[d] = 0;
    }
  }
}

// Copies out's elements from x, element i from the x offset `source(idx)` (in elements).
template <typename Source>
void Gather(const Tensor& x, Tensor& out, Source source) {
  const size_t elem = DTypeSize(x.dtype());
  const char* src = static_cast<const char*>(x.raw());
  char* dst = static_cast<char*>(out.raw());
  ForEachIndex(out.dims(), out.num_elements(), [&](int64_t i, const std::vector<int64_t>& idx) {
    std::memcpy(dst + i * elem, src + source(idx) * elem, elem);
  });
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
  const std::vector<int64_t> xs = Strides(x.dims());
  Gather(x, out, [&](const std::vector<int64_t>& idx) {
    int64_t flat = 0;
    for (size_t d = 0; d < idx.size(); ++d) flat += (x.dims()[d] == 1 ? 0 : idx[d]) * xs[d];
    return flat;
  });
}

void Transpose(const Tensor& x, const std::vector<int64_t>& perm, Tensor& out) {
  const std::vector<int64_t> xs = Strides(x.dims());
  Gather(x, out, [&](const std::vector<int64_t>& idx) {
    int64_t flat = 0;
    for (size_t d = 0; d < idx.size(); ++d) flat += idx[d] * xs[perm[d]];
    return flat;
  });
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
  const std::vector<int64_t> xs = Strides(x.dims());
  Gather(x, out, [&](const std::vector<int64_t>& idx) {
    int64_t flat = 0;
    for (size_t d = 0; d < idx.size(); ++d) flat += (starts[d] + idx[d]) * xs[d];
    return flat;
  });
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
