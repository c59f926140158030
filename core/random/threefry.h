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

// Inverse error function (Giles' single-precision approximation, as XLA uses).
float ErfInv(float x);

// The raw block function: threefry2x32_20(key, (x0, x1)).
std::array<uint32_t, 2> Threefry2x32(const PRNGKey& key, uint32_t x0, uint32_t x1);

}  // namespace meshrun

#endif  // MESHRUN_CORE_RANDOM_THREEFRY_H_
