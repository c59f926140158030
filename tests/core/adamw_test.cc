// optax's adam, adamw and sgd (shared/REFERENCE.md): three updates from fixed gradients, against
// the values optax 0.2 (JAX 0.4.30) gives for the same inputs.
#include "core/optim/adamw.h"

#include <omp.h>

#include <cstring>
#include <random>
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

// One parameter's arrays for the sweep test, filled from `rng`.
struct ParamState {
  std::vector<float> p, g, mu, nu, p_out, mu_out, nu_out;
  ParamState(int64_t n, std::mt19937& rng)
      : p(n), g(n), mu(n), nu(n), p_out(n), mu_out(n), nu_out(n) {
    std::normal_distribution<float> normal;
    for (int64_t i = 0; i < n; ++i) {
      p[i] = normal(rng);
      g[i] = normal(rng) * 1e-2f;
      mu[i] = normal(rng) * 1e-3f;
      nu[i] = std::abs(normal(rng)) * 1e-5f;
    }
  }
  AdamWSegment Segment(bool in_place) {
    if (in_place) {
      return {p.data(), g.data(),  mu.data(), nu.data(),
              p.data(), mu.data(), nu.data(), static_cast<int64_t>(p.size())};
    }
    return {p.data(),     g.data(),      mu.data(),     nu.data(),
            p_out.data(), mu_out.data(), nu_out.data(), static_cast<int64_t>(p.size())};
  }
};

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The sweep over several parameters (sizes that are and are not multiples of the vector width
// and of the sweep's block, one of them empty, in all above the parallel threshold) gives
// AdamWUpdate's bits for each, in place and out of place, on one thread and on several.
TEST(OptaxTest, AdamWSweepGivesEachParametersAdamWUpdateBits) {
  const std::vector<int64_t> sizes = {784 * 512, 512, 0, 1, 17, kAdamWSweepBlock + 3, 5130};
  AdamWHyperParams hp;
  hp.learning_rate = 3e-3f;
  hp.weight_decay = 0.05f;
  const int threads_before = omp_get_max_threads();
  for (int threads : {1, 3}) {
    for (bool in_place : {false, true}) {
      SCOPED_TRACE(testing::Message() << threads << " threads, in place " << in_place);
      omp_set_num_threads(threads);
      std::mt19937 rng(7);
      std::vector<ParamState> swept, each, before;
      for (int64_t n : sizes) {
        swept.emplace_back(n, rng);
        each.push_back(swept.back());
        before.push_back(swept.back());
      }
      std::vector<AdamWSegment> segments;
      for (ParamState& s : swept) segments.push_back(s.Segment(in_place));
      AdamWSweep(hp, 5, segments);
      for (size_t k = 0; k < sizes.size(); ++k) {
        const AdamWSegment e = each[k].Segment(in_place);
        AdamWUpdate(hp, 5, e.param_in, e.grad, e.mu_in, e.nu_in, e.param_out, e.mu_out, e.nu_out,
                    e.n);
        EXPECT_TRUE(SameBits(swept[k].p, each[k].p) && SameBits(swept[k].p_out, each[k].p_out))
            << "param " << k << " of " << sizes[k] << " elements";
        EXPECT_TRUE(SameBits(swept[k].mu, each[k].mu) && SameBits(swept[k].mu_out, each[k].mu_out))
            << "mu " << k;
        EXPECT_TRUE(SameBits(swept[k].nu, each[k].nu) && SameBits(swept[k].nu_out, each[k].nu_out))
            << "nu " << k;
        // The update did happen (untouched arrays would be equal too).
        if (sizes[k] > 0) {
          EXPECT_NE(in_place ? swept[k].p.back() : swept[k].p_out.back(), before[k].p.back()) << k;
        }
      }
    }
  }
  omp_set_num_threads(threads_before);
}

}  // namespace
}  // namespace meshrun
