// Train steps derived from a loss function, and the TrainState they update on the cluster.
//
// BuildTrainStep traces the loss twice, as jax.jit does with abstract values: the first trace
// (no cluster, nothing allocated: jax.eval_shape) finds the parameters and their layouts; the
// second builds the global step program: the forward pass per minibatch, its VJP
// (JitBuilder::Grad), the mean of the minibatch gradients, and the optimizer update, then
// partitioned. Gradients of sharded parameters come out with the parameter's sharding (a
// data-parallel psum, FSDP's psum_scatter), and the optimizer state is sharded exactly like its
// parameter.
//
//   nn::ShardingConfig sharding{*ParseLogicalAxisRules("batch=data,hidden=model")};
//   auto step = BuildTrainStep(mesh, sharding, OptimizerConfig{}, {{"x", {8, 1024}, {"batch",
//   ""}}},
//       [](nn::Scope& s, const std::vector<nn::Value>& b) {
//         JitBuilder& jit = s.jit();
//         return jit.Reduce("sum", nn::Mlp(s.Child("mlp"), b[0], 4, 1024, true), {0, 1});
//       }, /*seed=*/0);
//   auto state = TrainState::Init(client, *step);   // sharded init: each worker draws its blocks
//   state->Step({x_id});                             // -> the loss
//
// TrainState: step (f32 [], the number of updates applied, exact to 2^24), rng (u32 [2],
// jax.random.PRNGKey(seed); step k's dropout keys are fold_in(fold_in(rng, k), minibatch)),
// params, opt_state (optax.adam's mu and nu per parameter; none for sgd). Each is an array on the
// cluster named
// "<prefix>/<name>" (e.g. train_state/params/mlp/W1, train_state/opt_state/mu/params/mlp/W1).
#ifndef MESHRUN_CLIENT_INCLUDE_MESHRUN_TRAIN_STEP_H_
#define MESHRUN_CLIENT_INCLUDE_MESHRUN_TRAIN_STEP_H_

#include <functional>
#include <future>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/sharding/mesh.h"
#include "meshrun/client.h"
#include "meshrun/jit.h"
#include "meshrun/nn.h"

namespace meshrun {

// optax.sgd, optax.adam, optax.adamw (shared/REFERENCE.md).
struct OptimizerConfig {
  enum Kind { kSgd, kAdam, kAdamW };
  Kind kind = kAdam;
  float learning_rate = 1e-3f;
  float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f;
  float weight_decay = 1e-4f;  // adamw only
  // optax.apply_if_finite: a step whose loss or updated parameters hold a NaN or an infinity
  // leaves the parameters and optimizer state as they were (the step count still advances, and
  // with it Adam's bias correction, where optax keeps a count of its own). Costs a scalar check
  // per parameter and the in-place update (the old state is read after it).
  bool apply_if_finite = false;
  // The dtype each gradient is all-reduced (or, under FSDP, reduce-scattered) in, as FSDP2's
  // MixedPrecisionPolicy.reduce_dtype: f32, or bf16 (each device's partial rounded to bf16, the
  // sum taken in bf16, then widened to f32 for the update; half the bytes between workers).
  // Gradients small enough to be bucketed (CollectiveOptions::combine_max_bytes, 256 KiB) are
  // summed in f32 with the step's other small reductions, in one meeting of the group.
  // adam and adamw only: BuildTrainStep refuses bf16 with sgd.
  DType reduce_dtype = v1::DTYPE_F32;
};
// "sgd", "adam", "adamw". Errors: InvalidArgument naming the value.
absl::StatusOr<OptimizerConfig::Kind> ParseOptimizerKind(const std::string& name);

// One batch input: its global shape per minibatch and the logical names of its dims
// (('batch', None) -> P('data', None) under batch=data). With num_minibatches k > 1 the array fed
// is [k, ...shape] (the seed's accumulate_gradients reshape), its leading dim unsharded.
struct BatchSpec {
  std::string name;
  Dims shape;
  std::vector<std::string> logical_axes;
  DType dtype = v1::DTYPE_F32;  // as the data holds it (u8 images: convert in the loss)
};

// The loss of one minibatch: a scalar f32 value of scope.jit().
using LossFn = std::function<nn::Value(nn::Scope& scope, const std::vector<nn::Value>& batch)>;

// An array of the TrainState or of the batch, as the plan lists it.
struct PlannedArray {
  std::string name;
  Dims shape;
  PartitionSpec spec;
  int64_t bytes_per_worker = 0;
  DType dtype = v1::DTYPE_F32;  // f32, but the rng key (u32 [2])
};

struct TrainStep {
  Mesh mesh;
  // Arguments: state (in `state`'s order), then the batch; results: the new state, the mean
  // loss of the step (f32 []), then each of `metrics` (f32 [], summed over the minibatches).
  // State arguments are donated. `step_global` is the step as the
  // user's model traced it (forward, grad, optimizer; no collectives): what TrainState::Step
  // sends, for the coordinator to partition (Client::Jit); `step` is the same program partitioned
  // here, for the plan and the checks before anything is allocated.
  v1::GlobalProgram step_global;
  v1::ShardMapProgram step;
  // No arguments; results: the initial state but the rng (sharded initialisation).
  v1::ShardMapProgram init;
  std::vector<nn::ParamInfo> params;
  std::vector<PlannedArray> state;  // "step", "rng", "params/...", "opt_state/mu/params/...", ...
  std::vector<PlannedArray> batch;
  std::vector<JitBuilder::Collective> collectives;  // of one step
  int num_minibatches = 1;
  uint64_t seed = 0;  // of the initialisation and of TrainState.rng
  nn::ShardingConfig sharding;
  std::vector<std::string> metrics;  // what the loss sowed (nn::Scope::Sow), in order

  // Bytes of params + optimizer state each worker holds.
  int64_t StateBytesPerWorker() const;
  // What `meshrun plan` prints: every state array's PartitionSpec and bytes per worker (as the
  // seeds print state_spec), the batch layout, and the collectives of one step with their bytes.
  std::string Plan() const;
};

// Errors (InvalidArgument, before anything is allocated), naming the parameter or input and the
// dim: a rule naming a mesh axis that does not exist, a logical name on two dims, a shape that
// does not divide, a loss that is not a scalar, an op the partitioner cannot lay out.
absl::StatusOr<TrainStep> BuildTrainStep(const Mesh& mesh, const nn::ShardingConfig& sharding,
                                         const OptimizerConfig& optimizer,
                                         const std::vector<BatchSpec>& batch, const LossFn& loss,
                                         uint64_t seed, int num_minibatches = 1);

// The evaluation step of `step`'s model (Flax's deterministic apply; Dropout off): arguments the
// parameters (in step.params' order and layouts), then the batch (`batch`'s shapes, one batch,
// no minibatch dim, laid out by step.sharding's rules); results the mean loss (f32 []) and each
// of step.metrics (f32 []), replicated. Errors: BuildTrainStep's.
absl::StatusOr<v1::GlobalProgram> BuildEvalStep(const TrainStep& step,
                                                const std::vector<BatchSpec>& batch,
                                                const LossFn& loss);

// A TrainState living on the cluster. Not thread-safe; the arrays stay on the cluster until
// Delete.
class TrainState {
 public:
  TrainState(TrainState&&) = default;
  TrainState& operator=(TrainState&&) = default;
  ~TrainState();  // waits for an async save in flight

  // Runs `step.init` on the cluster: every worker draws only its blocks of the parameters (the
  // values equal the unsharded draw for the seed, whatever the mesh) and zeroes its blocks of the
  // optimizer state. Errors: the cluster's (e.g. an id in use under `prefix`).
  static absl::StatusOr<TrainState> Init(Client* client, const TrainStep* step,
                                         std::string prefix = "train_state");

  // Init, then the parameters from a safetensors file (the job's init_from) holding unsharded
  // arrays under the parameter names (params/dot1/kernel, as `meshrun export` writes them, or
  // Python's safetensors): each worker receives only its block. Errors: NotFound naming a
  // parameter the file lacks; InvalidArgument naming one whose shape or dtype differs.
  static absl::StatusOr<TrainState> InitFrom(Client* client, const TrainStep* step,
                                             const std::string& path,
                                             std::string prefix = "train_state");

  // The TrainState as it was when the step loop stopped: every array restored from the
  // checkpoint directory `path` into `step`'s layouts (which may differ from the layouts it was
  // saved under: DP -> FSDP, 2x4 -> 1 worker, ...). Errors: NotFound naming a missing array,
  // DataLoss naming a corrupt block's array and file.
  static absl::StatusOr<TrainState> Restore(Client* client, const TrainStep* step,
                                            const std::string& path,
                                            std::string prefix = "train_state");
  // Saves the whole TrainState (step, params, opt_state) as <root>/step_<steps()>, each worker
  // writing its own blocks; keep > 0 keeps only the newest `keep` checkpoints. Returns the
  // committed directory.
  absl::StatusOr<std::string> Save(const std::string& root, int keep = 0);
  // Orbax's AsyncCheckpointer / DCP's async_save: returns once a snapshot of the state is taken
  // (a copy on each worker, so the next steps may replace the state), and writes it in the
  // background. A second save first waits for the one in flight. WaitForSave returns the
  // committed directory of the last async save (or its error).
  absl::Status SaveAsync(const std::string& root, int keep = 0);
  absl::StatusOr<std::string> WaitForSave();

  // One step on batch arrays already on the cluster (laid out as step.batch). Returns the loss.
  absl::StatusOr<float> Step(const std::vector<std::string>& batch_ids);
  // One step per batch (each as Step's batch_ids), all in one call: the workers run them back to
  // back with no round trip between them (Keras's steps_per_execution). Returns the losses in
  // order. Errors: Step's (for a batch, naming the step); a step that fails fails the call and,
  // as with Step, consumes the donated TrainState.
  absl::StatusOr<std::vector<float>> Steps(const std::vector<std::vector<std::string>>& batches);
  // device_get of one state array by its name ("params/mlp/W1").
  absl::StatusOr<Tensor> Get(const std::string& name) const;
  // The cluster id of a state array.
  std::string Id(const std::string& name) const { return prefix_ + "/" + name; }
  int64_t steps() const { return steps_; }
  absl::Status Delete();

 private:
  TrainState(Client* client, const TrainStep* step, std::string prefix)
      : client_(client), step_(step), prefix_(std::move(prefix)) {}
  // Saves every state array, read from the ids Id(id_prefix + name), under its name.
  v1::SaveCheckpointRequest SaveRequest(const std::string& root, int keep,
                                        const std::string& id_prefix) const;
  Client* client_;
  const TrainStep* step_;
  std::string prefix_;
  int64_t steps_ = 0;
  std::future<absl::StatusOr<std::string>> pending_save_;
};

}  // namespace meshrun

#endif  // MESHRUN_CLIENT_INCLUDE_MESHRUN_TRAIN_STEP_H_
