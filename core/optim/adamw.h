// Optimizer updates with optax's exact definitions (see shared/REFERENCE.md).
#ifndef MESHRUN_CORE_OPTIM_ADAMW_H_
#define MESHRUN_CORE_OPTIM_ADAMW_H_

#include <cstdint>

namespace meshrun {

struct AdamWHyperParams {
  float learning_rate = 1e-3f;
  float b1 = 0.9f;
  float b2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 1e-4f;  // 0 gives optax.adam
};

// One optax.adamw step over n f32 elements, in place on param, mu, nu. `count` is the step number
// t, counting from 1 (the bias corrections use b^t). grad is not modified. Arrays must not alias.
void AdamWUpdate(const AdamWHyperParams& hp, int64_t count, float* param, const float* grad,
                 float* mu, float* nu, int64_t n);

// The same step out of place: reads param_in, mu_in, nu_in and writes param_out, mu_out, nu_out
// (one pass over memory instead of a copy then an in-place update). Each output may be its own
// input (then it is updated in place) but must not alias any other array.
void AdamWUpdate(const AdamWHyperParams& hp, int64_t count, const float* param_in,
                 const float* grad, const float* mu_in, const float* nu_in, float* param_out,
                 float* mu_out, float* nu_out, int64_t n);

}  // namespace meshrun

#endif  // MESHRUN_CORE_OPTIM_ADAMW_H_
