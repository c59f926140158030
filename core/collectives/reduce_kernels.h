// Element-wise reductions used by collectives, per dtype (f32, bf16 via f32, i32).
#ifndef MESHRUN_CORE_COLLECTIVES_REDUCE_KERNELS_H_
#define MESHRUN_CORE_COLLECTIVES_REDUCE_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "core/collectives/communicator.h"

namespace meshrun {

// InvalidArgument for dtypes collectives cannot reduce, or pmean over integers.
absl::Status CheckReducible(DType dtype, ReduceOp op);
// dst[i] += src[i] for i < count. REQUIRES: CheckReducible(dtype, kSum).ok().
void AddInto(DType dtype, void* dst, const void* src, int64_t count);
// dst[i] = a[i] + b[i] for i < count, in one pass over a and b: the bits of copying a into dst
// and then AddInto(dst, b). dst may be a; it must not overlap b otherwise. REQUIRES: as AddInto.
void Add(DType dtype, void* dst, const void* a, const void* b, int64_t count);
// dst[i] = op(dst[i], src[i]): sum for kSum and kMean, max for kMax.
void Reduce(DType dtype, ReduceOp op, void* dst, const void* src, int64_t count);
// dst[i] = op(a[i], b[i]): the bits of copying a into dst and then Reduce(dst, b), in one pass
// for f32 sums (Add). dst may be a; it must not overlap b otherwise. REQUIRES: as Reduce.
void ReduceTo(DType dtype, ReduceOp op, void* dst, const void* a, const void* b, int64_t count);
// dst[i] *= factor (floating dtypes only).
void Scale(DType dtype, void* dst, int64_t count, float factor);

// memcpy(dst, src, bytes) with non-temporal stores where the CPU has them (x86 SSE2): for bytes
// this process will not read again soon, such as results stored into a peer's buffer, so the
// destination's cache lines are not read in first and no cache is filled with them (glibc's
// memcpy does the same for copies larger than the cache). Ordered before the caller's later
// messages: it ends with a store fence.
void StreamCopy(void* dst, const void* src, size_t bytes);

// bf16 <-> f32, round-to-nearest-even, as jnp.bfloat16 (a NaN to the quiet NaN of its sign:
// core/float_ops.h's RoundToBf16Bits).
float Bf16ToF32(uint16_t v);
uint16_t F32ToBf16(float f);
// The same over `count` elements (vectorised by the compiler); dst and src do not overlap.
void F32ToBf16(const float* src, uint16_t* dst, int64_t count);
void Bf16ToF32(const uint16_t* src, float* dst, int64_t count);
// dst[i] = RoundToBf16(src[i]) (core/float_ops.h) for i < count: one pass for the two
// conversions above. dst may be src (in place); it must not overlap it otherwise.
void RoundToBf16(const float* src, float* dst, int64_t count);

}  // namespace meshrun

#endif  // MESHRUN_CORE_COLLECTIVES_REDUCE_KERNELS_H_
