// The seeds' workloads as ready-made train steps, shared by the end-to-end tests, `meshrun plan`
// and `meshrun bench step`, and the named layouts they run under:
//   mlp           seed 000: MLP of 4 scan-stacked DotReluDot(1024) blocks, batch 8, Adam 1e-3,
//                 loss y.sum(); input jax.random.normal(key(1), (8, 1024)).
//   dot_relu_dot  seed 003: DotReluDot(1024) (lecun_normal, no bias) with MSE, Adam 1e-3; input
//                 and label jax.random.normal(key(1) / key(2), (8, 1024)), laid out ('batch',
//                 None).
//   classifier    the seed classifier (the main job's model, ClassifierLoss): Dense 784->512,
//                 SiLU, Dense 512->10, softmax cross-entropy with integer labels, AdamW 1e-3, 2
//                 minibatches of 32 real Fashion-MNIST images (u8 "image" [784] and "label" [],
//                 as the IDX dataset's fields) and dropout off, so that every layout computes the
//                 same function.
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

// The main job's model (shared/seeds/001's DPClassifier): image u8 [b, image_size] scaled by
// 1/255, Dense(hidden) 'input_dense' with kernel axes ('embed', 'hidden'), SiLU,
// Dropout(dropout_rate) (keys folded over the batch axes), Dense(num_classes) 'output_dense' with
// kernel axes ('hidden', 'classes'), softmax cross-entropy against label u8 [b] (integer labels).
// Sows "correct" (the batch's correct predictions), which the job's accuracy is computed from.
// `dtype`: both Dense layers' computation dtype (flax's dtype=; bf16 is mixed precision with f32
// parameters, nn::DenseOptions); the logits are cast to f32 before the loss and the accuracy.
struct ClassifierOptions {
  int64_t hidden_size = 512;
  int64_t num_classes = 10;
  float dropout_rate = 0.1f;
  DType dtype = v1::DTYPE_F32;
};
LossFn ClassifierLoss(const ClassifierOptions& options);
// The batch inputs of ClassifierLoss for a minibatch of `minibatch` examples of `image_size`.
std::vector<BatchSpec> ClassifierBatch(int64_t minibatch, int64_t image_size = 784);

// How a seed workload computes. `dtype` is its layers' computation dtype (flax's dtype=, with
// param_dtype f32): bf16 runs every Dense / DotReluDot GEMM as a oneDNN bf16 matmul accumulating
// in f32 (nn::DenseOptions::dtype), while the parameters, their gradients, the gradients'
// all-reduces and the optimizer state stay f32; the model's output is cast to f32 before the loss
// (the job config's "precision": {"compute": "bf16"}).
struct WorkloadOptions {
  DType dtype = v1::DTYPE_F32;
};

// Errors: NotFound naming the workload and the known ones; InvalidArgument for a dtype other
// than f32 and bf16.
absl::StatusOr<Workload> SeedWorkload(const std::string& name, const WorkloadOptions& options = {});
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
