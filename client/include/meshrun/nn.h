// A Flax-like layer library over JitBuilder: modules declare parameters with logical axis names
// (nn.with_logical_partitioning), a job's ShardingConfig maps them onto the mesh
// (nn.logical_to_mesh, then the seed's FSDP rule), and the layers are written once, as for one
// device; the partitioner (meshrun/jit.h) decides every intermediate's layout.
//
//   JitBuilder jit(mesh);
//   nn::Scope scope(jit, sharding);             // the "params" collection
//   auto y = nn::Mlp(scope.Child("mlp"), x, /*num_layers=*/4, /*depth=*/1024, /*use_scan=*/true);
//   scope.params();                             // name, shape, logical axes, PartitionSpec
//
// Shapes are global and row-major, f32. Not thread-safe.
#ifndef MESHRUN_CLIENT_INCLUDE_MESHRUN_NN_H_
#define MESHRUN_CLIENT_INCLUDE_MESHRUN_NN_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/sharding/logical_axes.h"
#include "core/sharding/partition_spec.h"
#include "core/tensor.h"
#include "meshrun/jit.h"

namespace meshrun::nn {

using Value = JitBuilder::Value;

// flax.linen.initializers (shared/REFERENCE.md), resolved against a parameter's shape; the fans
// leave out `batch_dims` leading dims (the layer dim of scan-stacked parameters).
struct Initializer {
  enum Kind { kZeros, kOnes, kNormal, kLecunNormal, kXavierNormal };
  Kind kind = kZeros;
  float stddev = 1.0f;  // kNormal only
};
inline Initializer Zeros() { return {Initializer::kZeros, 0}; }
inline Initializer Ones() { return {Initializer::kOnes, 0}; }
inline Initializer Normal(float stddev) { return {Initializer::kNormal, stddev}; }
// variance_scaling(1, fan_in, truncated_normal): stddev sqrt(1/fan_in) / 0.87962566103423978.
inline Initializer LecunNormal() { return {Initializer::kLecunNormal, 0}; }
// variance_scaling(1, fan_avg, normal): stddev sqrt(2 / (fan_in + fan_out)).
inline Initializer XavierNormal() { return {Initializer::kXavierNormal, 0}; }

// How an initializer draws a parameter: OP_RANDOM_INIT's fn (zeros, ones, normal,
// truncated_normal) and scale. fan_in is the second-to-last dim (1 for a 1-D parameter) times
// nothing else; fan_out the last. Errors: InvalidArgument for a variance-scaling initializer on a
// parameter with fewer than batch_dims + 2 dims.
struct Draw {
  std::string fn;
  float scale = 0;
};
absl::StatusOr<Draw> ResolveInitializer(const Initializer& init, const Dims& shape, int batch_dims);

// The key a parameter is drawn with: fold_in(PRNGKey(seed), fnv1a32(name)), so a parameter's
// values depend on its name and the seed, not on the mesh, the layout or declaration order.
std::array<uint32_t, 2> ParamKey(uint64_t seed, const std::string& name);

// One parameter of the model (nn.get_partition_spec's view of it).
struct ParamInfo {
  std::string name;                       // "params/mlp/W1"
  Dims shape;                             // global
  std::vector<std::string> logical_axes;  // one per dim; "" = unannotated
  PartitionSpec spec;                     // logical_to_mesh, then FSDP
  Initializer init;
  int batch_dims = 0;
  std::string fsdp_note;  // why FSDP left it alone (empty when it sharded it)
};

// A job's layout: the same model runs data parallel, FSDP, tensor parallel or 2-D by this alone.
struct ShardingConfig {
  LogicalAxisRules rules;  // (('batch', 'data'), ('hidden', 'model'))
  std::string fsdp_axis;   // non-empty: parameters above min_weight_size sharded over it (ZeRO-3)
  int64_t min_weight_size = int64_t{1} << 18;
};

// Flax's module scope while tracing: declares parameters (as JitBuilder inputs laid out by the
// config) and hands out their values. A Scope may be given the parameters of an earlier trace
// (`declared`), as the train step's second, real trace is: then Param returns those in their
// order and a parameter the earlier trace did not declare is an error.
class Scope {
 public:
  Scope(JitBuilder& jit, ShardingConfig sharding);
  Scope(JitBuilder& jit, ShardingConfig sharding, const std::vector<ParamInfo>& declared);

  // self.param(name, nn.with_logical_partitioning(init, logical_axes), shape). The same name
  // returns the same value (parameters are shared by every use, e.g. every minibatch).
  // Errors (recorded; status()): a logical-axes list whose length is not the rank, a logical name
  // on two dims, a layout that does not divide the shape: each naming the parameter and the dim.
  Value Param(const std::string& name, const Dims& shape,
              const std::vector<std::string>& logical_axes, Initializer init, int batch_dims = 0);
  Scope Child(const std::string& name) const;
  // nn.with_logical_constraint: the value constrained to the layout the rules give its dims.
  Value WithLogicalConstraint(Value x, const std::vector<std::string>& logical_axes);
  // The PartitionSpec the rules give `logical_axes` (for inputs: ('batch', None) etc.).
  absl::StatusOr<PartitionSpec> LogicalSpec(const std::vector<std::string>& logical_axes) const;

  // self.make_rng('dropout'): a fresh key per call, derived from the key SetRng gave (the train
  // step sets fold_in(fold_in(TrainState.rng, step), minibatch)). Errors (recorded) when none
  // was set.
  Value MakeRng();
  void SetRng(Value key) {
    shared_->rng = key;
    shared_->rng_count = 0;
  }
  // The mesh axes the rules map 'batch' to: dropout folds its key over them.
  std::vector<std::string> BatchAxes() const;

  // Flax's self.sow('metrics', name, value): records a scalar f32 metric of the step (e.g. the
  // number of correct predictions); the train step sums each over its minibatches and returns it
  // beside the loss, in the order first sown. Errors (recorded) for a non-scalar value.
  void Sow(const std::string& name, Value value);
  // The metrics sown so far, in order, and forgetting them (the train step takes them per
  // minibatch).
  std::vector<std::pair<std::string, Value>> TakeSown();
  // Evaluation (Flax's deterministic=True / model.eval()): Dropout is the identity.
  bool deterministic() const { return shared_->deterministic; }
  void set_deterministic(bool d) { shared_->deterministic = d; }

  JitBuilder& jit() const { return *shared_->jit; }
  const std::vector<ParamInfo>& params() const { return shared_->params; }
  const std::vector<Value>& param_values() const { return shared_->values; }
  // The first error, the scope's own or its JitBuilder's (an op the layers traced that failed:
  // later values are invalid, so reporting the scope's own later error would hide the cause);
  // Param and the layers return invalid values after it.
  absl::Status status() const {
    return shared_->status.ok() ? shared_->jit->status() : shared_->status;
  }
  const ShardingConfig& sharding() const { return shared_->sharding; }

 private:
  struct Shared {
    JitBuilder* jit = nullptr;
    ShardingConfig sharding;
    std::vector<ParamInfo> params;
    std::vector<Value> values;
    std::map<std::string, int> index;
    std::vector<ParamInfo> declared;
    bool predeclared = false;
    absl::Status status;
    Value rng;
    int rng_count = 0;
    std::vector<std::pair<std::string, Value>> sown;
    bool deterministic = false;
  };
  Scope(std::shared_ptr<Shared> shared, std::string path)
      : shared_(std::move(shared)), path_(std::move(path)) {}
  std::shared_ptr<Shared> shared_;
  std::string path_;
};

// nn.Dense: y = x @ kernel (+ bias), x [..., in] -> [..., features]. kernel [in, features] with
// logical axes `kernel_axes`, bias [features] with the kernel's last axis name.
// `dtype` is flax's: the computation's dtype. bf16 casts x, the kernel and the bias to bf16 (the
// matmul a oneDNN bf16 GEMM accumulating in f32, the result bf16); the parameters themselves stay
// f32 (flax's param_dtype), and their gradients come back f32 through the casts' VJP. The bias
// joins the GEMM's f32 accumulator and the sum is rounded to bf16 once, as torch.autocast's
// linear and oneDNN's bf16 matmul with a bias compute it (flax's layer under jax.jit rounds the
// product before the add as well: one rounding more; the Python SDK computes that one).
struct DenseOptions {
  std::vector<std::string> kernel_axes = {"embed", "hidden"};
  bool use_bias = true;
  Initializer kernel_init = LecunNormal();
  DType dtype = v1::DTYPE_F32;
};
Value Dense(Scope scope, Value x, int64_t features, const DenseOptions& options = {});

// The seeds' DotReluDot (000, 002, 003): W1 [in, depth] ('embed', 'hidden'), y = relu(x @ W1)
// constrained to ('batch', 'hidden'), W2 [depth, in] ('hidden', 'embed'), z = y @ W2 constrained
// to ('batch', 'embed'); both xavier_normal. x: [batch, in].
// `dtype` as DenseOptions::dtype (flax's dtype=, with param_dtype f32): bf16 casts x, W1 and W2
// to bf16, so both GEMMs (and their gradients' GEMMs) are oneDNN bf16 matmuls accumulating in
// f32; relu is computed in f32 and rounded to bf16 (as XLA's CPU backend does), and z is bf16.
// W1 and W2 stay f32, and their gradients come back f32 through the casts' VJP.
Value DotReluDot(Scope scope, Value x, int64_t depth, DType dtype = v1::DTYPE_F32);

// The seed's MLP: num_layers DotReluDot blocks, unrolled (params layers_0/W1, ...) or
// scan-stacked as nn.scan does (one W1 [num_layers, in, depth] with logical axes ('layer',
// 'embed', 'hidden'); 'layer' is unpartitioned unless a rule maps it: metadata_params
// {PARTITION_NAME: None}). `dtype`: every block's, as DotReluDot's (the result is in `dtype`).
Value Mlp(Scope scope, Value x, int num_layers, int64_t depth, bool use_scan,
          DType dtype = v1::DTYPE_F32);

// flax.linen.Dropout(rate): identity when `deterministic` or the scope is; otherwise x * mask
// with the key from scope.MakeRng() folded over the batch axes (shared/seeds/001's
// fold_rng_over_axis).
Value Dropout(Scope& scope, Value x, float rate, bool deterministic = false);

// jax.nn.silu / relu via JitBuilder::Unary.
inline Value Relu(JitBuilder& jit, Value x) { return jit.Unary("relu", x); }
inline Value Silu(JitBuilder& jit, Value x) { return jit.Unary("silu", x); }

// mean((pred - target)^2) over every element (optax.l2_loss times 2, as the seed 003's MSE).
Value MseLoss(JitBuilder& jit, Value pred, Value target);
// optax.softmax_cross_entropy(logits, one_hot) averaged over the batch: logits [b, c],
// one_hot [b, c] f32. Computed as logsumexp(logits) - sum(one_hot * logits) with the max shifted
// out (stop_gradient), so a class dim sharded over an axis costs a pmax and psums.
Value SoftmaxCrossEntropy(JitBuilder& jit, Value logits, Value one_hot);
// jax.nn.one_hot(labels, num_classes): labels [b] of any integer dtype (u8, i32, u32; f32 holding
// integers) -> f32 [b, num_classes], laid out like labels with the class dim unsharded.
Value OneHot(JitBuilder& jit, Value labels, int64_t num_classes);
// optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(): logits [b, c] f32,
// labels [b] integers in [0, c). The per-row loss is one fused op
// (JitBuilder::SoftmaxCrossEntropyWithIntegerLabels), its VJP another.
Value SoftmaxCrossEntropyWithIntegerLabels(JitBuilder& jit, Value logits, Value labels);
// (logits.argmax(-1) == labels).sum() as f32 []: the correct predictions of a batch (a tie for
// the maximum counts as correct when the label is among the tied classes).
Value CorrectCount(JitBuilder& jit, Value logits, Value labels);

}  // namespace meshrun::nn

#endif  // MESHRUN_CLIENT_INCLUDE_MESHRUN_NN_H_
