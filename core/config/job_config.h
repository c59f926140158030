// The train job config: what a user writes (JSON) and what the coordinator plans from.
#ifndef MESHRUN_CORE_CONFIG_JOB_CONFIG_H_
#define MESHRUN_CORE_CONFIG_JOB_CONFIG_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace meshrun {

// Schema (every key optional; defaults are the seed's DPClassifier run on Fashion-MNIST):
// {
//   "mesh":      {"data": 8},                        axis name -> size; must match the cluster
//   "model":     {"name": "dp_classifier", "hidden_size": 512, "num_classes": 10,
//                 "dropout_rate": 0.1},
//   "sharding":  {"layout": "fsdp"} or {"rules": [["batch", "data"], ["hidden", "model"]],
//                 "fsdp_axis": "data", "min_weight_size": 262144},
//   "optimizer": {"name": "adamw" | "adam" | "sgd", "learning_rate": 1e-3, "b1": 0.9,
//                 "b2": 0.999, "eps": 1e-8, "weight_decay": 1e-4, "num_minibatches": 4},
//   "data":      {"dataset": "fashion_mnist" | "npy" | "synthetic",
//                 "path": "/usr/share/datasets/fashion-mnist", "eval_path": "",
//                 "batch_size": 128, "eval_batch_size": 0, "shuffle": true,
//                 "drop_remainder": true},
//   "train":     {"epochs": 1, "max_steps": 0, "seed": 42, "log_every": 50, "evaluate": true,
//                 "collective_timeout_seconds": 30, "on_nonfinite": "stop"},
//   "checkpoint": {"dir": "", "save_every": 0, "keep": 0, "async": false, "resume": false,
//                  "init_from": ""},
//   "precision": {"compute": "f32" | "bf16", "reduce": "f32" | "bf16"},
//   "recovery":  {"max_restarts": 0, "timeout_seconds": 60, "min_workers": 0,
//                 "peer_state_every": 0}
// }
// Every model is a train step derived from the model by autodiff (client/include/meshrun/
// train_step.h), partitioned by the coordinator and looped by its JobDriver. model.name
// "dp_classifier" is the main job (shared/seeds/001's classifier, client/include/meshrun/
// workloads.h's ClassifierLoss) with the model, optimizer and data keys above; "mlp",
// "dot_relu_dot" and "classifier" are the seeds' workloads as they are. "sharding" picks the
// layout: a named one (single, dp, fsdp, tp, 2d, fsdp_tp; dp_classifier's default is dp) or
// logical axis rules, as Flax writes them (a rule maps a logical axis to a mesh axis, a list of
// mesh axes, or null), with FSDP over `fsdp_axis` for parameters larger than `min_weight_size`.
// Data (core/data/input_pipeline.h): every worker reads only its blocks of each step's global
// batch of `batch_size` examples, shuffled per epoch from `train.seed` (`shuffle`), an epoch's
// last partial batch dropped (`drop_remainder`; else batches span epochs). "fashion_mnist" reads
// the IDX files at `path` (train split; the test split for evaluation, in batches of
// `eval_batch_size`); "npy" a directory of .npy files, one per batch input of the model
// (dp_classifier: image.npy u8 [n, 784] or [n, 28, 28], label.npy u8 [n]), evaluating on
// `eval_path` if set; "synthetic" (the default for the seed workloads) trains on the workload's
// own batch every step. `max_steps` > 0 stops after that many steps (otherwise epochs * the
// steps per epoch; synthetic: 20).
// Mixed precision (every model): "compute": "bf16" is Flax's Dense(dtype=jnp.bfloat16,
// param_dtype=jnp.float32): each layer's input, kernel and bias are cast to bf16 and its GEMMs
// (forward and backward) run as oneDNN bf16 matmuls accumulating in f32; the parameters,
// gradients (cast back by the casts' VJP), their all-reduces and the optimizer state stay f32,
// and the model's output (the logits; mlp's and dot_relu_dot's prediction) is cast to f32 before
// the loss. "reduce": "bf16" (FSDP2's reduce_dtype; adam and adamw only) all-reduces (or, under
// FSDP, reduce-scatters) each gradient in bf16: half the bytes between workers, each partial sum
// rounded to bf16 (v1::AdamWAttrs.reduce_dtype); the update still reads the sum widened to f32.
// Gradients under 256 KiB (CollectiveOptions::combine_max_bytes) stay in the f32 bucket.
// Checkpoint policy (core/checkpoint/checkpoint.h has the format): with a `dir`, the TrainState
// (params, opt_state, rng; the step in the manifest) is saved every `save_every` steps (0: only
// at the end) and always at the end of the job, keeping the newest `keep` (0: all); `async`
// writes from a snapshot while the next steps run (a second save waits for the first); `resume`
// continues from the newest committed checkpoint in `dir` (none there: from the start).
// `init_from` starts from a safetensors file of parameters under their names
// (params/input_dense/kernel ...), e.g. one written by `meshrun export` or by Python.
// Recovery (torchrun's --max-restarts): with `max_restarts` > 0, a worker lost mid-job (killed,
// hung or unreachable) is reported and the job continues on the re-formed cluster (the
// survivors restart; a replacement takes the lost rank: `meshrun up` respawns it, compose's
// restart policy restarts its container) from the newest committed checkpoint, waiting up to
// `timeout_seconds` for the whole mesh; with `min_workers` > 0, when it does not re-form in time
// the job goes on with a smaller `data` axis that the workers that rejoined fill (at least
// `min_workers` devices; the checkpoint is resharded onto it), as Horovod elastic's min_np.
// With `peer_state_every` > 0, every that many steps each worker keeps its blocks of the
// TrainState in memory and a copy on its ring successor; a recovery on the same mesh restores
// from the live workers' memory (no disk read) when that copy is at least as new as the newest
// checkpoint, as torchft heals from its peers. It costs up to four copies of a worker's state
// in memory (its own and its predecessor's, each with the previous keep's) and one transfer of it
// to the successor per keep.
// `on_nonfinite` "stop": a NaN or infinite loss stops the job with an error naming the step, and
// no checkpoint of that state or later is committed (CheckLossFinite). "skip_step" (optax's
// apply_if_finite): a step whose loss or updated parameters are not finite leaves the parameters
// and optimizer state unchanged, and the job goes on, reporting the step.
struct JobConfig {
  std::vector<std::pair<std::string, int>> mesh;  // empty: use the cluster's mesh
  struct Model {
    std::string name = "dp_classifier";
    int hidden_size = 512;
    int num_classes = 10;
    double dropout_rate = 0.1;
  } model;
  struct Sharding {
    std::string layout;     // a named layout; empty: `rules`
    std::string rules;      // as ParseLogicalAxisRules reads them: "batch=data,hidden=model"
    std::string fsdp_axis;  // non-empty: FSDP over this mesh axis
    int64_t min_weight_size = int64_t{1} << 18;
  } sharding;
  struct Optimizer {
    std::string name = "adamw";
    double learning_rate = 1e-3;
    double b1 = 0.9;
    double b2 = 0.999;
    double eps = 1e-8;
    double weight_decay = 1e-4;
    int num_minibatches = 4;
  } optimizer;
  struct Data {
    std::string dataset = "fashion_mnist";  // | "npy" | "synthetic"
    std::string path = "/usr/share/datasets/fashion-mnist";
    std::string eval_path;  // npy: the evaluation split's directory (empty: no evaluation)
    int batch_size = 128;
    int eval_batch_size = 0;  // 0: 1000 for fashion_mnist's 10,000 test images, else batch_size
    bool shuffle = true;
    bool drop_remainder = true;
  } data;
  struct Train {
    int epochs = 1;
    int64_t max_steps = 0;
    uint64_t seed = 42;
    int log_every = 50;
    bool evaluate = true;
    double collective_timeout_seconds = 30;
    std::string on_nonfinite = "stop";
    std::string when_busy = "queue";  // | "refuse": while another job runs on the cluster
  } train;
  struct Precision {
    std::string compute = "f32";  // | "bf16"
    std::string reduce = "f32";   // | "bf16": the gradients' all-reduce dtype
  } precision;
  struct Recovery {
    int max_restarts = 0;
    double timeout_seconds = 60;
    int min_workers = 0;
    int peer_state_every = 0;  // steps; 0: no in-memory copies
  } recovery;
  struct Checkpoint {
    std::string dir;  // empty: no checkpoints
    int save_every = 0;
    int keep = 0;
    bool async = false;
    bool resume = false;
    std::string init_from;
  } checkpoint;
};

// The non-finite guard: FailedPrecondition "non-finite loss nan at step 1 ..." unless `loss` (of
// step `step`, counted from 1 as the progress line counts) is finite.
absl::Status CheckLossFinite(int64_t step, double loss);

// Parses and validates a JSON job config. Errors (InvalidArgument) name the offending key and what
// was expected: malformed JSON, an unknown key ("unknown key 'model.hiden_size'; allowed: ..."),
// a wrong type, an out-of-range value, a value outside an enum ("'optimizer.name' is 'adamx';
// allowed: adamw, adam, sgd").
absl::StatusOr<JobConfig> ParseJobConfig(absl::string_view json_text);
// Reads FILE and parses it. Errors: NotFound naming the path, then those of ParseJobConfig.
absl::StatusOr<JobConfig> LoadJobConfig(const std::string& path);
// The config as canonical JSON (every key present); ParseJobConfig(ToJson(c)) == c.
std::string JobConfigToJson(const JobConfig& config);

}  // namespace meshrun

#endif  // MESHRUN_CORE_CONFIG_JOB_CONFIG_H_
