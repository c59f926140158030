#include "core/optim/adamw.h"

#include <cmath>

namespace meshrun {

// Built for AVX2+FMA and for the baseline ISA; the loader picks the best the CPU has.
__attribute__((target_clones("avx2", "default"))) void AdamWUpdate(const AdamWHyperParams& hp, int64_t count, float* __restrict param,
                 const float* __restrict grad, float* __restrict mu, float* __restrict nu, int64_t n) {
  const float c1 = 1.0f / (1.0f - static_cast<float>(std::pow(double{hp.b1}, double(count))));
  const float c2 = 1.0f / (1.0f - static_cast<float>(std::pow(double{hp.b2}, double(count))));
  const float b1 = hp.b1, b2 = hp.b2, eps = hp.eps, lr = hp.learning_rate, wd = hp.weight_decay;
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i];
    const float m = b1 * mu[i] + (1.0f - b1) * g;
    const float v = b2 * nu[i] + (1.0f - b2) * g * g;
    mu[i] = m;
    nu[i] = v;
    const float update = (m * c1) / (std::sqrt(v * c2) + eps) + wd * param[i];
    param[i] -= lr * update;
  }
}

void SgdUpdate(float learning_rate, float* param, const float* grad, int64_t n) {
  for (int64_t i = 0; i < n; ++i) param[i] -= learning_rate * grad[i];
}

}  // namespace meshrun
