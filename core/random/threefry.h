// JAX's default PRNG: Threefry-2x32 (20 rounds) with JAX's key derivation, so keys match JAX bit
// for bit: PRNGKey(0) folded with 0 along an axis gives [1797259609, 2579123966] as in the seeds.
#ifndef MESHRUN_CORE_RANDOM_THREEFRY_H_
#define MESHRUN_CORE_RANDOM_THREEFRY_H_

#include <array>
#include <cstdint>
#include <vector>

namespace meshrun {

// A PRNG key: two uint32 words, as a jax.random.PRNGKey array of shape [2].
using PRNGKey = std::array<uint32_t, 2>;

// jax.random.PRNGKey(seed): [seed >> 32, seed & 0xFFFFFFFF].
PRNGKey MakePRNGKey(uint64_t seed);
// jax.random.fold_in(key, data).
PRNGKey FoldIn(const PRNGKey& key, uint32_t data);
// jax.random.split(key, 2).
std::array<PRNGKey, 2> Split(const PRNGKey& key);
// jax.random.bits(key, (n,), uint32) with jax_threefry_partitionable=False.
std::vector<uint32_t> RandomBits(const PRNGKey& key, int64_t n);
// The same words written to out[0..n): vectorised (AVX-512 or AVX2 where the CPU has them).
void RandomBits(const PRNGKey& key, int64_t n, uint32_t* out);

// jax.random.uniform's mapping of 32 random bits to a float in [0, 1).
inline float BitsToUnitFloat(uint32_t bits) {
  union {
    uint32_t u;
    float f;
  } v{(bits >> 9) | 0x3F800000u};
  return v.f - 1.0f;
}

// jax.random.truncated_normal(key, -2, 2, (n,)) * scale, written into out[0..n).
void TruncatedNormal(const PRNGKey& key, int64_t n, float scale, float* out);
// Element i of RandomBits(key, n), computed alone (a device draws just its block of a global
// array, with the values the whole array would have). REQUIRES: 0 <= i < n.
uint32_t RandomBitsAt(const PRNGKey& key, int64_t n, int64_t i);
// Element i of jax.random.truncated_normal(key, -2, 2, (n,)) * scale, alone.
float TruncatedNormalAt(const PRNGKey& key, int64_t n, int64_t i, float scale);
// Element i of jax.random.normal(key, (n,)) * scale, alone (sqrt(2) erfinv of a uniform draw in
// (-1, 1), as jax does).
float NormalAt(const PRNGKey& key, int64_t n, int64_t i, float scale);

// jax.random.bits(key, shape, uint32) element with row-major index i under
// jax_threefry_partitionable=True (JAX's default): o0 ^ o1 of Threefry2x32(key, (hi32(i),
// lo32(i))), so a device draws any block of a global array alone. REQUIRES: i >= 0.
uint32_t PartitionableBitsAt(const PRNGKey& key, int64_t i);
// PartitionableBitsAt(key, first + j) for j in [0, n), written to out[0..n): vectorised as
// RandomBits is. REQUIRES: first >= 0, n >= 0.
void PartitionableBits(const PRNGKey& key, int64_t first, int64_t n, uint32_t* out);
// Word w (0 or 1) of key j of jax.random.split(key, shape) under jax_threefry_partitionable=True:
// Threefry2x32(key, (hi32(j), lo32(j)))[w], key j being the row-major j-th of `shape`
// (split(key, n)[j] equals fold_in(key, j)). The legacy split is RandomBitsAt over 2 * n words.
uint32_t PartitionableSplitWordAt(const PRNGKey& key, int64_t j, int w);

// Inverse error function, computed as XLA's ErfInv32 (Giles' single-precision polynomial in
// w = -log1p(-x * x), two branches at w < 5, its steps fused multiply-adds as XLA's CPU code
// contracts them; erfinv(+-1) = +-inf, as jax.lax.erf_inv gives). It agrees with jax.lax.erf_inv to
// 2 ulp (glibc's log1p is not XLA's), jax.random.normal's draws to 3.
float ErfInv(float x);

// The raw block function: threefry2x32_20(key, (x0, x1)).
std::array<uint32_t, 2> Threefry2x32(const PRNGKey& key, uint32_t x0, uint32_t x1);

}  // namespace meshrun

#endif  // MESHRUN_CORE_RANDOM_THREEFRY_H_
