#include "core/optim/adamw.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/collectives/reduce_kernels.h"

namespace meshrun {

// Built for AVX2+FMA and for the baseline ISA; the loader picks the best the CPU has. Element i
// reads only index i of each input before writing index i of each output, so an output may be its
// own input.
__attribute__((target_clones("avx2", "default"))) void AdamWUpdate(
    const AdamWHyperParams& hp, int64_t count, const float* param_in, const float* __restrict grad,
    const float* mu_in, const float* nu_in, float* param_out, float* mu_out, float* nu_out,
    int64_t n) {
  const float c1 = 1.0f / (1.0f - static_cast<float>(std::pow(double{hp.b1}, double(count))));
  const float c2 = 1.0f / (1.0f - static_cast<float>(std::pow(double{hp.b2}, double(count))));
  const float b1 = hp.b1, b2 = hp.b2, eps = hp.eps, lr = hp.learning_rate, wd = hp.weight_decay;
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i];
    const float p = param_in[i];
    const float m = b1 * mu_in[i] + (1.0f - b1) * g;
    const float v = b2 * nu_in[i] + (1.0f - b2) * g * g;
    mu_out[i] = m;
    nu_out[i] = v;
    const float update = (m * c1) / (std::sqrt(v * c2) + eps) + wd * p;
    param_out[i] = p - lr * update;
  }
}

void AdamWUpdate(const AdamWHyperParams& hp, int64_t count, float* param, const float* grad,
                 float* mu, float* nu, int64_t n) {
  AdamWUpdate(hp, count, param, grad, mu, nu, param, mu, nu, n);
}

void AdamWSweep(const AdamWHyperParams& hp, int64_t count,
                absl::Span<const AdamWSegment> segments) {
  struct Block {
    const AdamWSegment* segment;
    int64_t begin;
    int64_t len;
  };
  std::vector<Block> blocks;
  int64_t total = 0;
  for (const AdamWSegment& s : segments) {
    for (int64_t at = 0; at < s.n; at += kAdamWSweepBlock)
      blocks.push_back({&s, at, std::min(kAdamWSweepBlock, s.n - at)});
    total += s.n;
  }
  const int64_t num_blocks = static_cast<int64_t>(blocks.size());
#pragma omp parallel for schedule(static) if (total >= kAdamWSweepParallelMin)
  for (int64_t b = 0; b < num_blocks; ++b) {
    const AdamWSegment& s = *blocks[b].segment;
    const int64_t i = blocks[b].begin;
    AdamWUpdate(hp, count, s.param_in + i, s.grad + i, s.mu_in + i, s.nu_in + i, s.param_out + i,
                s.mu_out + i, s.nu_out + i, blocks[b].len);
    // (The block's new values are still in cache.)
    if (s.param_bf16 != nullptr) F32ToBf16(s.param_out + i, s.param_bf16 + i, blocks[b].len);
  }
}

}  // namespace meshrun
