// The seeds' workloads as ready-made train steps, shared by the end-to-end tests, `meshrun plan`
// and `meshrun bench step`, and the named layouts they run under:
//   mlp           seed 000: MLP of 4 scan-stacked DotReluDot(1024) blocks, batch 8, Adam 1e-3,
//                 loss y.sum(); input jax.random.normal(key(1), (8, 1024)).
//   dot_relu_dot  seed 003: DotReluDot(1024) (lecun_normal, no bias) with MSE, Adam 1e-3; input
//                 and label jax.random.normal(key(1) / key(2), (8, 1024)), laid out ('batch',
//                 None).
//   classifier    the seed classifier (main job): Dense 784->512, SiLU, Dense 512->10, softmax
//                 cross-entropy, AdamW 1e-3, 2 minibatches of 32 real Fashion-MNIST images
//                 (dropout off, so that every layout computes the same function).
// Layouts (logical axis rules and FSDP):
//   single  no rules (everything replicated; run it on one worker)
//   dp      batch=data
//   fsdp    batch=data, parameters over 'data' (min_weight_size 2^18)
//   tp      hidden=model
//   2d      batch=data, hidden=model
//   fsdp_tp batch=data, hidden=model, parameters over 'data'
#ifndef MESHRUN_CLIENT_INCLUDE_MESHRUN_WORKLOADS_H_
#define MESHRUN_CLIENT_INCLUDE_MESHRUN_WORKLOADS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/tensor.h"
#include "meshrun/train_step.h"

namespace meshrun {

struct Workload {
  std::string name;
  std::string description;
  std::vector<BatchSpec> batch;
  LossFn loss;
  OptimizerConfig optimizer;
  int num_minibatches = 1;
  int64_t examples_per_step = 0;
};

// Errors: NotFound naming the workload and the known ones.
absl::StatusOr<Workload> SeedWorkload(const std::string& name);
std::vector<std::string> SeedWorkloadNames();

// The host batch of a workload, in BatchSpec order (with the leading minibatch dim when
// num_minibatches > 1). Errors: those of loading Fashion-MNIST from `data_dir` (classifier).
absl::StatusOr<std::vector<Tensor>> SeedWorkloadBatch(
    const Workload& workload, const std::string& data_dir = "/usr/share/datasets/fashion-mnist");

// Errors: NotFound naming the layout and the known ones.
absl::StatusOr<nn::ShardingConfig> LayoutSharding(const std::string& layout);
std::vector<std::string> LayoutNames();

}  // namespace meshrun

#endif  // MESHRUN_CLIENT_INCLUDE_MESHRUN_WORKLOADS_H_
