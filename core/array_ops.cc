#include "core/array_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

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

// Copies `rows` rows of `row` bytes from src (rows `src_stride` bytes apart) to dst (rows
// `dst_stride` apart). Short rows (a concatenation along a few channels) are copied word by word
// in a loop the compiler unrolls, not by a libc call per row.
void CopyRows(const char* src, int64_t src_stride, int64_t rows, int64_t row, char* dst,
              int64_t dst_stride) {
  if (row % 4 != 0 || row > 64) {
    for (int64_t o = 0; o < rows; ++o) std::memcpy(dst + o * dst_stride, src + o * src_stride, row);
    return;
  }
  const int64_t words = row / 4;
  for (int64_t o = 0; o < rows; ++o) {
    char* d = dst + o * dst_stride;
    const char* s = src + o * src_stride;
    for (int64_t w = 0; w < words; ++w) std::memcpy(d + 4 * w, s + 4 * w, 4);
  }
}

// Drops out's dims of size 1 and merges each pair of adjacent dims that walk x as one (a dim
// whose stride is the next dim's stride times its size), so that a slice or a transpose copies
// the longest contiguous runs it has (a [n, h, w, 1] slice: rows of w, not single elements).
void Coalesce(const Dims& out_dims, const std::vector<int64_t>& strides, Dims* dims,
              std::vector<int64_t>* merged) {
  for (size_t d = 0; d < out_dims.size(); ++d) {
    if (out_dims[d] == 1) continue;
    if (!dims->empty() && merged->back() == strides[d] * out_dims[d]) {
      dims->back() *= out_dims[d];
      merged->back() = strides[d];
    } else {
      dims->push_back(out_dims[d]);
      merged->push_back(strides[d]);
    }
  }
}

// Copies out's elements from x: out[idx] = x[base + sum(idx[d] * strides[d])] (offsets in
// elements), over out's dims coalesced. Runs that are contiguous in x (stride 1 along the last
// dim) are copied whole, a row broadcast from one element (stride 0) filled with it, a transposed
// pair of trailing dims in cache-sized tiles, anything else along the last dim at its stride.
template <size_t kElem>
void StridedCopy(const char* src, const std::vector<int64_t>& out_strides, int64_t base,
                 const Dims& raw_dims, char* dst) {
  const int64_t total = NumElements(raw_dims);
  if (total == 0) return;
  Dims out_dims;
  std::vector<int64_t> strides;
  Coalesce(raw_dims, out_strides, &out_dims, &strides);
  const int rank = static_cast<int>(out_dims.size());
  if (rank == 0) {
    std::memcpy(dst, src + base * kElem, kElem);
    return;
  }
  const int64_t inner = out_dims[rank - 1];
  const bool runs = strides[rank - 1] == 1;
  const bool fill = strides[rank - 1] == 0;  // a broadcast along the last dim
  const bool tiles = !runs && !fill && rank >= 2 && strides[rank - 2] == 1;
  const int outer_rank = tiles ? rank - 2 : rank - 1;
  const Dims outer(out_dims.begin(), out_dims.begin() + outer_rank);
  const int64_t block =
      total / std::max<int64_t>(1, NumElements(outer));  // out elements per outer index
  ForEachIndex(outer, NumElements(outer), [&](int64_t o, const std::vector<int64_t>& idx) {
    int64_t from = base;
    for (int d = 0; d < outer_rank; ++d) from += idx[d] * strides[d];
    char* to = dst + o * block * static_cast<int64_t>(kElem);
    if (runs) {
      std::memcpy(to, src + from * kElem, inner * kElem);
    } else if (tiles) {
      // out[i][j] = x[from + i + j * sj]: walk 32 x 32 tiles so both sides stay in cache.
      const int64_t rows = out_dims[rank - 2], sj = strides[rank - 1];
      constexpr int64_t kTile = 32;
      for (int64_t i0 = 0; i0 < rows; i0 += kTile) {
        for (int64_t j0 = 0; j0 < inner; j0 += kTile) {
          for (int64_t i = i0; i < std::min(rows, i0 + kTile); ++i) {
            for (int64_t j = j0; j < std::min(inner, j0 + kTile); ++j)
              std::memcpy(to + (i * inner + j) * kElem, src + (from + i + j * sj) * kElem, kElem);
          }
        }
      }
    } else if (fill) {  // one value along the row
      char value[kElem];
      std::memcpy(value, src + from * kElem, kElem);
      for (int64_t j = 0; j < inner; ++j) std::memcpy(to + j * kElem, value, kElem);
    } else {
      const int64_t s = strides[rank - 1];
      for (int64_t j = 0; j < inner; ++j)
        std::memcpy(to + j * kElem, src + (from + j * s) * kElem, kElem);
    }
  });
}

void Gather(const Tensor& x, const std::vector<int64_t>& strides, int64_t base, Tensor& out) {
  const char* src = static_cast<const char*>(x.raw());
  char* dst = static_cast<char*>(out.raw());
  switch (DTypeSize(x.dtype())) {
    case 2:
      return StridedCopy<2>(src, strides, base, out.dims(), dst);
    case 4:
      return StridedCopy<4>(src, strides, base, out.dims(), dst);
    case 8:
      return StridedCopy<8>(src, strides, base, out.dims(), dst);
    default:
      return StridedCopy<1>(src, strides, base, out.dims(), dst);
  }
}

// out = x (f32 or bf16) converted to the integer T as XLA converts: truncated toward zero,
// saturated at T's range, NaN to 0 (a C++ cast of an out-of-range value is undefined; x86 gives
// INT_MIN).
template <typename T>
void SaturatingConvert(const Tensor& x, Tensor& out) {
  constexpr double kLow = static_cast<double>(std::numeric_limits<T>::lowest());
  constexpr double kHigh = static_cast<double>(std::numeric_limits<T>::max());
  T* dst = out.data<T>();
  for (int64_t i = 0, n = x.num_elements(); i < n; ++i) {
    const double v = GetAsDouble(x, i);
    dst[i] = std::isnan(v) ? T(0)
             : v <= kLow   ? std::numeric_limits<T>::lowest()
             : v >= kHigh  ? std::numeric_limits<T>::max()
                           : static_cast<T>(v);
  }
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
  std::vector<int64_t> strides = Strides(x.dims());
  for (size_t d = 0; d < strides.size(); ++d) {
    if (x.dims()[d] == 1) strides[d] = 0;
  }
  Gather(x, strides, 0, out);
}

void Transpose(const Tensor& x, const std::vector<int64_t>& perm, Tensor& out) {
  const std::vector<int64_t> xs = Strides(x.dims());
  std::vector<int64_t> strides;
  for (int64_t p : perm) strides.push_back(xs[p]);
  Gather(x, strides, 0, out);
}

void Reverse(const Tensor& x, const std::vector<int64_t>& dims, Tensor& out) {
  std::vector<int64_t> strides = Strides(x.dims());
  int64_t base = 0;  // x's offset of out's first element: the last along each reversed dim
  for (int64_t d : dims) {
    base += (x.dims()[d] - 1) * strides[d];
    strides[d] = -strides[d];
  }
  if (x.num_elements() > 0) Gather(x, strides, base, out);
}

void Concatenate(const std::vector<const Tensor*>& inputs, int64_t dim, Tensor& out) {
  const size_t elem = DTypeSize(out.dtype());
  int64_t outer = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= out.dims()[d];
  const int64_t out_row =
      out.num_elements() / std::max<int64_t>(1, outer) * static_cast<int64_t>(elem);
  char* dst = static_cast<char*>(out.raw());
  int64_t offset = 0;
  for (const Tensor* t : inputs) {
    const int64_t row =
        t->num_elements() / std::max<int64_t>(1, outer) * static_cast<int64_t>(elem);
    CopyRows(static_cast<const char*>(t->raw()), row, outer, row, dst + offset, out_row);
    offset += row;
  }
}

void Slice(const Tensor& x, const std::vector<int64_t>& starts, Tensor& out) {
  const std::vector<int64_t> xs = Strides(x.dims());
  int64_t base = 0;
  for (size_t d = 0; d < xs.size(); ++d) base += starts[d] * xs[d];
  Gather(x, xs, base, out);
}

void UpdateSlice(const Tensor& update, const std::vector<int64_t>& starts, Tensor& out) {
  const size_t rank = out.dims().size();
  const size_t elem = DTypeSize(out.dtype());
  if (update.num_elements() == 0) return;
  const char* src = static_cast<const char*>(update.raw());
  char* dst = static_cast<char*>(out.raw());
  if (rank == 0) {
    std::memcpy(dst, src, elem);
    return;
  }
  // Row by row along the last dim.
  const std::vector<int64_t> os = Strides(out.dims());
  const int64_t row = update.dims()[rank - 1];
  const Dims lead(update.dims().begin(), update.dims().end() - 1);
  ForEachIndex(lead, NumElements(lead), [&](int64_t i, const std::vector<int64_t>& idx) {
    int64_t offset = starts[rank - 1];
    for (size_t d = 0; d + 1 < rank; ++d) offset += (starts[d] + idx[d]) * os[d];
    std::memcpy(dst + offset * elem, src + i * row * elem, row * elem);
  });
}

double GetAsDouble(const Tensor& x, int64_t i) {
  switch (x.dtype()) {
    case v1::DTYPE_F32:
      return x.data<float>()[i];
    case v1::DTYPE_BF16:
      return Bf16ToF32(x.data<uint16_t>()[i]);
    case v1::DTYPE_I32:
      return x.data<int32_t>()[i];
    case v1::DTYPE_U32:
      return x.data<uint32_t>()[i];
    case v1::DTYPE_U8:
      return x.data<uint8_t>()[i];
    default:
      return 0;
  }
}

void FillFromDouble(Tensor& x, int64_t begin, int64_t count, double v) {
  if (count <= 0) return;
  SetFromDouble(x, begin, v);
  const size_t width = DTypeSize(x.dtype());
  char* run = static_cast<char*>(x.raw()) + begin * width;
  for (int64_t k = 1; k < count; k *= 2)  // doubling copies of what is set so far
    std::memcpy(run + k * width, run, std::min(k, count - k) * width);
}

void SetFromDouble(Tensor& x, int64_t i, double v) {
  switch (x.dtype()) {
    case v1::DTYPE_F32:
      x.data<float>()[i] = static_cast<float>(v);
      break;
    case v1::DTYPE_BF16:
      x.data<uint16_t>()[i] = F32ToBf16(static_cast<float>(v));
      break;
    case v1::DTYPE_I32:
      x.data<int32_t>()[i] = static_cast<int32_t>(v);
      break;
    case v1::DTYPE_U32:
      x.data<uint32_t>()[i] = static_cast<uint32_t>(static_cast<int64_t>(v));
      break;
    case v1::DTYPE_U8:
      x.data<uint8_t>()[i] = static_cast<uint8_t>(static_cast<int64_t>(v));
      break;
    default:
      break;
  }
}

namespace {

// convert(i, len) over [0, n) in blocks of whole cache lines, shared out over the OpenMP team
// from kConvertParallelMin elements on (a convert of a whole parameter, bf16 compute's cast of
// the f32 masters, is otherwise one thread streaming memory while the team waits).
template <typename F>
void ConvertInBlocks(int64_t n, const F& convert) {
  constexpr int64_t kBlock = 16384;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (n >= kConvertParallelMin)
  for (int64_t b = 0; b < blocks; ++b) {
    convert(b * kBlock, std::min(kBlock, n - b * kBlock));
  }
}

}  // namespace

void Convert(const Tensor& x, Tensor& out) {
  if (x.dtype() == out.dtype()) {
    std::memcpy(out.raw(), x.raw(), x.size_bytes());
    return;
  }
  const int64_t n = x.num_elements();
  // f32 <-> bf16 in bulk (a widened bf16 GEMM's operands every run, on a CPU without native
  // bf16): the same bits as the per-element path below, vectorised.
  if (x.dtype() == v1::DTYPE_BF16 && out.dtype() == v1::DTYPE_F32) {
    return ConvertInBlocks(n, [&](int64_t i, int64_t len) {
      Bf16ToF32(x.data<uint16_t>() + i, out.data<float>() + i, len);
    });
  }
  if (x.dtype() == v1::DTYPE_F32 && out.dtype() == v1::DTYPE_BF16) {
    return ConvertInBlocks(n, [&](int64_t i, int64_t len) {
      F32ToBf16(x.data<float>() + i, out.data<uint16_t>() + i, len);
    });
  }
  if (out.dtype() == v1::DTYPE_F32 && x.dtype() == v1::DTYPE_U8) {  // a dataset's images
    const uint8_t* src = x.data<uint8_t>();
    float* dst = out.data<float>();
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
    return;
  }
  const bool from_float = x.dtype() == v1::DTYPE_F32 || x.dtype() == v1::DTYPE_BF16;
  if (from_float && out.dtype() == v1::DTYPE_I32) return SaturatingConvert<int32_t>(x, out);
  if (from_float && out.dtype() == v1::DTYPE_U32) return SaturatingConvert<uint32_t>(x, out);
  if (from_float && out.dtype() == v1::DTYPE_U8) return SaturatingConvert<uint8_t>(x, out);
  if (!from_float && out.dtype() != v1::DTYPE_F32 && out.dtype() != v1::DTYPE_BF16) {
    // Integer to integer, as XLA's: the value modulo 2^bits (u32 4294967289 is i32 -7); a
    // double cast to a narrower integer out of its range is undefined (x86 gave INT_MIN).
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t v = static_cast<uint64_t>(static_cast<int64_t>(GetAsDouble(x, i)));
      SetFromDouble(out, i,
                    out.dtype() == v1::DTYPE_I32   ? static_cast<int32_t>(static_cast<uint32_t>(v))
                    : out.dtype() == v1::DTYPE_U32 ? static_cast<double>(static_cast<uint32_t>(v))
                                                   : static_cast<double>(static_cast<uint8_t>(v)));
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) SetFromDouble(out, i, GetAsDouble(x, i));
}

}  // namespace meshrun
