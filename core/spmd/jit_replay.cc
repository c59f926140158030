// JitBuilder::FromGlobalProgram (core/spmd/jit.h): the coordinator partitions a client's global
// program by replaying its calls on a builder for the cluster's mesh.
#include "absl/strings/str_cat.h"
#include "core/spmd/jit.h"

namespace meshrun {

absl::StatusOr<std::unique_ptr<JitBuilder>> JitBuilder::FromGlobalProgram(
    Mesh mesh, const v1::GlobalProgram& program) {
  auto jit = std::make_unique<JitBuilder>(std::move(mesh));
  auto spec = [](const v1::GlobalOp& op) { return PartitionSpec::FromProto(op.spec()); };
  auto dims = [](const auto& field) { return std::vector<int64_t>(field.begin(), field.end()); };
  for (int i = 0; i < program.ops_size(); ++i) {
    const v1::GlobalOp& op = program.ops(i);
    const std::string where =
        absl::StrCat("global program op ", i, " (", v1::GlobalOp::Kind_Name(op.kind()), ")");
    std::vector<Value> in;
    for (int id : op.operands()) {
      if (id < 0 || id >= static_cast<int>(jit->values_.size())) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": operand ", id, " does not exist (",
                                                       jit->values_.size(), " values so far)"));
      }
      in.push_back({id});
    }
    auto need = [&](size_t n, bool exact = true) -> absl::Status {
      if (exact ? in.size() == n : in.size() >= n) return absl::OkStatus();
      return absl::InvalidArgumentError(absl::StrCat(where, ": ", in.size(), " operands; expected ",
                                                     exact ? "" : "at least ", n));
    };
    absl::Status arity;
    switch (op.kind()) {
      case v1::GlobalOp::INPUT:
        if (arity = need(0); arity.ok()) jit->Input(op.dtype(), dims(op.shape()), spec(op));
        break;
      case v1::GlobalOp::OUTPUT:
        if (arity = need(1); !arity.ok()) break;
        if (op.propagated()) {
          jit->OutputPropagated(in[0]);
        } else {
          jit->Output(in[0], spec(op));
        }
        break;
      case v1::GlobalOp::CONSTRAINT:
        if (arity = need(1); arity.ok()) jit->WithShardingConstraint(in[0], spec(op));
        break;
      case v1::GlobalOp::CONSTANT:
        if (arity = need(0); arity.ok()) jit->Constant(op.value(), dims(op.shape()), spec(op));
        break;
      case v1::GlobalOp::STOP_GRADIENT:
        if (arity = need(1); arity.ok()) jit->StopGradient(in[0]);
        break;
      case v1::GlobalOp::UNARY:
        if (arity = need(1); arity.ok()) jit->Unary(op.fn(), in[0]);
        break;
      case v1::GlobalOp::BINARY:
        if (arity = need(2); arity.ok()) jit->Binary(op.fn(), in[0], in[1]);
        break;
      case v1::GlobalOp::UNARY_GRAD:
        if (arity = need(2); arity.ok()) jit->UnaryGrad(op.fn(), in[0], in[1]);
        break;
      case v1::GlobalOp::DROPOUT:
        if (arity = need(2); arity.ok())
          jit->Dropout(in[0], in[1], op.rate(), {op.axes().begin(), op.axes().end()});
        break;
      case v1::GlobalOp::CONVERT:
        if (arity = need(1); arity.ok()) jit->Convert(in[0], op.dtype());
        break;
      case v1::GlobalOp::IOTA:
        if (arity = need(0); arity.ok())
          jit->Iota(op.dtype(), Dims(op.shape().begin(), op.shape().end()), op.index(),
                    PartitionSpec::FromProto(op.spec()));
        break;
      case v1::GlobalOp::FOLD_IN:
        if (arity = need(2); arity.ok()) jit->FoldIn(in[0], in[1]);
        break;
      case v1::GlobalOp::DYNAMIC_SLICE:
        if (arity = need(1, false); arity.ok())
          jit->DynamicSlice(in[0], std::vector<JitBuilder::Value>(in.begin() + 1, in.end()),
                            Dims(op.shape().begin(), op.shape().end()));
        break;
      case v1::GlobalOp::DYNAMIC_UPDATE_SLICE:
        if (arity = need(2, false); arity.ok())
          jit->DynamicUpdateSlice(in[0], in[1],
                                  std::vector<JitBuilder::Value>(in.begin() + 2, in.end()));
        break;
      case v1::GlobalOp::SORT:
        if (arity = need(1, false); arity.ok() && op.dims_size() == 2)
          jit->Sort(in, op.index(), static_cast<int>(op.dims(0)), static_cast<int>(op.dims(1)));
        else if (arity.ok())
          arity =
              absl::InvalidArgumentError(absl::StrCat(where, ": dims (num_keys, result) unset"));
        break;
      case v1::GlobalOp::REVERSE:
        if (arity = need(1); arity.ok())
          jit->Reverse(in[0], std::vector<int64_t>(op.dims().begin(), op.dims().end()));
        break;
      case v1::GlobalOp::CUMULATIVE:
        if (arity = need(1); arity.ok())
          jit->Cumulative(in[0], op.fn(), op.index(), op.value() != 0.0f);
        break;
      case v1::GlobalOp::THREEFRY2X32:
        if (arity = need(4); arity.ok())
          jit->Threefry2x32(in[0], in[1], in[2], in[3], static_cast<int>(op.index()));
        break;
      case v1::GlobalOp::BITCAST_CONVERT:
        if (arity = need(1); arity.ok()) jit->BitcastConvert(in[0], op.dtype());
        break;
      case v1::GlobalOp::RANDOM_BITS:
        if (arity = need(1); arity.ok())
          jit->RandomBits(in[0], Dims(op.shape().begin(), op.shape().end()), op.fn(),
                          PartitionSpec::FromProto(op.spec()));
        break;
      case v1::GlobalOp::BROADCAST_IN_DIM:
        if (arity = need(1); arity.ok() && op.has_spec()) {
          jit->BroadcastInDim(in[0], dims(op.shape()), dims(op.dims()), spec(op));
        } else if (arity.ok()) {
          jit->BroadcastInDimPropagated(in[0], dims(op.shape()), dims(op.dims()));
        }
        break;
      case v1::GlobalOp::SELECT:
        if (arity = need(3); arity.ok()) jit->Select(in[0], in[1], in[2]);
        break;
      case v1::GlobalOp::SHARD_MAP_ENTER:
        if (arity = need(1); arity.ok()) jit->ShardMapEnter(in[0], spec(op));
        break;
      case v1::GlobalOp::SHARD_MAP_EXIT:
        if (arity = need(1); arity.ok()) jit->ShardMapExit(in[0], spec(op));
        break;
      case v1::GlobalOp::MANUAL_COLLECTIVE:
        if (arity = need(1); arity.ok()) {
          jit->ManualCollective(op.fn(), in[0], {op.axes().begin(), op.axes().end()}, op.index(),
                                dims(op.dims()), op.value() != 0.0f);
        }
        break;
      case v1::GlobalOp::AXIS_INDEX:
        if (arity = need(0); arity.ok()) jit->ManualAxisIndex({op.axes().begin(), op.axes().end()});
        break;
      case v1::GlobalOp::CONCATENATE:
        if (arity = need(1, false); arity.ok()) jit->Concatenate(in, op.index());
        break;
      case v1::GlobalOp::SLICE:
        if (arity = need(1); arity.ok()) jit->Slice(in[0], dims(op.dims()), dims(op.shape()));
        break;
      case v1::GlobalOp::RESHAPE:
        if (arity = need(1); arity.ok()) jit->Reshape(in[0], dims(op.shape()));
        break;
      case v1::GlobalOp::TRANSPOSE:
        if (arity = need(1); arity.ok()) jit->Transpose(in[0], dims(op.dims()));
        break;
      case v1::GlobalOp::INDEX:
        if (arity = need(1); arity.ok()) jit->Index(in[0], op.index());
        break;
      case v1::GlobalOp::STACK:
        if (arity = need(1, false); arity.ok()) jit->Stack(in);
        break;
      case v1::GlobalOp::DOT_GENERAL:
        if (arity = need(2); arity.ok()) {
          jit->DotGeneral(in[0], in[1], dims(op.lhs_contracting()), dims(op.rhs_contracting()),
                          dims(op.lhs_batch()), dims(op.rhs_batch()));
        }
        break;
      case v1::GlobalOp::REDUCE:
        if (arity = need(1); arity.ok()) jit->Reduce(op.fn(), in[0], dims(op.dims()));
        break;
      case v1::GlobalOp::SOFTMAX_CROSS_ENTROPY:
        if (arity = need(2); arity.ok()) jit->SoftmaxCrossEntropyWithIntegerLabels(in[0], in[1]);
        break;
      case v1::GlobalOp::SOFTMAX_CROSS_ENTROPY_GRAD:
        if (arity = need(3); arity.ok()) jit->SoftmaxCrossEntropyGrad(in[0], in[1], in[2]);
        break;
      case v1::GlobalOp::ADAM_UPDATE:
        if (arity = need(5); arity.ok())
          jit->AdamUpdate(in[0], in[1], in[2], in[3], in[4], op.adam());
        break;
      case v1::GlobalOp::GRAD:
        if (arity = need(1, false); arity.ok())
          jit->Grad(in[0], std::vector<Value>(in.begin() + 1, in.end()));
        break;
      default:
        return absl::InvalidArgumentError(absl::StrCat(where, ": unknown kind ", op.kind()));
    }
    if (!arity.ok()) return arity;
    if (!jit->status_.ok()) break;  // later ops may name values this one failed to make
  }
  return jit;
}

}  // namespace meshrun
