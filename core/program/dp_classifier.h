// Builds the step program of the seed's DPClassifier (001: Dense -> SiLU -> Dropout -> Dense,
// softmax cross-entropy with integer labels, gradient accumulation, pmean of gradients over the
// data axis, optax.adamw) for a mesh with a 'data' axis.
#ifndef MESHRUN_CORE_PROGRAM_DP_CLASSIFIER_H_
#define MESHRUN_CORE_PROGRAM_DP_CLASSIFIER_H_

#include <vector>

#include "absl/status/statusor.h"
#include "core/checkpoint/checkpoint.h"
#include "core/config/job_config.h"
#include "core/sharding/mesh.h"
#include "meshrun/v1/program.pb.h"

namespace meshrun {

// The sharding plan: every parameter, gradient and optimizer-state array replicated (P()); the
// batch sharded P('data', None) so each worker holds batch_size / |data| examples, split into
// num_minibatches minibatches. Parameter names follow Flax: params/input_dense/kernel [784, H], ...
//
// Errors (InvalidArgument, naming the value): a mesh without a 'data' axis; a global batch not
// divisible by |data| * num_minibatches.
absl::StatusOr<v1::StepProgram> BuildDpClassifierProgram(const JobConfig& config, const Mesh& mesh);

// The TrainState of a step program as a checkpoint holds it (the worker's Trainer snapshots the
// same names): every PARAM and OPT_STATE buffer under its name, with its dtype, GLOBAL shape
// (row-major) and PartitionSpec, then "rng" (u32[2], the job's base PRNGKey, replicated).
std::vector<checkpoint::WantedArray> TrainStateArrays(const v1::StepProgram& program,
                                                      const Mesh& mesh);

// Test examples each worker evaluates per Evaluate call chunk.
inline constexpr int kEvalBatchSize = 250;
// Image size of Fashion-MNIST (28 x 28).
inline constexpr int kImageSize = 784;

}  // namespace meshrun

#endif  // MESHRUN_CORE_PROGRAM_DP_CLASSIFIER_H_
