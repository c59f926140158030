#include "core/random/threefry.h"

#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace meshrun {
namespace {

// The seed (001) prints fold_rng_over_axis(PRNGKey(0), 'i') on a 4x2 mesh: devices with i-index
// 0..3 get these keys.
TEST(ThreefryTest, FoldInMatchesJax) {
  const PRNGKey key = MakePRNGKey(0);
  EXPECT_EQ(FoldIn(key, 0), (PRNGKey{1797259609u, 2579123966u}));
  EXPECT_EQ(FoldIn(key, 1), (PRNGKey{928981903u, 3453687069u}));
  EXPECT_EQ(FoldIn(key, 2), (PRNGKey{4146024105u, 2718843009u}));
  EXPECT_EQ(FoldIn(key, 3), (PRNGKey{2467461003u, 3840466878u}));
}

TEST(ThreefryTest, PRNGKeyLayout) {
  EXPECT_EQ(MakePRNGKey(42), (PRNGKey{0u, 42u}));
  EXPECT_EQ(MakePRNGKey(uint64_t{1} << 32 | 7), (PRNGKey{1u, 7u}));
}

TEST(ThreefryTest, SplitGivesDistinctKeys) {
  auto keys = Split(MakePRNGKey(0));
  EXPECT_NE(keys[0], keys[1]);
  EXPECT_NE(keys[0], MakePRNGKey(0));
}

TEST(ThreefryTest, TruncatedNormalStatistics) {
  std::vector<float> v(200000);
  TruncatedNormal(MakePRNGKey(3), v.size(), 1.0f, v.data());
  double mean = 0, var = 0;
  for (float x : v) {
    ASSERT_GT(x, -2.0f);
    ASSERT_LT(x, 2.0f);
    mean += x;
  }
  mean /= v.size();
  for (float x : v) var += (x - mean) * (x - mean);
  var /= v.size();
  EXPECT_NEAR(mean, 0.0, 0.01);
  // Variance of a standard normal truncated to [-2, 2] is 0.7737 (= 0.87962566^2).
  EXPECT_NEAR(var, 0.87962566 * 0.87962566, 0.01);
}

// jax.random.bits(PRNGKey(42), (2, 3)) and jax.random.split(PRNGKey(42), 3) under JAX 0.10.2's
// default, jax_threefry_partitionable=True.
TEST(ThreefryTest, PartitionableBitsAndSplitMatchJax) {
  const PRNGKey key = MakePRNGKey(42);
  const uint32_t bits[] = {2098992034u, 2919706841u, 2646866425u,
                           2409546199u, 1935504149u, 2516274904u};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(PartitionableBitsAt(key, i), bits[i]) << i;
  const uint32_t split[3][2] = {
      {1832780943u, 270669613u}, {64467757u, 2916123636u}, {2465931498u, 255383827u}};
  for (int j = 0; j < 3; ++j) {
    EXPECT_EQ(PartitionableSplitWordAt(key, j, 0), split[j][0]) << j;
    EXPECT_EQ(PartitionableSplitWordAt(key, j, 1), split[j][1]) << j;
    EXPECT_EQ(FoldIn(key, j), (PRNGKey{split[j][0], split[j][1]})) << "split(key, n)[j] = fold_in";
  }
  // An index past 2^32 uses the high count word.
  EXPECT_NE(PartitionableBitsAt(key, (int64_t{1} << 32) + 1), PartitionableBitsAt(key, 1));
}

// The vectorised run equals the element-wise words: from 0, at odd starts and lengths off the
// lanes, and across 2^32, where the low count word wraps and the high one steps.
TEST(ThreefryTest, PartitionableBitsOfARunAreEachIndexsWord) {
  const PRNGKey key = MakePRNGKey(42);
  const int64_t wrap = int64_t{1} << 32;
  for (const auto& [first, n] : std::vector<std::pair<int64_t, int64_t>>{{0, 0},
                                                                         {0, 1},
                                                                         {0, 16},
                                                                         {3, 37},
                                                                         {1000, 259},
                                                                         {wrap - 20, 50},
                                                                         {wrap - 16, 16},
                                                                         {wrap - 15, 33},
                                                                         {3 * wrap + 5, 40}}) {
    std::vector<uint32_t> got(n + 1, 0xDEADBEEFu);
    PartitionableBits(key, first, n, got.data());
    for (int64_t j = 0; j < n; ++j)
      ASSERT_EQ(got[j], PartitionableBitsAt(key, first + j)) << "first " << first << " + " << j;
    EXPECT_EQ(got[n], 0xDEADBEEFu) << "nothing past n, first " << first;
  }
}

// jax.lax.erf_inv's f32 values (JAX 0.10.2 on x86-64), within 2 ulp.
TEST(ThreefryTest, ErfInvMatchesJax) {
  const float x[] = {0.5f, -0.999f, 1e-3f};
  const float jax[] = {0x1.e861fcp-2f, -0x1.29d332p+1f, 0x1.d0a364p-11f};
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(ErfInv(x[i]), jax[i], 2 * std::abs(jax[i]) * 0x1p-23f);
  EXPECT_EQ(ErfInv(1.0f), std::numeric_limits<float>::infinity());
  EXPECT_EQ(ErfInv(-1.0f), -std::numeric_limits<float>::infinity());
}

TEST(ThreefryTest, ErfInvInvertsErf) {
  for (float x : {-0.99f, -0.5f, 0.0f, 0.3f, 0.9f, 0.999f})
    EXPECT_NEAR(std::erf(ErfInv(x)), x, 2e-6);
}

// A device draws only its block: element i computed alone equals element i of the whole draw,
// for even and odd lengths (the odd one pads the counts with a 0).
TEST(ThreefryTest, ElementsDrawnAloneEqualTheWholeDraw) {
  for (int64_t n : {1, 2, 7, 10, 32, 33, 34, 64, 1000, 1001}) {
    const PRNGKey key = FoldIn(MakePRNGKey(5), static_cast<uint32_t>(n));
    const std::vector<uint32_t> bits = RandomBits(key, n);
    std::vector<float> tn(n);
    TruncatedNormal(key, n, 0.5f, tn.data());
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(RandomBitsAt(key, n, i), bits[i]) << "n " << n << " i " << i;
      ASSERT_EQ(TruncatedNormalAt(key, n, i, 0.5f), tn[i]) << "n " << n << " i " << i;
    }
  }
}

TEST(ThreefryTest, NormalStatistics) {
  const int64_t n = 200000;
  double mean = 0, var = 0;
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = NormalAt(MakePRNGKey(4), n, i, 2.0f);
  for (float x : v) mean += x;
  mean /= n;
  for (float x : v) var += (x - mean) * (x - mean);
  var /= n;
  EXPECT_NEAR(mean, 0.0, 0.02);
  EXPECT_NEAR(var, 4.0, 0.05);
}

// Golden values from JAX 0.4.30 (jax_threefry_partitionable=False), e.g.
// jax.random.normal(jax.random.PRNGKey(1), (7,)) and truncated_normal(PRNGKey(3), -2, 2, (5,)).
TEST(ThreefryTest, NormalAndTruncatedNormalMatchJax) {
  const std::vector<float> normal = {
      -0.8329541087150574f, 1.778336524963379f,   -1.547376036643982f, 2.1639626026153564f,
      0.9845433831214905f,  -1.5622029304504395f, -1.9970911741256714f};
  for (int64_t i = 0; i < 7; ++i)
    EXPECT_NEAR(NormalAt(MakePRNGKey(1), 7, i, 1.0f), normal[i], 2e-6f) << i;
  // Row 1 of a (2, 3) draw: elements 3..5 of the flat draw of 6.
  const std::vector<float> row1 = {0.3661903142929077f, 0.17294830083847046f, 0.2909223437309265f};
  for (int64_t j = 0; j < 3; ++j)
    EXPECT_NEAR(NormalAt(MakePRNGKey(1), 6, 3 + j, 1.0f), row1[j], 2e-6f) << j;
  const std::vector<float> tn = {-0.780002772808075f, -0.3014031648635864f, 1.5802953243255615f,
                                 0.8033549189567566f, 0.3859739601612091f};
  for (int64_t i = 0; i < 5; ++i)
    EXPECT_NEAR(TruncatedNormalAt(MakePRNGKey(3), 5, i, 1.0f), tn[i], 2e-6f) << i;
}

}  // namespace
}  // namespace meshrun
