// optax's adam, adamw and sgd (shared/REFERENCE.md): three updates from fixed gradients, against
// the values optax 0.2 (JAX 0.4.30) gives for the same inputs.
#include "core/optim/adamw.h"

#include <vector>

#include "gtest/gtest.h"

namespace meshrun {
namespace {

const std::vector<float> kParams = {0.5f, -1.0f, 2.0f, 0.0f};
const std::vector<std::vector<float>> kGrads = {
    {0.1f, -0.2f, 0.3f, 0.0f}, {-0.4f, 0.5f, 0.0f, 1e-3f}, {0.2f, 0.2f, -0.6f, -2.0f}};

std::vector<float> RunAdamW(const AdamWHyperParams& hp) {
  std::vector<float> p = kParams, mu(4, 0.0f), nu(4, 0.0f);
  for (size_t t = 0; t < kGrads.size(); ++t)
    AdamWUpdate(hp, t + 1, p.data(), kGrads[t].data(), mu.data(), nu.data(), 4);
  return p;
}

void ExpectNear(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-6f) << "element " << i;
}

TEST(OptaxTest, AdamMatchesOptax) {
  AdamWHyperParams hp;
  hp.learning_rate = 1e-2f;
  hp.weight_decay = 0.0f;
  ExpectNear(RunAdamW(hp), {0.4966967701911926f, -0.9998515844345093f, 1.9866998195648193f,
                            -0.0010559502989053726f});
}

TEST(OptaxTest, AdamWMatchesOptax) {
  AdamWHyperParams hp;
  hp.learning_rate = 1e-2f;
  hp.weight_decay = 0.1f;
  ExpectNear(RunAdamW(hp), {0.4952126741409302f, -0.9968701601028442f, 1.9807324409484863f,
                            -0.0010485094971954823f});
}

TEST(OptaxTest, OutOfPlaceAdamWEqualsInPlaceAndLeavesItsInputs) {
  AdamWHyperParams hp;
  hp.learning_rate = 1e-2f;
  hp.weight_decay = 0.1f;
  std::vector<float> p = kParams, mu(4, 0.0f), nu(4, 0.0f);
  for (size_t t = 0; t < kGrads.size(); ++t) {
    std::vector<float> p_out(4), mu_out(4), nu_out(4);
    const std::vector<float> p_in = p, mu_in = mu, nu_in = nu;
    AdamWUpdate(hp, t + 1, p.data(), kGrads[t].data(), mu.data(), nu.data(), p_out.data(),
                mu_out.data(), nu_out.data(), 4);
    EXPECT_EQ(p, p_in);
    EXPECT_EQ(mu, mu_in);
    EXPECT_EQ(nu, nu_in);
    p = p_out;
    mu = mu_out;
    nu = nu_out;
  }
  EXPECT_EQ(p, RunAdamW(hp));
}

}  // namespace
}  // namespace meshrun
