// ShardMapBuilder's fused ops: one op (and one oneDNN primitive on the worker) where the
// composition would take a dozen small ones.
#include "absl/strings/str_cat.h"
#include "core/spmd/shard_map.h"
#include "core/spmd/shard_map_internal.h"

namespace meshrun {

using shard_map_internal::MakeOp;
namespace {

bool IsLabelDType(DType d) {
  return d == v1::DTYPE_U8 || d == v1::DTYPE_I32 || d == v1::DTYPE_U32 || d == v1::DTYPE_F32;
}

}  // namespace

ShardMapBuilder::Value ShardMapBuilder::SoftmaxCrossEntropy(Value logits, Value labels) {
  if (!Valid(logits) || !Valid(labels)) return {};
  const Dims d = shape(logits);
  if (!Check(d.size() == 2 && shape(labels) == Dims{d[0]} && IsLabelDType(dtype(labels)),
             absl::StrCat("softmax_cross_entropy: logits ", DimsToString(d), " and labels ",
                          DTypeName(dtype(labels)), DimsToString(shape(labels)),
                          "; expected [b, c] and [b] class indices (u8, i32, u32 or f32)"))) {
    return {};
  }
  return Add(MakeOp(v1::OP_SOFTMAX_CROSS_ENTROPY, {Name(ToF32(logits)), Name(labels)}),
             v1::DTYPE_F32, {d[0]});
}

ShardMapBuilder::Value ShardMapBuilder::SoftmaxCrossEntropyGrad(Value logits, Value labels,
                                                                Value dloss) {
  if (!Valid(logits) || !Valid(labels) || !Valid(dloss)) return {};
  const Dims d = shape(logits);
  if (!Check(d.size() == 2 && shape(labels) == Dims{d[0]} && IsLabelDType(dtype(labels)) &&
                 shape(dloss) == Dims{d[0]},
             absl::StrCat("softmax_cross_entropy grad: logits ", DimsToString(d), ", labels ",
                          DTypeName(dtype(labels)), DimsToString(shape(labels)), " and dloss ",
                          DimsToString(shape(dloss)), "; expected [b, c], [b] and [b]"))) {
    return {};
  }
  const DType original = dtype(logits);
  return Restore(Add(MakeOp(v1::OP_SOFTMAX_CROSS_ENTROPY_GRAD,
                            {Name(ToF32(logits)), Name(labels), Name(ToF32(dloss))}),
                     v1::DTYPE_F32, d),
                 original);
}

}  // namespace meshrun
