// Every kernel's backward against central finite differences of its forward.
#include <random>

#include "gtest/gtest.h"
#include "worker/kernels/kernel.h"

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
  for (int64_t i = 0; i < a.num_elements(); ++i)
    s += double{a.data<float>()[i]} * b.data<float>()[i];
  return s;
}

// Checks d(loss)/d(x) == grad for loss = fn() by central differences, perturbing each element.
void ExpectGradient(Tensor& x, const Tensor& grad, const std::function<double()>& loss,
                    double tol = 2e-2) {
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
  Tensor a = Random({3, 4}, 1), b = Random({4, 5}, 2), bias = Random({5}, 3),
         c(v1::DTYPE_F32, {3, 5});
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
  Tensor a = Random({3, 4}, 1), b = Random({4, 5}, 2), bias = Random({5}, 3),
         c(v1::DTYPE_F32, {3, 5});
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
  Tensor ones(v1::DTYPE_F32, {1, 3});
  std::fill_n(ones.data<float>(), 3, 1.0f);
  Tensor dbias_row(v1::DTYPE_F32, {1, 5});  // the column sums of r, as ones @ r
  auto k_dbias = CreateMatmul(ones, r, nullptr, dbias_row);
  ASSERT_TRUE(k_da.ok() && k_db.ok() && k_dbias.ok());
  ASSERT_TRUE((*k_da)->Run().ok());
  ASSERT_TRUE((*k_db)->Run().ok());
  ASSERT_TRUE((*k_dbias)->Run().ok());
  std::memcpy(dbias.raw(), dbias_row.raw(), dbias.size_bytes());
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
  auto k =
      CreateMatmul(x, dy, nullptr, g, {.transpose_a = true, .alpha = 0.25f, .accumulate = true});
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
}

TEST(SiluKernelTest, BackwardMatchesFiniteDifferences) {
  Tensor x = Random({4, 6}, 5, 2.0f), y(v1::DTYPE_F32, {4, 6}), r = Random({4, 6}, 6),
         dx(v1::DTYPE_F32, {4, 6});
  auto fwd = CreateUnary("silu", x, y);
  auto bwd = CreateUnaryGrad("silu", x, r, dx);
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

TEST(ReduceKernelTest, SumsAndMeansOverLeadingDimsMatchTheDefinition) {
  // Over leading dims the reduction runs as a GEMM with a ones row (CreateLeadingSum).
  for (const char* fn : {"sum", "mean"}) {
    Tensor x = Random({4, 3, 5}, 21), out(v1::DTYPE_F32, {1, 1, 5});
    auto k = CreateReduce(fn, x, out);
    ASSERT_TRUE(k.ok()) << k.status();
    ASSERT_TRUE((*k)->Run().ok());
    for (int c = 0; c < 5; ++c) {
      double s = 0;
      for (int r = 0; r < 12; ++r) s += x.data<float>()[r * 5 + c];
      if (std::string(fn) == "mean") s /= 12;
      EXPECT_NEAR(out.data<float>()[c], s, 1e-5) << fn << " column " << c;
    }
  }
  // Over trailing dims it stays oneDNN's reduction.
  Tensor x = Random({3, 4}, 22), rows(v1::DTYPE_F32, {3, 1});
  auto k = CreateReduce("max", x, rows);
  ASSERT_TRUE(k.ok()) << k.status();
  ASSERT_TRUE((*k)->Run().ok());
  for (int r = 0; r < 3; ++r)
    EXPECT_EQ(rows.data<float>()[r],
              *std::max_element(x.data<float>() + r * 4, x.data<float>() + r * 4 + 4));
}

}  // namespace
}  // namespace meshrun
