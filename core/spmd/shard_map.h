// Building per-shard programs for shard_map, as jax.experimental.shard_map takes a function:
// the program sees each worker's local blocks, may call collectives over named mesh axes, and its
// results are assembled per out_specs.
//
//   ShardMapBuilder b(mesh);
//   auto x = b.Input(v1::DTYPE_F32, {192, 64}, P("i", None));   // local block [48, 64]
//   auto w = b.Input(v1::DTYPE_F32, {64, 128}, P(None, "j"));   // local block [64, 64]
//   b.Output(b.Dot(x, w), P("i", "j"));
//   absl::StatusOr<v1::ShardMapProgram> program = b.Build();
//   client->ShardMap(*program, {"x", "w"});
#ifndef MESHRUN_CORE_SPMD_SHARD_MAP_H_
#define MESHRUN_CORE_SPMD_SHARD_MAP_H_

#include <array>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "core/sharding/mesh.h"
#include "core/sharding/partition_spec.h"
#include "core/tensor.h"
#include "meshrun/v1/program.pb.h"

namespace meshrun {

// Not thread-safe. Shapes are inferred as ops are added; the first error (a shape that does not
// fit, an unknown axis) is recorded with the op that caused it and returned by Build(); ops added
// after an error are ignored.
class ShardMapBuilder {
 public:
  // A value of the program: a local (per-worker) array.
  struct Value {
    int id = -1;
  };

  explicit ShardMapBuilder(Mesh mesh) : mesh_(std::move(mesh)) {}

  // The next argument: a global array of `global_dims`, laid out by `in_spec`; the program sees
  // its local block.
  Value Input(DType dtype, const Dims& global_dims, const PartitionSpec& in_spec);
  // A result, assembled by `out_spec` (its global dims are the local dims times the blocks).
  void Output(Value v, const PartitionSpec& out_spec);

  // Element-wise math, reductions and dots run in f32; bf16 inputs are converted to f32 and the
  // result back to bf16, as XLA does on CPU. Unary fn: tanh exp log sqrt rsqrt neg abs square relu
  // logistic silu.
  Value Unary(const std::string& fn, Value x);
  Value Tanh(Value x) { return Unary("tanh", x); }
  Value Sqrt(Value x) { return Unary("sqrt", x); }
  Value Pow(Value x, float exponent);
  // dy * fn'(x): the VJP of Unary(fn, x) (fn: tanh exp log sqrt abs square relu logistic silu).
  Value UnaryGrad(const std::string& fn, Value x, Value dy);
  // optax.softmax_cross_entropy_with_integer_labels per row, fused (shard_map_fused.cc): logits
  // [b, c] (bf16 converted to f32) with the whole class dim, labels [b] class indices (u8, i32,
  // u32, or f32 holding integers) -> f32 [b].
  Value SoftmaxCrossEntropy(Value logits, Value labels);
  // Its VJP with respect to the logits: (softmax(logits) - one_hot(labels)) * dloss[:, None],
  // dloss f32 [b] -> [b, c] in the logits' dtype.
  Value SoftmaxCrossEntropyGrad(Value logits, Value labels, Value dloss);
  // Binary fn: add sub mul div max min, with numpy broadcasting of both sides.
  Value Binary(const std::string& fn, Value a, Value b);
  // pred != 0 ? on_true : on_false element-wise (f32; each operand of the result's shape or one
  // element), as jax.lax.select_n(pred, on_false, on_true).
  Value Select(Value pred, Value on_false, Value on_true);
  Value Add(Value a, Value b) { return Binary("add", a, b); }
  Value Sub(Value a, Value b) { return Binary("sub", a, b); }
  Value Mul(Value a, Value b) { return Binary("mul", a, b); }
  Value Div(Value a, Value b) { return Binary("div", a, b); }
  // jnp.dot of 2-D arrays (oneDNN matmul).
  Value Dot(Value a, Value b);
  // jax.lax.dot_general: contracts lhs_contracting with rhs_contracting, batches over
  // lhs_batch / rhs_batch; result dims = batch dims, then lhs free dims, then rhs free dims.
  // Lowered to transposes, reshapes and a (batched) oneDNN matmul.
  Value DotGeneral(Value a, Value b, const std::vector<int64_t>& lhs_contracting,
                   const std::vector<int64_t>& rhs_contracting,
                   const std::vector<int64_t>& lhs_batch = {},
                   const std::vector<int64_t>& rhs_batch = {});
  // fn: sum mean max min over `dims` (jnp.sum(x, axis=dims, keepdims=keepdims)).
  Value Reduce(const std::string& fn, Value x, const std::vector<int64_t>& dims,
               bool keepdims = false);
  Value Reshape(Value x, const Dims& dims);
  Value BroadcastTo(Value x, const Dims& dims);
  Value Transpose(Value x, const std::vector<int64_t>& perm);
  // jnp.stack(values, axis=dim) and jnp.concatenate.
  Value Stack(const std::vector<Value>& values, int64_t dim);
  Value Concatenate(const std::vector<Value>& values, int64_t dim);
  Value Convert(Value x, DType dtype);
  // jax.lax.bitcast_convert_type(x, dtype): x's bits read as `dtype` (f32, i32, u32).
  Value BitcastConvert(Value x, DType dtype);
  // x[starts[0]:starts[0]+sizes[0], ...].
  Value Slice(Value x, const std::vector<int64_t>& starts, const Dims& sizes);
  // lax.dynamic_slice_in_dim(x, index * size, size, axis=dim), index an i32 scalar value (e.g.
  // AxisIndex): the seed's shard_params keeps this device's slice this way.
  Value DynamicSliceInDim(Value x, Value index, int64_t size, int64_t dim);
  // jax.lax.dynamic_slice(x, starts, sizes): one scalar start value per dim of x, clamped to
  // [0, dim - size] where it runs.
  Value DynamicSlice(Value x, const std::vector<Value>& starts, const Dims& sizes);
  // jax.lax.dynamic_update_slice(x, update, starts), the starts clamped as DynamicSlice's.
  Value DynamicUpdateSlice(Value x, Value update, const std::vector<Value>& starts);
  // jax.lax.cumsum / cumprod / cummax / cummin / cumlogsumexp (fn sum prod max min logsumexp) of
  // x along `dim`, from its end when `reverse`; bf16 computed in f32, i32 and u32 in their
  // integers (logsumexp: f32 and bf16 only).
  Value Cumulative(Value x, const std::string& fn, int64_t dim, bool reverse);
  // Operand `result` of jax.lax.sort(operands, dimension=dim, num_keys) (stable): operands of
  // one shape, f32, i32 or u32.
  Value Sort(const std::vector<Value>& operands, int64_t dim, int num_keys, int result);
  // jax.lax.rev(x, dims): each dim in `dims` reversed; any dtype.
  Value Reverse(Value x, const std::vector<int64_t>& dims);
  // lax.broadcasted_iota(dtype, dims, dim).
  Value Iota(DType dtype, const Dims& dims, int64_t dim);
  // jax.random.bits(key, dims) as u32, under jax_threefry_partitionable=False.
  Value RandomBits(Value key, const Dims& dims);
  // This device's block of jax.random.bits(key, global_dims) as u32 laid out as `spec`, fn
  // "legacy", "partitionable" or "split" (OP_RANDOM_BITS).
  Value RandomBitsBlock(Value key, const Dims& global_dims, const PartitionSpec& spec,
                        const std::string& fn);
  // Word `word` (0 or 1) of JAX's threefry2x32(k0, k1, x0, x1), element-wise: u32 operands of
  // one shape or one element each.
  Value Threefry2x32(Value k0, Value k1, Value x0, Value x1, int word);
  // flax's dropout mask (f32 `dims`): 1/(1-rate) where bernoulli(key, 1-rate) keeps, else 0.
  Value DropoutMask(Value key, const Dims& dims, float rate);
  Value Full(DType dtype, const Dims& dims, double value);

  // optax.adamw (weight_decay 0: optax.adam) on one block, out of place: returns param', mu', nu'.
  // step: f32 [], the step count before this update (t = step + 1). With `grad_axes`, grad is
  // this device's partial gradient, all-reduced over those mesh axes (`grad_fn` "sum": psum,
  // "mean": pmean) before the update, which the worker fuses with it (OP_ADAM_UPDATE);
  // REQUIRES: param, mu and nu are replicated over `grad_axes`.
  std::vector<Value> AdamUpdate(Value param, Value grad, Value mu, Value nu, Value step,
                                const v1::AdamWAttrs& hp,
                                const std::vector<std::string>& grad_axes = {},
                                const std::string& grad_fn = "sum");

  // This device's block of a global f32 array of `global_dims` laid out as `spec`, drawn as the
  // whole array would be: fn zeros, ones, normal or truncated_normal (times `scale`) with `key`.
  Value RandomInit(const Dims& global_dims, const PartitionSpec& spec, const std::string& fn,
                   float scale, const std::array<uint32_t, 2>& key);

  // jax.lax collectives over one or several mesh axes (the first major).
  Value AxisIndex(const std::vector<std::string>& axes);
  Value Psum(Value x, const std::vector<std::string>& axes);
  Value Pmean(Value x, const std::vector<std::string>& axes);
  Value Pmax(Value x, const std::vector<std::string>& axes);
  Value AllGather(Value x, const std::vector<std::string>& axes, int64_t axis, bool tiled);
  Value PsumScatter(Value x, const std::vector<std::string>& axes, int64_t scatter_dimension,
                    bool tiled);
  Value Ppermute(Value x, const std::vector<std::string>& axes,
                 const std::vector<std::pair<int, int>>& perm);
  Value AllToAll(Value x, const std::vector<std::string>& axes, int64_t split_axis,
                 int64_t concat_axis);
  // jax.random.fold_in(key (u32[2]), data (i32 or u32 scalar)).
  Value FoldIn(Value key, Value data);

  Dims shape(Value v) const;
  DType dtype(Value v) const;
  // The program, or the first error: InvalidArgument naming the op and the shapes.
  absl::StatusOr<v1::ShardMapProgram> Build() const;
  // The first error recorded (OK while there is none).
  const absl::Status& status() const { return error_; }

 private:
  Value Add(v1::Op op, DType dtype, Dims dims);
  Value AllReduce(v1::OpKind kind, const char* name, Value x, const std::vector<std::string>& axes);
  // v as f32 to compute a bf16 op in, the op's result then rounded back (Restore): an
  // OP_CONVERT marked `widened` (program.proto).
  Value ToF32(Value v);
  Value Restore(Value v, DType dtype) {
    return dtype == v1::DTYPE_BF16 && this->dtype(v) != dtype ? Convert(v, dtype) : v;
  }
  // A matmul's operands: both bf16 stay bf16 (oneDNN's bf16 GEMM, accumulating in f32, its result
  // bf16, as jnp.dot of bf16 arrays); otherwise both in f32. The dtype it computes in.
  DType MatmulDType(Value a, Value b) {
    return dtype(a) == v1::DTYPE_BF16 && dtype(b) == v1::DTYPE_BF16 ? v1::DTYPE_BF16
                                                                    : v1::DTYPE_F32;
  }
  Value MatmulOperand(Value v, DType compute) { return compute == v1::DTYPE_BF16 ? v : ToF32(v); }
  bool Check(bool ok, const std::string& message);
  bool Valid(Value v);
  absl::StatusOr<int> GroupSize(const std::vector<std::string>& axes);
  // "" for an invalid value (an op that failed: the error is recorded, what follows is ignored).
  const std::string& Name(Value v) const {
    static const std::string* const kNone = new std::string();
    return v.id >= 0 && v.id < static_cast<int>(values_.size()) ? values_[v.id].name : *kNone;
  }

  struct Info {
    std::string name;
    DType dtype;
    Dims dims;
  };
  Mesh mesh_;
  std::vector<Info> values_;
  v1::ShardMapProgram program_;
  absl::Status error_;
};

}  // namespace meshrun

#endif  // MESHRUN_CORE_SPMD_SHARD_MAP_H_
