// Optimizer updates with optax's exact definitions (see shared/REFERENCE.md).
#ifndef MESHRUN_CORE_OPTIM_ADAMW_H_
#define MESHRUN_CORE_OPTIM_ADAMW_H_

#include <cstdint>

#include "absl/types/span.h"

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

// One parameter's part of an AdamWSweep: n elements, read from the *_in arrays and grad and
// written to the *_out ones, with AdamWUpdate's out-of-place rules (an output may be its own
// input, nothing else may alias). `param_bf16`, if not null: n more elements, written with
// param_out's values rounded to bf16 (F32ToBf16's bits; the bf16 compute copy of a master
// weight, Tensor::bf16_copy), aliasing nothing else.
struct AdamWSegment {
  const float* param_in;
  const float* grad;
  const float* mu_in;
  const float* nu_in;
  float* param_out;
  float* mu_out;
  float* nu_out;
  int64_t n;
  uint16_t* param_bf16 = nullptr;
};

// One optax.adamw step over every segment (a model's parameters) in one sweep, as PyTorch's
// fused Adam applies itself to a list of tensors (multi_tensor_apply) and XLA fuses optax's
// update over a pytree: the segments' elements are cut into blocks of kAdamWSweepBlock and the
// blocks shared out statically over the calling thread's OpenMP team, so a worker's compute
// threads all take part however the elements are split among parameters. Under
// kAdamWSweepParallelMin elements in all it runs on the calling thread alone (waking the team
// would cost more than it saves). Each element's bits are AdamWUpdate's. No segment's output
// may alias another segment's arrays. Calls on disjoint arrays may run concurrently.
inline constexpr int64_t kAdamWSweepBlock = 8192;
inline constexpr int64_t kAdamWSweepParallelMin = 65536;
void AdamWSweep(const AdamWHyperParams& hp, int64_t count, absl::Span<const AdamWSegment> segments);

}  // namespace meshrun

#endif  // MESHRUN_CORE_OPTIM_ADAMW_H_
