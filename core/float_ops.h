// f32 max and min with XLA's semantics, which jax.lax.max / jnp.maximum, reduce_max, pmax,
// cummax and jax.nn.relu inherit: NaN when either operand is NaN, and max(-0, +0) = +0,
// min(-0, +0) = -0 whichever side each zero is on. std::max, `a > b ? a : b` and the x86 max
// instruction differ: they return one operand when the other is NaN, so a NaN (a diverged loss,
// an overflowed activation) would silently vanish. Header-only; pure functions (thread-safe).
#ifndef MESHRUN_CORE_FLOAT_OPS_H_
#define MESHRUN_CORE_FLOAT_OPS_H_

#include <cstdint>

#include "absl/base/casts.h"

namespace meshrun {

// lax.max on f32: NaN if a or b is NaN; of two equal values, the one with the sign bit clear.
inline float NanPropagatingMax(float a, float b) {
  if (a != a || a > b) return a;
  if (b != b || b > a) return b;
  return absl::bit_cast<float>(absl::bit_cast<uint32_t>(a) & absl::bit_cast<uint32_t>(b));
}

// lax.min on f32: NaN if a or b is NaN; of two equal values, the one with the sign bit set.
inline float NanPropagatingMin(float a, float b) {
  if (a != a || a < b) return a;
  if (b != b || b < a) return b;
  return absl::bit_cast<float>(absl::bit_cast<uint32_t>(a) | absl::bit_cast<uint32_t>(b));
}

// 2^k as an f32, for k in [-126, 127] (the normal exponents): its bits built directly.
inline float PowerOfTwo(int k) {
  return absl::bit_cast<float>(static_cast<uint32_t>(k + 127) << 23);
}

// std::ldexp(y, n), bit for bit, for n in [-150, 128] and normal y of magnitude under 2, in two
// multiplications by powers of two that compile inline and vectorise (ldexp is a libm call per
// element). The first is exact (its result stays normal); the second rounds once, as ldexp does,
// where the result overflows or is subnormal.
inline float ScaleByPowerOfTwo(float y, int n) {
  const int first = n > 127 ? 64 : (n < -126 ? n + 126 : 0);
  return (y * PowerOfTwo(first)) * PowerOfTwo(n - first);
}

// The f32 bits of x's nearest bf16 (ties to even), widened back: the bf16 is the high half, the
// low half zero. As XLA converts to bf16 (and Eigen rounds): a NaN becomes the quiet NaN of its
// sign, 0x7fc00000 or 0xffc00000, its payload dropped; a value past bf16's largest finite one
// rounds to infinity of its sign. The one home of that rule: F32ToBf16
// (core/collectives/reduce_kernels.h) takes the high half, RoundToBf16 the float. Integer
// arithmetic, so a loop over it vectorises.
inline uint32_t RoundToBf16Bits(uint32_t bits) {
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  return nan ? (bits & 0x80000000u) | 0x7fc00000u
             : (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
}

// x rounded to the nearest bf16 and widened back to f32 (RoundToBf16Bits): the bits of converting
// x to bf16 and back (F32ToBf16 then Bf16ToF32). As jax.lax.reduce_precision(x, exponent_bits=8,
// mantissa_bits=7), but for NaN, which becomes the quiet NaN of its sign as the conversion to
// bf16 makes it. The rewrite of a convert to bf16 read only by a convert back to f32 (fusion.h's
// SimplifyProgram) computes this, as the unary fn "round_bf16".
inline float RoundToBf16(float x) {
  return absl::bit_cast<float>(RoundToBf16Bits(absl::bit_cast<uint32_t>(x)));
}

}  // namespace meshrun

#endif  // MESHRUN_CORE_FLOAT_OPS_H_
