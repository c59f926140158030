// Every kernel's backward against central finite differences of its forward.
#include "worker/kernels/kernel.h"

#include <random>

#include "gtest/gtest.h"

namespace meshrun {
namespace {

Tensor Random(Dims dims, uint32_t seed, float scale = 1.0f) {
  Tensor t(v1::DTYPE_F32, std::move(dims));
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  for (int64_t i = 0; i < t.num_elements(); ++i) t.data<float>()[i] = dist(rng);
  return t;
}

double Dot(const Tensor& a, const Tensor& b) {
  double s = 0;
  for (int64_t i = 0; i < a.num_elements(); ++i) s += double{a.data<float>()[i]} * b.data<float>()[i];
  return s;
}

// Checks d(loss)/d(x) == grad for loss = fn() by central differences, perturbing each element.
void ExpectGradient(Tensor& x, const Tensor& grad, const std::function<double()>& loss, double tol = 2e-2) {
  ASSERT_EQ(x.num_elements(), grad.num_elements());
  const float eps = 1e-2f;
  for (int64_t i = 0; i < x.num_elements(); ++i) {
    float& v = x.data<float>()[i];
    const float saved = v;
    v = saved + eps;
    const double up = loss();
    v = saved - eps;
    const double down = loss();
    v = saved;
    const double numeric = (up - down) / (2 * eps);
    const double analytic = grad.data<float>()[i];
    ASSERT_NEAR(analytic, numeric, tol * std::max(1.0, std::abs(numeric))) << "element " << i;
  }
}

TEST(MatmulKernelTest, ForwardMatchesNaiveProduct) {
  Tensor a = Random({3, 4}, 1), b = Random({4, 5}, 2), bias = Random({5}, 3), c(v1::DTYPE_F32, {3, 5});
  auto k = CreateMatmul(a, b, &bias, c);
  ASSERT_TRUE(k.ok()) << k.status();
  ASSERT_TRUE((*k)->Run().ok());
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 5; ++j) {
      double s = bias.data<float>()[j];
      for (int p = 0; p < 4; ++p) s += a.data<float>()[i * 4 + p] * b.data<float>()[p * 5 + j];
      EXPECT_NEAR(c.data<float>()[i * 5 + j], s, 1e-4);
    }
  }
}

TEST(MatmulKernelTest, BackwardMatchesFiniteDifferences) {
  Tensor a = Random({3, 4}, 1), b = Random({4, 5}, 2), bias = Random({5}, 3), c(v1::DTYPE_F32, {3, 5});
  Tensor r = Random({3, 5}, 4);  // loss = sum(c * r), so dC = r
  auto fwd = CreateMatmul(a, b, &bias, c);
  ASSERT_TRUE(fwd.ok());
  auto loss = [&] {
    EXPECT_TRUE((*fwd)->Run().ok());
    return Dot(c, r);
  };
  Tensor da(v1::DTYPE_F32, {3, 4}), db(v1::DTYPE_F32, {4, 5}), dbias(v1::DTYPE_F32, {5});
  auto k_da = CreateMatmul(r, b, nullptr, da, {.transpose_b = true});
  auto k_db = CreateMatmul(a, r, nullptr, db, {.transpose_a = true});
  auto k_dbias = CreateReduceSumRows(r, dbias);
  ASSERT_TRUE(k_da.ok() && k_db.ok() && k_dbias.ok());
  ASSERT_TRUE((*k_da)->Run().ok());
  ASSERT_TRUE((*k_db)->Run().ok());
  ASSERT_TRUE((*k_dbias)->Run().ok());
  ExpectGradient(a, da, loss);
  ExpectGradient(b, db, loss);
  ExpectGradient(bias, dbias, loss);
}

TEST(MatmulKernelTest, RejectsMismatchedShapes) {
  Tensor a(v1::DTYPE_F32, {3, 4}), b(v1::DTYPE_F32, {5, 5}), c(v1::DTYPE_F32, {3, 5});
  auto k = CreateMatmul(a, b, nullptr, c);
  EXPECT_EQ(k.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(MatmulKernelTest, AlphaAndAccumulateAreGemmAlphaAndBeta) {
  // Gradient accumulation as the step program does it: g = g + (1/4) * x^T @ dy, twice.
  Tensor x = Random({6, 3}, 12), dy = Random({6, 2}, 13), g = Random({3, 2}, 14);
  Tensor g0 = g;
  auto k = CreateMatmul(x, dy, nullptr, g, {.transpose_a = true, .alpha = 0.25f, .accumulate = true});
  ASSERT_TRUE(k.ok()) << k.status();
  ASSERT_TRUE((*k)->Run().ok());
  ASSERT_TRUE((*k)->Run().ok());
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 2; ++j) {
      double s = 0;
      for (int r = 0; r < 6; ++r) s += x.data<float>()[r * 3 + i] * dy.data<float>()[r * 2 + j];
      EXPECT_NEAR(g.data<float>()[i * 2 + j], g0.data<float>()[i * 2 + j] + 2 * 0.25 * s, 1e-4);
    }
  }
  Tensor bsum = Random({2}, 15);
  Tensor b0 = bsum;
  auto rs = CreateReduceSumRows(dy, bsum, 0.5f, /*accumulate=*/true);
  ASSERT_TRUE(rs.ok()) << rs.status();
  ASSERT_TRUE((*rs)->Run().ok());
  for (int j = 0; j < 2; ++j) {
    double s = 0;
    for (int r = 0; r < 6; ++r) s += dy.data<float>()[r * 2 + j];
    EXPECT_NEAR(bsum.data<float>()[j], b0.data<float>()[j] + 0.5 * s, 1e-5);
  }
}

TEST(SiluKernelTest, BackwardMatchesFiniteDifferences) {
  Tensor x = Random({4, 6}, 5, 2.0f), y(v1::DTYPE_F32, {4, 6}), r = Random({4, 6}, 6), dx(v1::DTYPE_F32, {4, 6});
  auto fwd = CreateSilu(x, y);
  auto bwd = CreateSiluGrad(x, r, dx);
  ASSERT_TRUE(fwd.ok() && bwd.ok());
  ASSERT_TRUE((*fwd)->Run().ok());
  for (int64_t i = 0; i < x.num_elements(); ++i) {
    float v = x.data<float>()[i];
    EXPECT_NEAR(y.data<float>()[i], v / (1 + std::exp(-v)), 1e-5);
  }
  ASSERT_TRUE((*bwd)->Run().ok());
  ExpectGradient(x, dx, [&] {
    EXPECT_TRUE((*fwd)->Run().ok());
    return Dot(y, r);
  });
}

TEST(MultiplyKernelTest, DropoutMaskGradientIsTheMask) {
  Tensor x = Random({2, 8}, 7), mask(v1::DTYPE_F32, {2, 8}), y(v1::DTYPE_F32, {2, 8}), r = Random({2, 8}, 8);
  for (int64_t i = 0; i < mask.num_elements(); ++i) mask.data<float>()[i] = (i % 3) ? 1.0f / 0.9f : 0.0f;
  Tensor dx(v1::DTYPE_F32, {2, 8});
  auto fwd = CreateMultiply(x, mask, y);
  auto bwd = CreateMultiply(r, mask, dx);
  ASSERT_TRUE(fwd.ok() && bwd.ok());
  ASSERT_TRUE((*bwd)->Run().ok());
  ExpectGradient(x, dx, [&] {
    EXPECT_TRUE((*fwd)->Run().ok());
    return Dot(y, r);
  });
}

TEST(SoftmaxCrossEntropyKernelTest, LossAndGradientMatchDefinition) {
  Tensor logits = Random({5, 4}, 9, 2.0f), labels(v1::DTYPE_I32, {5}), dlogits(v1::DTYPE_F32, {5, 4});
  Tensor loss_sum(v1::DTYPE_F32, {}), correct(v1::DTYPE_F32, {});
  for (int i = 0; i < 5; ++i) labels.data<int32_t>()[i] = (i * 3) % 4;
  auto k = CreateSoftmaxCrossEntropy(logits, labels, &dlogits, loss_sum, correct);
  ASSERT_TRUE(k.ok()) << k.status();
  auto mean_loss = [&] {
    *loss_sum.data<float>() = 0;
    EXPECT_TRUE((*k)->Run().ok());
    return *loss_sum.data<float>() / 5.0;
  };
  // logsumexp(logits) - logits[label], summed over rows.
  double expected = 0;
  for (int i = 0; i < 5; ++i) {
    const float* row = logits.data<float>() + i * 4;
    double lse = 0;
    for (int j = 0; j < 4; ++j) lse += std::exp(double{row[j]});
    expected += std::log(lse) - row[labels.data<int32_t>()[i]];
  }
  EXPECT_NEAR(mean_loss() * 5.0, expected, 1e-4);
  Tensor grad = dlogits;
  ExpectGradient(logits, grad, mean_loss);
}

TEST(SoftmaxCrossEntropyKernelTest, CountsCorrectAndSkipsPadding) {
  Tensor logits(v1::DTYPE_F32, {3, 3}), labels(v1::DTYPE_I32, {3});
  Tensor loss_sum(v1::DTYPE_F32, {}), correct(v1::DTYPE_F32, {});
  float* l = logits.data<float>();
  l[0 * 3 + 2] = 5;  // row 0 predicts 2
  l[1 * 3 + 0] = 5;  // row 1 predicts 0
  l[2 * 3 + 1] = 5;
  labels.data<int32_t>()[0] = 2;
  labels.data<int32_t>()[1] = 1;
  labels.data<int32_t>()[2] = -1;  // padding
  auto k = CreateSoftmaxCrossEntropy(logits, labels, nullptr, loss_sum, correct);
  ASSERT_TRUE(k.ok());
  ASSERT_TRUE((*k)->Run().ok());
  EXPECT_EQ(*correct.data<float>(), 1.0f);
}

TEST(AccumulateKernelTest, AddsScaled) {
  Tensor acc = Random({7}, 10), x = Random({7}, 11);
  Tensor before = acc;
  auto k = CreateAccumulate(x, 0.25f, acc);
  ASSERT_TRUE(k.ok());
  ASSERT_TRUE((*k)->Run().ok());
  for (int i = 0; i < 7; ++i) EXPECT_NEAR(acc.data<float>()[i], before.data<float>()[i] + 0.25f * x.data<float>()[i], 1e-6);
}

}  // namespace
}  // namespace meshrun
