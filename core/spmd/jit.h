// JitBuilder: a program written on GLOBAL arrays, as for one device, with shardings only on its
// inputs, outputs and chosen intermediates; build() partitions it into the per-shard program the
// workers run, choosing each op's local computation and inserting the collectives where layouts
// disagree. Mirrors jax.jit(f, in_shardings=..., out_shardings=...) with
// jax.lax.with_sharding_constraint, partitioned the way XLA's GSPMD does (the per-op rules are
// core/spmd/sharding_rules.h).
//
//   JitBuilder jit(*Mesh::Parse("data=2,model=4"));
//   auto x  = jit.Input(v1::DTYPE_F32, {8, 1024}, P("data", None));
//   auto w1 = jit.Input(v1::DTYPE_F32, {1024, 4096}, P(None, "model"));
//   auto w2 = jit.Input(v1::DTYPE_F32, {4096, 1024}, P("model", None));
//   jit.Output(jit.Dot(jit.Unary("relu", jit.Dot(x, w1)), w2), P("data", None));
//   jit.collectives();   // [psum over (model): 4096 bytes per device]
//   client->Jit(jit.global_program(), {"x", "w1", "w2"});   // partitioned by the coordinator
//   client->ShardMap(*jit.Build(), {"x", "w1", "w2"});      // or here, as a per-shard program
//
// The builder records the user's calls as a v1::GlobalProgram (global shapes, shardings on
// inputs, outputs and constraints, grad as an op, no collectives); the coordinator partitions a
// client's program by replaying it here (FromGlobalProgram), so the layouts and collectives it
// chooses are the ones this builder reports.
//
// Shapes are global and row-major. Partitioning is eager: each op is partitioned as it is added,
// from its operands' layouts; a value holding partial sums (after a dot over a sharded
// contracting dim, or a reduction over a sharded dim) is completed when it is next used: by a
// psum before another op, or by a psum_scatter when a sharding constraint or output spec wants
// it sharded over the partial axes.
//
// Every op is also recorded on a tape (the global program: ops on global arrays, no collectives),
// over which Grad derives the reverse-mode VJP, as jax.vjp does: the backward ops are added to the
// same program and partitioned by the same rules, so a data-parallel gradient's psum and FSDP's
// psum_scatter come out of the partitioner, not out of hand-written collectives.
//
// Not thread-safe. The first error (a shape or spec that does not fit) is recorded with the op
// that caused it and returned by Build(); ops added after it are ignored.
#ifndef MESHRUN_CORE_SPMD_JIT_H_
#define MESHRUN_CORE_SPMD_JIT_H_

#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/sharding/mesh.h"
#include "core/sharding/partition_spec.h"
#include "core/spmd/shard_map.h"
#include "core/spmd/sharding_rules.h"
#include "core/tensor.h"
#include "meshrun/v1/program.pb.h"

namespace meshrun {

class JitBuilder {
 public:
  struct Value {
    int id = -1;
  };
  // One collective the partitioner inserted.
  struct Collective {
    std::string op;                 // all_gather, psum, psum_scatter, pmean, pmax
    std::vector<std::string> axes;  // mesh axes it runs over
    int64_t dim = -1;               // all_gather / psum_scatter dim
    int64_t bytes_per_device = 0;   // sent by each device (ring algorithms)
    std::string reason;             // the op it serves
    // "psum(model)", "all_gather(data)@1": the op, its axes and its dim.
    std::string Short() const;
  };

  explicit JitBuilder(Mesh mesh) : mesh_(mesh), sm_(std::move(mesh)) {}

  // An argument laid out as `in_spec` (jax.jit's in_shardings).
  Value Input(DType dtype, const Dims& global_dims, const PartitionSpec& in_spec);
  // A result, laid out as `out_spec` (out_shardings).
  void Output(Value v, const PartitionSpec& out_spec);
  // A result laid out as sharding propagation left it (an argument's layout carried through
  // elementwise ops, a dot's operands' non-contracted axes, a constraint's), any pending
  // partial sum completed: jax.jit's result with no out_sharding, which XLA's propagation lays
  // out. The program's out_specs say which layout that is.
  void OutputPropagated(Value v);
  // jax.lax.with_sharding_constraint.
  Value WithShardingConstraint(Value v, const PartitionSpec& spec);

  // jnp.full(global_dims, value) (f32), created directly in the layout `spec` (each device fills
  // only its block).
  Value Constant(float value, const Dims& global_dims, const PartitionSpec& spec = PartitionSpec());
  // jax.lax.stop_gradient: x, with no gradient flowing back through it.
  Value StopGradient(Value x);
  // x.astype(dtype) (jax.lax.convert_element_type): u8 images to f32, f32 to i32, f32 <-> bf16.
  // Between f32 and bf16 the gradient is converted back; from or to an integer dtype none flows.
  Value Convert(Value x, DType dtype);
  // jax.lax.bitcast_convert_type(x, dtype): x's bits read as `dtype` (f32, i32, u32; one
  // width), laid out as x. Not differentiable.
  Value BitcastConvert(Value x, DType dtype);
  // jax.random.bits(key, global_dims) as u32 (JAX's _random_bits; jax.random.split's unwrapped
  // keys with fn "split"): key a u32[2] value (replicated), fn "partitionable"
  // (jax_threefry_partitionable=True, JAX's default), "legacy" or "split" (OP_RANDOM_BITS).
  // Laid out as `spec`: each device draws only its block, with the whole array's values.
  Value RandomBits(Value key, const Dims& global_dims, const std::string& fn,
                   const PartitionSpec& spec = PartitionSpec());
  // Word `word` (0 or 1) of JAX's threefry2x32 primitive: k0, k1, x0, x1 u32 values of one
  // shape or scalars (replicated), laid out as the first shaped one. Not differentiable.
  Value Threefry2x32(Value k0, Value k1, Value x0, Value x1, int word);
  // jax.lax.broadcasted_iota(dtype, global_dims, dim), laid out as `spec` (each device counts
  // its own block). Not differentiable.
  Value Iota(DType dtype, const Dims& global_dims, int64_t dim,
             const PartitionSpec& spec = PartitionSpec());

  // Element-wise (ShardMapBuilder's functions: tanh, relu, exp, ..., add, sub, mul, div, max;
  // the comparisons eq, ne, lt, le, gt, ge give f32 1 or 0 and pass no gradient, as jnp's
  // comparisons followed by .astype(float32)). On i32 or u32 operands (one dtype): add sub mul
  // max min and or xor shift_left shift_right_logical shift_right_arithmetic, with no gradient
  // (worker/kernels/kernel.h); f32 nextafter passes none either. Binary operands must have equal
  // shapes, or one of them is a scalar (shape []).
  Value Unary(const std::string& fn, Value x);
  Value Binary(const std::string& fn, Value a, Value b);
  // jax.lax.select_n(pred, on_false, on_true): pred != 0 ? on_true : on_false element-wise; the
  // operands have one shape or are scalars (shape []); pred is a comparison's f32 1 / 0. The
  // result follows the first sharded operand's layout. Differentiable in on_false and on_true.
  Value Select(Value pred, Value on_false, Value on_true);
  Value Add(Value a, Value b) { return Binary("add", a, b); }
  Value Sub(Value a, Value b) { return Binary("sub", a, b); }
  Value Mul(Value a, Value b) { return Binary("mul", a, b); }
  Value Div(Value a, Value b) { return Binary("div", a, b); }
  // x op scalar, the scalar a replicated constant.
  Value Scale(Value x, float c) { return Mul(x, Constant(c, {})); }
  // dy * fn'(x): the VJP of Unary(fn, x) (tanh exp log sqrt abs square relu logistic silu).
  Value UnaryGrad(const std::string& fn, Value x, Value dy);
  // flax.linen.Dropout(rate) on x with `key` (a replicated u32[2] value): each device draws the
  // mask of its own block from fold_in(key, axis_index(fold_axes)) (the seeds'
  // fold_rng_over_axis: masks differ across those axes' shards and agree across the others), and
  // returns x * mask, so the gradient flows through the kept elements only.
  Value Dropout(Value x, Value key, float rate, const std::vector<std::string>& fold_axes);
  // jax.random.fold_in(key, data): key a u32[2] value, data an f32 or i32 scalar value (an f32 is
  // converted to i32 first, e.g. the TrainState's step). Replicated; not differentiable.
  Value FoldIn(Value key, Value data);

  // jax.lax.broadcast_in_dim(x, out_dims, broadcast_dimensions): x's dim i becomes the output's
  // dim broadcast_dimensions[i] (increasing; sizes equal); the other dims are new. The result is
  // laid out as `out_spec` (x's dims are resharded to its entries; each device broadcasts only
  // into its block).
  // A dim of x of size 1 may map to a larger output dim (numpy broadcasting), as in JAX.
  Value BroadcastInDim(Value x, const Dims& out_dims,
                       const std::vector<int64_t>& broadcast_dimensions,
                       const PartitionSpec& out_spec = PartitionSpec());
  // The same, laid out as sharding propagation would: x's layout carried to its dims (those of
  // size 1 that grow replicated), the new dims replicated. Recorded with no spec.
  Value BroadcastInDimPropagated(Value x, const Dims& out_dims,
                                 const std::vector<int64_t>& broadcast_dimensions);
  // jax.lax.reshape(x, global_dims) (row-major, the same element count). Layout: unit dims come
  // and go freely; within each group of dims whose sizes multiply to the same product, a
  // sharding of the group's major input dim moves to its major output dim when that divides
  // (else it is all_gathered), as GSPMD's reshape rule does (the seed's [B, ...] ->
  // [k, B / k, ...] minibatches keep a `data` sharding when k divides); the group's other
  // input dims are all_gathered first.
  Value Reshape(Value x, const Dims& global_dims);
  // jax.lax.slice(x, starts, limits) (unit strides): each dim cut to [starts[d], limits[d]). A
  // dim cut short is all_gathered first; whole dims keep their layout. Not differentiable.
  Value Slice(Value x, const std::vector<int64_t>& starts, const std::vector<int64_t>& limits);
  // jax.lax.cumsum / cumprod / cummax / cummin / cumlogsumexp (fn sum prod max min logsumexp) of
  // x along `dim`, from its end when `reverse`: `dim` is gathered, the others keep their layout.
  // Not differentiated by Grad (a jaxpr carries its transpose, a reverse cumsum).
  Value Cumulative(Value x, const std::string& fn, int64_t dim, bool reverse);
  // jax.lax.rev(x, dims) (jnp.flip, x[::-1]): the reversed dims are gathered, the others keep
  // their layout. Not differentiated by Grad (a jaxpr carries its transpose, another rev).
  Value Reverse(Value x, const std::vector<int64_t>& dims);
  // Operand `result` of jax.lax.sort(operands, dimension=dim, is_stable=True, num_keys):
  // operands of one global shape (f32, i32, u32), the sorted dim gathered, the others laid out
  // as the first operand's. Not differentiable (a jaxpr carries its transpose).
  Value Sort(const std::vector<Value>& operands, int64_t dim, int num_keys, int result);
  // jax.lax.dynamic_slice(x, starts, sizes): one scalar start value per dim (an integer, or an
  // f32 holding one), clamped to [0, dim - size] as XLA does. A dim cut short is gathered; whole
  // dims keep their layout. Not differentiated by Grad (a jaxpr carries its transpose).
  Value DynamicSlice(Value x, const std::vector<Value>& starts, const Dims& sizes);
  // jax.lax.dynamic_update_slice(x, update, starts): x with the block at the (clamped) starts
  // replaced by update (x's dtype and rank). Dims the update covers whole keep x's layout; the
  // others are gathered. Not differentiated by Grad.
  Value DynamicUpdateSlice(Value x, Value update, const std::vector<Value>& starts);
  // jnp.transpose(x, perm): the output's dim i is x's dim perm[i]; the layout is permuted alike.
  Value Transpose(Value x, const std::vector<int64_t>& perm);
  // x[index] along dim 0 (a static index; dim 0 is all_gathered first if it is sharded), as a
  // scan over stacked layers reads layer `index`'s parameters.
  Value Index(Value x, int64_t index);
  // jnp.stack(values, axis=0): equal shapes, laid out as the first (the others are resharded);
  // the new dim 0 is not sharded.
  Value Stack(const std::vector<Value>& values);
  // jnp.concatenate(values, axis=dim) (jax.lax.concatenate): one rank and dtype, sizes equal but
  // along `dim`; laid out as the first operand with the most partitioned dims, `dim` unsharded
  // (the others are resharded to it: a replicated padding block sliced, not the data gathered).
  // Differentiable (each operand's cotangent is its slice of the result's).
  Value Concatenate(const std::vector<Value>& values, int64_t dim);
  // jnp.dot of 2-D arrays and jax.lax.dot_general (result: batch, lhs free, rhs free dims).
  Value Dot(Value a, Value b) { return DotGeneral(a, b, {1}, {0}); }
  Value DotGeneral(Value a, Value b, const std::vector<int64_t>& lhs_contracting,
                   const std::vector<int64_t>& rhs_contracting,
                   const std::vector<int64_t>& lhs_batch = {},
                   const std::vector<int64_t>& rhs_batch = {});
  // fn: sum, mean, max over `dims`.
  Value Reduce(const std::string& fn, Value x, const std::vector<int64_t>& dims);
  // optax.softmax_cross_entropy_with_integer_labels(logits, labels): logits [b, c] (f32 or bf16),
  // labels [b] class indices (u8, i32, u32, or f32 holding integers) -> f32 [b], each row's
  // logsumexp(logits) - logits[label], fused into one op per device (one oneDNN log-softmax
  // pass). Rows stay laid out as the logits' batch dim; a sharded class dim is all_gathered
  // first. Differentiable in the logits (SoftmaxCrossEntropyGrad); labels take no gradient. A
  // label outside [0, c) fails the step, naming it.
  Value SoftmaxCrossEntropyWithIntegerLabels(Value logits, Value labels);
  // Its VJP: (softmax(logits) - one_hot(labels)) * dloss[:, None], dloss f32 [b]; laid out as
  // the logits (class dim whole). Not differentiable itself.
  Value SoftmaxCrossEntropyGrad(Value logits, Value labels, Value dloss);

  // jax.shard_map regions. ShardMapEnter lays x out as `in_spec` and returns this device's block
  // as a value of the block's shape; ops on such values (all of the above, on replicated-looking
  // values) then run per device, as in shard_map's body, with the collectives below;
  // ShardMapExit turns a device's block (shape = the global shape divided by `out_spec`'s
  // axes) back into a global value laid out as `out_spec`. As shard_map with check_vma, an
  // out_spec must leave out only axes the block does not vary over. Not differentiable (JAX's
  // transpose of shard_map is itself a shard_map).
  Value ShardMapEnter(Value x, const PartitionSpec& in_spec);
  Value ShardMapExit(Value block, const PartitionSpec& out_spec);
  // jax.lax.psum / pmax / all_gather / psum_scatter / ppermute / all_to_all on a block in a
  // shard_map body: `dim` is all_gather's axis, psum_scatter's scatter_dimension or
  // all_to_all's split_axis; `dims` all_to_all's concat_axis or ppermute's pairs, flattened.
  Value ManualCollective(const std::string& fn, Value x, const std::vector<std::string>& axes,
                         int64_t dim, const std::vector<int64_t>& dims, bool tiled);
  // jax.lax.axis_index(axes) in a shard_map body: i32 [].
  Value ManualAxisIndex(const std::vector<std::string>& axes);

  // optax.adamw (weight_decay 0: optax.adam) on one parameter, fused: param, grad, mu, nu of one
  // global shape, step an f32 scalar (the count before this update). Runs in param's layout: grad
  // (partial sums and all), mu and nu are resolved to it, so an FSDP parameter's gradient is
  // psum_scattered, and the optimizer state stays sharded exactly like its parameter (ZeRO).
  // Returns {param', mu', nu'}. Not differentiable.
  std::vector<Value> AdamUpdate(Value param, Value grad, Value mu, Value nu, Value step,
                                const v1::AdamWAttrs& hp);

  // Reverse-mode autodiff (jax.grad of a scalar): the gradient of `loss` (f32, shape []) with
  // respect to each of `wrt`, in the same order, each with its value's global shape. A value
  // `loss` does not depend on gets a zero gradient. The cotangents are new values of this
  // program; their layouts are whatever the partitioner chose (constrain them, e.g. to the
  // parameter's sharding, with WithShardingConstraint). Differentiable ops: everything above
  // except Reduce max, the binary max / min and AdamUpdate (an error names the op). Each call
  // differentiates one loss (gradient accumulation calls it once per minibatch).
  std::vector<Value> Grad(Value loss, const std::vector<Value>& wrt);

  const Mesh& mesh() const { return mesh_; }
  // The global shape of `v` (empty for an invalid value).
  const Dims& shape(Value v) const {
    static const Dims kNone;
    return v.id >= 0 && v.id < static_cast<int>(values_.size()) ? values_[v.id].global : kNone;
  }
  // The dtype of `v` (unspecified for an invalid value).
  DType dtype(Value v) const {
    return v.id >= 0 && v.id < static_cast<int>(values_.size()) ? values_[v.id].dtype
                                                                : v1::DTYPE_UNSPECIFIED;
  }
  // The layout chosen for `v` (partial sums not yet completed are not part of it).
  PartitionSpec sharding(Value v) const {
    return v.id >= 0 && v.id < static_cast<int>(values_.size()) ? values_[v.id].spec
                                                                : PartitionSpec();
  }
  // The collectives inserted so far, in program order.
  const std::vector<Collective>& collectives() const { return collectives_; }

  absl::StatusOr<v1::ShardMapProgram> Build() const;
  // The first error so far (Build() returns it), or OK: every value made after it is invalid.
  absl::Status status() const { return status_.ok() ? sm_.status() : status_; }

  // The global program recorded so far: every call above made by the user (not the ones the
  // builder makes itself, e.g. Grad's backward ops), in order, with its value operands. It holds
  // no collectives and no per-shard shapes; replaying it on the same mesh rebuilds this builder.
  const v1::GlobalProgram& global_program() const { return global_; }
  // Replays `program` on `mesh` (as the coordinator partitions a client's jax.jit program):
  // the same calls, hence the same values, layouts, collectives and per-shard program. Errors:
  // InvalidArgument naming the op's index and kind for an unknown kind or an operand id that
  // does not exist at that point. A program that does not partition is not an error here: its
  // Build() returns the error, as for a builder used directly.
  static absl::StatusOr<std::unique_ptr<JitBuilder>> FromGlobalProgram(
      Mesh mesh, const v1::GlobalProgram& program);

 private:
  // Records a user call as a GlobalOp while it runs: only the outermost call (depth 0) is
  // recorded; `op` is null for nested ones.
  class Scope {
   public:
    Scope(JitBuilder* b, v1::GlobalOp::Kind kind);
    ~Scope() { --b_->depth_; }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    // Adds value operands (nested calls: nothing).
    Scope& Operands(std::initializer_list<Value> values);
    Scope& Operands(const std::vector<Value>& values);
    v1::GlobalOp* op = nullptr;

   private:
    JitBuilder* b_;
  };

  // One op of the global program (the tape Grad walks).
  struct Node {
    enum Kind {
      kInput,
      kConstant,
      kStopGradient,
      kConstraint,
      kUnary,
      kUnaryGrad,
      kBinary,
      kDot,
      kReduce,
      kBroadcast,
      kTranspose,
      kIndex,
      kStack,
      kReshape,
      kSelect,
      kConcatenate,
      kConvert,
      kSoftmaxCrossEntropy,
      kOptimizer
    };
    explicit Node(Kind k = kInput, std::vector<int> ops = {}, std::string f = "")
        : kind(k), operands(std::move(ops)), fn(std::move(f)) {}
    Kind kind;
    std::vector<int> operands;
    std::string fn;             // kUnary, kUnaryGrad, kBinary, kReduce
    std::vector<int64_t> dims;  // kReduce dims, kBroadcast broadcast_dimensions, kTranspose perm
    spmd::DotDimensionNumbers dnums;  // kDot
    int64_t index = 0;                // kIndex
    PartitionSpec spec;               // kConstraint, kBroadcast
  };
  struct Scaled;
  struct State {
    Node node;
    // `local` holds the value in `dtype`, but for a bf16 partial sum whose device parts are kept
    // in f32 until they are summed (DotGeneral); Reduce rounds the sum to bf16, and Convert,
    // Stack and AdamUpdate check sm_.dtype(local) where they take such a part as it is.
    ShardMapBuilder::Value local;
    DType dtype;
    Dims global;
    PartitionSpec spec;
    std::vector<std::string> partial;  // pending reduction over these axes
    std::string partial_fn;            // sum, mean or max
    // Set while `local` is a pending partial sum (or mean) scaled by replicated scalars (Binary's
    // linear rule): completing it completes the unscaled value once (a gradient that optax both
    // scales and squares is all-reduced once, as XLA reduces it before either) and rescales.
    std::shared_ptr<const Scaled> scaled;
  };
  struct Scaled {
    int local_id;  // the scaled local value this describes
    State base;    // the unscaled partial value
    struct Step {
      std::string fn;  // mul or div
      ShardMapBuilder::Value scalar;
      bool scalar_first;  // scalar * x rather than x * scalar
    };
    std::vector<Step> steps;
  };
  // Appends a value computed by `node`.
  Value Push(State s, Node node);
  // The cotangent contributions of one value during Grad (core/spmd/jit_autodiff.cc).
  struct Cotangent;
  // Adds the contributions of value `id`'s cotangent `g` to its operands' cotangents: the
  // transpose rules of JAX's primitives, one helper per kind of node that needs more than a line.
  void Backprop(int id, Value g, std::vector<Cotangent>& cts);
  void BackpropBinary(int id, Value g, std::vector<Cotangent>& cts);
  void BackpropReduce(int id, Value g, std::vector<Cotangent>& cts);
  void BackpropBroadcast(int id, Value g, std::vector<Cotangent>& cts);
  void BackpropSelect(int id, Value g, std::vector<Cotangent>& cts);
  void BackpropDot(int id, Value g, std::vector<Cotangent>& cts);
  // cts[operand] += contribution.
  void AddCotangent(std::vector<Cotangent>& cts, int operand, Value contribution);
  // The dims of a dot_general operand of rank `rank` that are neither contracting nor batch, in
  // order (they become the result's dims after the batch dims).
  static std::vector<int64_t> FreeDims(size_t rank, const std::vector<int>& contracting,
                                       const std::vector<int>& batch);
  bool Check(bool ok, const std::string& message);
  // Also false once the per-shard builder has failed (its values are then not to be used).
  bool Valid(Value v) const {
    return status_.ok() && sm_.status().ok() && v.id >= 0 &&
           v.id < static_cast<int>(values_.size());
  }
  // Completes pending partial results and reshards to `target`; returns the local value.
  State Resolve(const State& s, const PartitionSpec& target, const std::string& reason);
  // Concatenate's layout: the entries (padded to `rank`) of the first of `values` with the most
  // partitioned dims other than `dim`.
  std::vector<PartitionSpec::Entry> MostPartitioned(const std::vector<Value>& values, int64_t dim,
                                                    int64_t rank) const;
  // Completes pending partial results, keeping the layout. A value completed before (the same
  // local value, partial axes and layout) is not reduced again.
  State Complete(const State& s, const std::string& reason);
  State Reduce(const State& s, const PartitionSpec& target, const std::string& reason);
  // Scalar values (a dynamic slice's starts) replicated on every device; an error for a shaped
  // one.
  std::vector<ShardMapBuilder::Value> ReplicatedScalars(const std::vector<Value>& vs,
                                                        const std::string& what);
  State ApplyReshards(State s, const std::vector<spmd::Reshard>& reshards,
                      const std::string& reason);
  // BroadcastInDim (`out_spec` set) and BroadcastInDimPropagated (null).
  Value Broadcast(Value x, const Dims& out_dims, const std::vector<int64_t>& broadcast_dimensions,
                  const PartitionSpec* out_spec);

  Mesh mesh_;
  ShardMapBuilder sm_;
  std::vector<State> values_;
  std::vector<Collective> collectives_;
  std::map<std::string, State> completed_;  // Complete's results, by CompletionKey
  absl::Status status_;
  v1::GlobalProgram global_;
  int depth_ = 0;  // nesting of the public calls in progress
};

}  // namespace meshrun

#endif  // MESHRUN_CORE_SPMD_JIT_H_
