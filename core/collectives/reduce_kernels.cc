#include "core/collectives/reduce_kernels.h"

#include <algorithm>
#include <cstring>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "absl/base/casts.h"
#include "absl/strings/str_cat.h"
#include "core/float_ops.h"

namespace meshrun {

float Bf16ToF32(uint16_t v) {
  uint32_t bits = uint32_t{v} << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t F32ToBf16(float f) {
  return static_cast<uint16_t>(RoundToBf16Bits(absl::bit_cast<uint32_t>(f)) >> 16);
}

// Built for AVX-512, AVX2 and the baseline ISA (the loader picks the best the CPU has); each
// version computes the same bits, the loops being integer arithmetic.
__attribute__((target_clones("avx512f", "avx2", "default"))) void F32ToBf16(const float* src,
                                                                            uint16_t* dst,
                                                                            int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    dst[i] = static_cast<uint16_t>(RoundToBf16Bits(absl::bit_cast<uint32_t>(src[i])) >> 16);
  }
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void Bf16ToF32(const uint16_t* src,
                                                                            float* dst,
                                                                            int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    const uint32_t bits = uint32_t{src[i]} << 16;
    std::memcpy(&dst[i], &bits, 4);
  }
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void RoundToBf16(const float* src,
                                                                              float* dst,
                                                                              int64_t count) {
  for (int64_t i = 0; i < count; ++i) dst[i] = RoundToBf16(src[i]);
}

void StreamCopy(void* dst, const void* src, size_t bytes) {
#if defined(__SSE2__)
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  const size_t head = std::min(bytes, (16 - reinterpret_cast<uintptr_t>(d) % 16) % 16);
  std::memcpy(d, s, head);  // up to the first 16-byte aligned destination address
  size_t i = head;
  for (; i + 16 <= bytes; i += 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
  }
  std::memcpy(d + i, s + i, bytes - i);
  _mm_sfence();
#else
  std::memcpy(dst, src, bytes);
#endif
}

absl::Status CheckReducible(DType dtype, ReduceOp op) {
  switch (dtype) {
    case v1::DTYPE_F32:
    case v1::DTYPE_BF16:
      return absl::OkStatus();
    case v1::DTYPE_I32:
    case v1::DTYPE_U32:
      if (op == ReduceOp::kMean) {
        return absl::InvalidArgumentError(absl::StrCat("pmean of integer dtype ", DTypeName(dtype),
                                                       " is not supported; expected f32 or bf16"));
      }
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(absl::StrCat("cannot reduce dtype ", DTypeName(dtype)));
  }
}

namespace {

// dst[i] = a[i] + b[i] in f32; dst may be a. Built for AVX-512, AVX2 and the baseline ISA, each
// version adding element by element (no reassociation), so all give the same bits.
__attribute__((target_clones("avx512f", "avx2", "default"))) void AddF32(float* dst, const float* a,
                                                                         const float* b,
                                                                         int64_t count) {
  for (int64_t i = 0; i < count; ++i) dst[i] = a[i] + b[i];
}

}  // namespace

void Add(DType dtype, void* dst, const void* a, const void* b, int64_t count) {
  if (dtype == v1::DTYPE_F32) {
    AddF32(static_cast<float*>(dst), static_cast<const float*>(a), static_cast<const float*>(b),
           count);
    return;
  }
  if (dst != a) std::memmove(dst, a, count * DTypeSize(dtype));
  AddInto(dtype, dst, b, count);
}

void AddInto(DType dtype, void* dst, const void* src, int64_t count) {
  switch (dtype) {
    case v1::DTYPE_F32: {
      float* d = static_cast<float*>(dst);
      AddF32(d, d, static_cast<const float*>(src), count);
      break;
    }
    case v1::DTYPE_BF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < count; ++i) d[i] = F32ToBf16(Bf16ToF32(d[i]) + Bf16ToF32(s[i]));
      break;
    }
    case v1::DTYPE_I32: {
      int32_t* d = static_cast<int32_t*>(dst);
      const int32_t* s = static_cast<const int32_t*>(src);
      for (int64_t i = 0; i < count; ++i)
        d[i] = static_cast<int32_t>(uint32_t(d[i]) + uint32_t(s[i]));
      break;
    }
    case v1::DTYPE_U32: {
      uint32_t* d = static_cast<uint32_t*>(dst);
      const uint32_t* s = static_cast<const uint32_t*>(src);
      for (int64_t i = 0; i < count; ++i) d[i] += s[i];
      break;
    }
    default:
      break;
  }
}

namespace {

template <typename T>
T IntegerMax(T a, T b) {
  return a > b ? a : b;
}

template <typename T>
void MaxInto(void* dst, const void* src, int64_t count, T (*max)(T, T)) {
  T* d = static_cast<T*>(dst);
  const T* s = static_cast<const T*>(src);
  for (int64_t i = 0; i < count; ++i) d[i] = max(d[i], s[i]);
}

}  // namespace

void Reduce(DType dtype, ReduceOp op, void* dst, const void* src, int64_t count) {
  if (op != ReduceOp::kMax) {
    AddInto(dtype, dst, src, count);
    return;
  }
  switch (dtype) {
    case v1::DTYPE_F32:
      MaxInto<float>(dst, src, count, &NanPropagatingMax);
      break;
    case v1::DTYPE_I32:
      MaxInto<int32_t>(dst, src, count, &IntegerMax<int32_t>);
      break;
    case v1::DTYPE_U32:
      MaxInto<uint32_t>(dst, src, count, &IntegerMax<uint32_t>);
      break;
    case v1::DTYPE_BF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < count; ++i)
        d[i] = F32ToBf16(NanPropagatingMax(Bf16ToF32(d[i]), Bf16ToF32(s[i])));
      break;
    }
    default:
      break;
  }
}

void ReduceTo(DType dtype, ReduceOp op, void* dst, const void* a, const void* b, int64_t count) {
  if (op != ReduceOp::kMax) {
    Add(dtype, dst, a, b, count);
    return;
  }
  if (dst != a) std::memmove(dst, a, count * DTypeSize(dtype));
  Reduce(dtype, op, dst, b, count);
}

void Scale(DType dtype, void* dst, int64_t count, float factor) {
  if (dtype == v1::DTYPE_F32) {
    float* d = static_cast<float*>(dst);
    for (int64_t i = 0; i < count; ++i) d[i] *= factor;
  } else if (dtype == v1::DTYPE_BF16) {
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < count; ++i) d[i] = F32ToBf16(Bf16ToF32(d[i]) * factor);
  }
}

}  // namespace meshrun
