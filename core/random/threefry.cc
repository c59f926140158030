#include "core/random/threefry.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace meshrun {
namespace {

inline uint32_t RotL(uint32_t v, int r) { return (v << r) | (v >> (32 - r)); }

// threefry_2x32 over a flat count array, as jax.prng.threefry_2x32: pad to even length, hash the
// first half against the second half, concatenate.
std::vector<uint32_t> ThreefryCounts(const PRNGKey& key, const std::vector<uint32_t>& counts) {
  size_t n = counts.size();
  size_t half = (n + 1) / 2;
  std::vector<uint32_t> padded = counts;
  padded.resize(half * 2, 0);
  std::vector<uint32_t> out(half * 2);
  for (size_t i = 0; i < half; ++i) {
    std::array<uint32_t, 2> y = Threefry2x32(key, padded[i], padded[half + i]);
    out[i] = y[0];
    out[half + i] = y[1];
  }
  out.resize(n);
  return out;
}

}  // namespace

std::array<uint32_t, 2> Threefry2x32(const PRNGKey& key, uint32_t x0, uint32_t x1) {
  static constexpr int kRot[2][4] = {{13, 15, 26, 6}, {17, 29, 16, 24}};
  const uint32_t ks[3] = {key[0], key[1], key[0] ^ key[1] ^ 0x1BD11BDAu};
  uint32_t x[2] = {x0 + ks[0], x1 + ks[1]};
  for (int block = 0; block < 5; ++block) {
    for (int r : kRot[block % 2]) {
      x[0] += x[1];
      x[1] = RotL(x[1], r);
      x[1] ^= x[0];
    }
    x[0] += ks[(block + 1) % 3];
    x[1] += ks[(block + 2) % 3] + static_cast<uint32_t>(block + 1);
  }
  return {x[0], x[1]};
}

PRNGKey MakePRNGKey(uint64_t seed) {
  return {static_cast<uint32_t>(seed >> 32), static_cast<uint32_t>(seed & 0xFFFFFFFFu)};
}

PRNGKey FoldIn(const PRNGKey& key, uint32_t data) {
  std::array<uint32_t, 2> y = Threefry2x32(key, 0, data);
  return {y[0], y[1]};
}

std::array<PRNGKey, 2> Split(const PRNGKey& key) {
  std::vector<uint32_t> out = ThreefryCounts(key, {0, 1, 2, 3});
  return {PRNGKey{out[0], out[1]}, PRNGKey{out[2], out[3]}};
}

namespace {

// Threefry2x32 on kLanes blocks at once, the counts (c0 + j, c1 + j) for lane j; compiled for
// AVX-512, AVX2 and the baseline, the best the CPU runs chosen when the program loads. Lanes are
// independent: the same words as Threefry2x32.
constexpr int kLanes = 16;

// kLanes words as one value (GCC's vector extension): each clone below compiles its arithmetic
// to the widest registers of its target (one zmm on AVX-512, two ymm on AVX2, SSE2 otherwise).
typedef uint32_t Lanes __attribute__((vector_size(kLanes * sizeof(uint32_t))));

// One Threefry round on every lane: x0 += x1; x1 = rotl(x1, R) ^ x0.
template <int R>
inline void Round(Lanes& x0, Lanes& x1) {
  x0 += x1;
  x1 = ((x1 << R) | (x1 >> (32 - R))) ^ x0;
}

// Lane j hashes the counts (c0 + j * d0, c1 + j * d1), d0 and d1 each 0 or 1.
__attribute__((target_clones("avx512f", "avx2", "default"))) void ThreefryLanes(
    const PRNGKey& key, uint32_t c0, uint32_t d0, uint32_t c1, uint32_t d1, uint32_t* y0,
    uint32_t* y1) {
  const uint32_t ks[3] = {key[0], key[1], key[0] ^ key[1] ^ 0x1BD11BDAu};
  Lanes x0, x1;
  for (int j = 0; j < kLanes; ++j) {
    x0[j] = c0 + static_cast<uint32_t>(j) * d0 + ks[0];
    x1[j] = c1 + static_cast<uint32_t>(j) * d1 + ks[1];
  }
  // Threefry2x32's 5 blocks of 4 rounds (rotations 13 15 26 6, then 17 29 16 24), each followed
  // by a key injection, as Threefry2x32 loops over them.
  for (int block = 0; block < 5; ++block) {
    if (block % 2 == 0) {
      Round<13>(x0, x1), Round<15>(x0, x1), Round<26>(x0, x1), Round<6>(x0, x1);
    } else {
      Round<17>(x0, x1), Round<29>(x0, x1), Round<16>(x0, x1), Round<24>(x0, x1);
    }
    x0 += ks[(block + 1) % 3];
    x1 += ks[(block + 2) % 3] + static_cast<uint32_t>(block + 1);
  }
  std::memcpy(y0, &x0, sizeof(x0));
  std::memcpy(y1, &x1, sizeof(x1));
}

}  // namespace

void RandomBits(const PRNGKey& key, int64_t n, uint32_t* out) {
  // ThreefryCounts on the counts 0..n-1 padded with one 0 to even length: block i hashes
  // (i, i + half); word 0 is element i, word 1 element i + half (dropped when that is the pad).
  const int64_t half = (n + 1) / 2;
  const int64_t full = n % 2 == 0 ? half : half - 1;  // blocks whose second count is not the pad
  uint32_t y0[kLanes], y1[kLanes];
  int64_t i = 0;
  for (; i + kLanes <= full; i += kLanes) {
    ThreefryLanes(key, static_cast<uint32_t>(i), 1, static_cast<uint32_t>(i + half), 1, y0, y1);
    std::copy(y0, y0 + kLanes, out + i);
    std::copy(y1, y1 + kLanes, out + half + i);
  }
  for (; i < half; ++i) {
    const std::array<uint32_t, 2> y = Threefry2x32(
        key, static_cast<uint32_t>(i), i + half < n ? static_cast<uint32_t>(i + half) : 0u);
    out[i] = y[0];
    if (i + half < n) out[half + i] = y[1];
  }
}

std::vector<uint32_t> RandomBits(const PRNGKey& key, int64_t n) {
  std::vector<uint32_t> out(static_cast<size_t>(n));
  RandomBits(key, n, out.data());
  return out;
}

void PartitionableBits(const PRNGKey& key, int64_t first, int64_t n, uint32_t* out) {
  uint32_t y0[kLanes], y1[kLanes];
  int64_t j = 0;
  while (j < n) {
    const uint64_t i = static_cast<uint64_t>(first + j);
    const uint32_t hi = static_cast<uint32_t>(i >> 32), lo = static_cast<uint32_t>(i);
    // A block of lanes whose low words do not wrap shares one high word.
    if (j + kLanes <= n && lo <= std::numeric_limits<uint32_t>::max() - (kLanes - 1)) {
      ThreefryLanes(key, hi, 0, lo, 1, y0, y1);
      for (int l = 0; l < kLanes; ++l) out[j + l] = y0[l] ^ y1[l];
      j += kLanes;
    } else {
      out[j] = PartitionableBitsAt(key, first + j);
      ++j;
    }
  }
}

uint32_t PartitionableBitsAt(const PRNGKey& key, int64_t i) {
  const std::array<uint32_t, 2> y = Threefry2x32(key, static_cast<uint32_t>(uint64_t(i) >> 32),
                                                 static_cast<uint32_t>(i & 0xFFFFFFFF));
  return y[0] ^ y[1];
}

uint32_t PartitionableSplitWordAt(const PRNGKey& key, int64_t j, int w) {
  return Threefry2x32(key, static_cast<uint32_t>(uint64_t(j) >> 32),
                      static_cast<uint32_t>(j & 0xFFFFFFFF))[w];
}

float ErfInv(float x) {
  if (std::fabs(x) == 1.0f) return std::copysign(std::numeric_limits<float>::infinity(), x);
  float w = -std::log1p(-x * x);
  float p;
  if (w < 5.0f) {
    w -= 2.5f;
    p = 2.81022636e-08f;
    p = std::fma(p, w, 3.43273939e-07f);
    p = std::fma(p, w, -3.5233877e-06f);
    p = std::fma(p, w, -4.39150654e-06f);
    p = std::fma(p, w, 0.00021858087f);
    p = std::fma(p, w, -0.00125372503f);
    p = std::fma(p, w, -0.00417768164f);
    p = std::fma(p, w, 0.246640727f);
    p = std::fma(p, w, 1.50140941f);
  } else {
    w = std::sqrt(w) - 3.0f;
    p = -0.000200214257f;
    p = std::fma(p, w, 0.000100950558f);
    p = std::fma(p, w, 0.00134934322f);
    p = std::fma(p, w, -0.00367342844f);
    p = std::fma(p, w, 0.00573950773f);
    p = std::fma(p, w, -0.0076224613f);
    p = std::fma(p, w, 0.00943887047f);
    p = std::fma(p, w, 1.00167406f);
    p = std::fma(p, w, 2.83297682f);
  }
  return p * x;
}

uint32_t RandomBitsAt(const PRNGKey& key, int64_t n, int64_t i) {
  // ThreefryCounts on the counts 0..n-1 padded with one 0 to even length: element i < half is
  // word 0 of the block (i, i + half), element i >= half word 1 of (i - half, i).
  const int64_t half = (n + 1) / 2;
  const auto count = [n](int64_t c) { return c < n ? static_cast<uint32_t>(c) : 0u; };
  if (i < half) return Threefry2x32(key, count(i), count(i + half))[0];
  return Threefry2x32(key, count(i - half), count(i))[1];
}

float TruncatedNormalAt(const PRNGKey& key, int64_t n, int64_t i, float scale) {
  const float sqrt2 = std::sqrt(2.0f);
  const float a = std::erf(-2.0f / sqrt2);
  const float b = std::erf(2.0f / sqrt2);
  const float u = std::max(a, BitsToUnitFloat(RandomBitsAt(key, n, i)) * (b - a) + a);
  const float z =
      std::clamp(sqrt2 * ErfInv(u), std::nextafter(-2.0f, 0.0f), std::nextafter(2.0f, 0.0f));
  return z * scale;
}

float NormalAt(const PRNGKey& key, int64_t n, int64_t i, float scale) {
  // jax.random.normal: uniform(key, minval=nextafter(-1, 0), maxval=1), then sqrt(2) erfinv.
  const float lo = std::nextafter(-1.0f, 0.0f);
  const float u = std::max(lo, BitsToUnitFloat(RandomBitsAt(key, n, i)) * (1.0f - lo) + lo);
  return std::sqrt(2.0f) * ErfInv(u) * scale;
}

void TruncatedNormal(const PRNGKey& key, int64_t n, float scale, float* out) {
  const float sqrt2 = std::sqrt(2.0f);
  const float a = std::erf(-2.0f / sqrt2);
  const float b = std::erf(2.0f / sqrt2);
  const float lo = std::nextafter(-2.0f, 0.0f);
  const float hi = std::nextafter(2.0f, 0.0f);
  std::vector<uint32_t> bits = RandomBits(key, n);
  for (int64_t i = 0; i < n; ++i) {
    float u = std::max(a, BitsToUnitFloat(bits[i]) * (b - a) + a);
    float z = std::clamp(sqrt2 * ErfInv(u), lo, hi);
    out[i] = z * scale;
  }
}

}  // namespace meshrun
