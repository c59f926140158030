// JitBuilder's PRNG ops (core/spmd/jit.h): JAX's threefry keys, bits and flax's dropout; keys
// are replicated u32[2] values, and draws are laid out so that each device draws its own block.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/spmd/jit.h"

namespace meshrun {

JitBuilder::Value JitBuilder::FoldIn(Value key, Value data) {
  Scope rec(this, v1::GlobalOp::FOLD_IN);
  rec.Operands({key, data});
  if (!Valid(key) || !Valid(data)) return {};
  State k = Resolve(values_[key.id], PartitionSpec(), "fold_in");
  const State d = Resolve(values_[data.id], PartitionSpec(), "fold_in");
  ShardMapBuilder::Value scalar = d.local;
  if (d.dtype == v1::DTYPE_F32) scalar = sm_.Convert(scalar, v1::DTYPE_I32);
  k.local = sm_.FoldIn(k.local, scalar);
  return Push(std::move(k), Node(Node::kConstant));
}

JitBuilder::Value JitBuilder::Dropout(Value x, Value key, float rate,
                                      const std::vector<std::string>& fold_axes) {
  Scope rec(this, v1::GlobalOp::DROPOUT);
  rec.Operands({x, key});
  if (rec.op != nullptr) {
    rec.op->set_rate(rate);
    for (const std::string& a : fold_axes) rec.op->add_axes(a);
  }
  if (!Valid(x) || !Valid(key)) return {};
  if (!Check(rate >= 0.0f && rate < 1.0f,
             absl::StrCat("dropout rate ", rate, ": expected 0 <= rate < 1")))
    return {};
  if (rate == 0.0f) return x;
  const State sx = Complete(values_[x.id], "dropout");
  State k = Resolve(values_[key.id], PartitionSpec(), "dropout");
  if (!fold_axes.empty()) k.local = sm_.FoldIn(k.local, sm_.AxisIndex(fold_axes));
  State mask = sx;
  mask.local = sm_.DropoutMask(k.local, sm_.shape(sx.local), rate);
  const Value m = Push(std::move(mask), Node(Node::kConstant));  // no gradient flows into the mask
  Node completed(Node::kConstraint, {x.id});  // x as completed above, not completed twice
  completed.spec = sx.spec;
  return Mul(Push(sx, std::move(completed)), m);
}

JitBuilder::Value JitBuilder::RandomBits(Value key, const Dims& global_dims, const std::string& fn,
                                         const PartitionSpec& spec) {
  Scope rec(this, v1::GlobalOp::RANDOM_BITS);
  rec.Operands({key});
  if (rec.op != nullptr) {
    rec.op->set_fn(fn);
    for (int64_t d : global_dims) rec.op->add_shape(d);
    *rec.op->mutable_spec() = spec.ToProto();
  }
  if (!Valid(key)) return {};
  if (!Check(fn == "partitionable" || fn == "legacy" || fn == "split",
             absl::StrCat("random_bits: fn '", fn, "'; expected partitionable, legacy or split")))
    return {};
  const State k = Resolve(values_[key.id], PartitionSpec(), "random_bits");
  State s;
  s.dtype = v1::DTYPE_U32;
  s.global = global_dims;
  s.spec = spec;
  s.local = sm_.RandomBitsBlock(k.local, global_dims, spec, fn);
  return Push(std::move(s), Node(Node::kConstant));
}

JitBuilder::Value JitBuilder::Threefry2x32(Value k0, Value k1, Value x0, Value x1, int word) {
  Scope rec(this, v1::GlobalOp::THREEFRY2X32);
  rec.Operands({k0, k1, x0, x1});
  if (rec.op != nullptr) rec.op->set_index(word);
  const std::vector<Value> args = {k0, k1, x0, x1};
  for (Value v : args)
    if (!Valid(v)) return {};
  const State* lead = nullptr;  // the first shaped operand: the others follow its layout
  for (Value v : args) {
    if (!values_[v.id].global.empty()) {
      lead = &values_[v.id];
      break;
    }
  }
  std::vector<ShardMapBuilder::Value> local;
  for (Value v : args) {
    const State& s = values_[v.id];
    if (!Check(s.global.empty() || s.global == lead->global,
               absl::StrCat("threefry2x32: operand shapes (", absl::StrJoin(s.global, ", "),
                            ") and (", absl::StrJoin(lead->global, ", "), ") differ")))
      return {};
    local.push_back(
        Resolve(s, s.global.empty() ? PartitionSpec() : lead->spec, "threefry2x32").local);
  }
  State out;
  out.dtype = v1::DTYPE_U32;
  out.global = lead == nullptr ? Dims{} : lead->global;
  out.spec = lead == nullptr ? PartitionSpec() : lead->spec;
  out.local = sm_.Threefry2x32(local[0], local[1], local[2], local[3], word);
  return Push(std::move(out), Node(Node::kConstant));
}

}  // namespace meshrun
