// Data movement on row-major arrays of any dtype (element size in bytes): what the collectives
// need to honour JAX's dim arguments, and the shard_map ops that only move data.
#ifndef MESHRUN_CORE_ARRAY_OPS_H_
#define MESHRUN_CORE_ARRAY_OPS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "core/tensor.h"

namespace meshrun {

// [a, b, inner] -> [b, a, inner]: swaps the two leading axes of a 3-D view.
void SwapLeadingAxes(const void* src, int64_t a, int64_t b, int64_t inner, size_t elem, void* dst);

// out = x broadcast to out's dims. REQUIRES: same rank; each x dim is 1 or equal to out's.
void Broadcast(const Tensor& x, Tensor& out);

// out = jnp.transpose(x, perm). REQUIRES: out.dims()[i] == x.dims()[perm[i]].
void Transpose(const Tensor& x, const std::vector<int64_t>& perm, Tensor& out);

// out = jax.lax.rev(x, dims): x with each dim in `dims` reversed (any dtype). REQUIRES: out has
// x's dims and dtype; each of `dims` a dim of x.
void Reverse(const Tensor& x, const std::vector<int64_t>& dims, Tensor& out);

// out = jnp.concatenate(inputs, axis=dim). REQUIRES: shapes agree except on dim.
void Concatenate(const std::vector<const Tensor*>& inputs, int64_t dim, Tensor& out);

// out = the block of x starting at `starts` with out's dims (any dtype). REQUIRES: in range.
void Slice(const Tensor& x, const std::vector<int64_t>& starts, Tensor& out);

// The block of out starting at `starts` with update's dims = update (one dtype); the rest of out
// is kept. REQUIRES: in range.
void UpdateSlice(const Tensor& update, const std::vector<int64_t>& starts, Tensor& out);

// out = x converted to out's dtype: to bf16 rounding to nearest even; from f32 / bf16 to i32, u32
// or u8 as XLA converts (truncated, saturated at the integer's range, NaN to 0); between integers
// modulo 2^bits. f32 <-> bf16 of kConvertParallelMin elements or more is shared out in blocks
// over the calling thread's OpenMP team (a worker's compute threads; the same bits however many).
void Convert(const Tensor& x, Tensor& out);
inline constexpr int64_t kConvertParallelMin = 65536;

// Element i of x as a double / stored from a double, for any dtype.
double GetAsDouble(const Tensor& x, int64_t i);
void SetFromDouble(Tensor& x, int64_t i, double v);
// Elements [begin, begin + count) of x set to v as SetFromDouble sets one: v converted once,
// its bytes then copied over the run. REQUIRES: the run lies within x.
void FillFromDouble(Tensor& x, int64_t begin, int64_t count, double v);

}  // namespace meshrun

#endif  // MESHRUN_CORE_ARRAY_OPS_H_
