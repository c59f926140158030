// The special functions CreateUnary computes through libm or its own series: digamma, lgamma,
// asinh and acosh against closed forms, and their poles and infinities as XLA's (jax.lax's).
#include <cmath>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "worker/kernels/kernel.h"

namespace meshrun {
namespace {

std::vector<float> RunUnary(const std::string& fn, const std::vector<float>& in) {
  Tensor x(v1::DTYPE_F32, {static_cast<int64_t>(in.size())}), y(v1::DTYPE_F32, x.dims());
  std::copy(in.begin(), in.end(), x.data<float>());
  auto k = CreateUnary(fn, x, y);
  EXPECT_TRUE(k.ok()) << k.status();
  if (!k.ok()) return {};
  EXPECT_TRUE((*k)->Run().ok());
  return std::vector<float>(y.data<float>(), y.data<float>() + in.size());
}

constexpr double kEulerGamma = 0.57721566490153286;

TEST(SpecialFunctionsTest, DigammaMeetsItsClosedFormsAndIsNanAtItsPoles) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> in = {1.0f, 0.5f,  2.0f,  10.0f, -0.5f, 1e-30f,
                                 0.0f, -0.0f, -3.0f, -inf,  inf};
  const std::vector<float> out = RunUnary("digamma", in);
  ASSERT_EQ(out.size(), in.size());
  // psi(1) = -gamma, psi(1/2) = -gamma - 2 ln 2, psi(2) = 1 - gamma, psi(10) = H_9 - gamma,
  // psi(-1/2) = psi(1/2) + 2 (the recurrence), psi(x) ~ -1/x as x -> 0.
  double h9 = 0.0;
  for (int k = 1; k <= 9; ++k) h9 += 1.0 / k;
  const double want[] = {-kEulerGamma,     -kEulerGamma - 2 * std::log(2.0),     1 - kEulerGamma,
                         h9 - kEulerGamma, -kEulerGamma - 2 * std::log(2.0) + 2, -1e30};
  for (int i = 0; i < 6; ++i)
    EXPECT_NEAR(out[i], want[i], 2e-7 * std::abs(want[i])) << "digamma(" << in[i] << ")";
  for (int i = 6; i < 10; ++i) EXPECT_TRUE(std::isnan(out[i])) << "digamma(" << in[i] << ")";
  EXPECT_EQ(out[10], inf);
}

TEST(SpecialFunctionsTest, LgammaAsinhAndAcoshMeetTheirClosedForms) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> lg = RunUnary("lgamma", {0.5f, 5.0f, -0.5f, 0.0f, -2.0f});
  ASSERT_EQ(lg.size(), 5u);
  EXPECT_NEAR(lg[0], 0.5 * std::log(M_PI), 1e-7);           // Gamma(1/2) = sqrt(pi)
  EXPECT_NEAR(lg[1], std::log(24.0), 1e-6);                 // Gamma(5) = 4!
  EXPECT_NEAR(lg[2], std::log(2 * std::sqrt(M_PI)), 1e-6);  // |Gamma(-1/2)| = 2 sqrt(pi)
  EXPECT_EQ(lg[3], inf);
  EXPECT_EQ(lg[4], inf);
  const std::vector<float> as = RunUnary("asinh", {0.75f, -0.75f, -0.0f, -inf});
  ASSERT_EQ(as.size(), 4u);
  EXPECT_NEAR(as[0], std::log(2.0), 1e-7);  // asinh(3/4) = ln(3/4 + 5/4)
  EXPECT_EQ(as[1], -as[0]);
  EXPECT_TRUE(as[2] == 0.0f && std::signbit(as[2]));
  EXPECT_EQ(as[3], -inf);
  const std::vector<float> ac = RunUnary("acosh", {1.25f, 1.0f, 0.5f, inf});
  ASSERT_EQ(ac.size(), 4u);
  EXPECT_NEAR(ac[0], std::log(2.0), 1e-7);  // acosh(5/4) = ln(5/4 + 3/4)
  EXPECT_EQ(ac[1], 0.0f);
  EXPECT_TRUE(std::isnan(ac[2]));
  EXPECT_EQ(ac[3], inf);
}

}  // namespace
}  // namespace meshrun
