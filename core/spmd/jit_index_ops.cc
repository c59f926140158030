// JitBuilder's indexing ops (core/spmd/jit.h): dynamic_slice, dynamic_update_slice, index and
// stack, whose dynamic starts are replicated scalars.
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/spmd/jit.h"

namespace meshrun {

std::vector<ShardMapBuilder::Value> JitBuilder::ReplicatedScalars(const std::vector<Value>& vs,
                                                                  const std::string& what) {
  std::vector<ShardMapBuilder::Value> out;
  for (Value v : vs) {
    if (!Check(values_[v.id].global.empty(),
               absl::StrCat(what, ": a start is (", absl::StrJoin(values_[v.id].global, ", "),
                            "); expected a scalar")))
      return {};
    out.push_back(Resolve(values_[v.id], PartitionSpec(), what).local);
  }
  return out;
}

JitBuilder::Value JitBuilder::DynamicSlice(Value x, const std::vector<Value>& starts,
                                           const Dims& sizes) {
  Scope rec(this, v1::GlobalOp::DYNAMIC_SLICE);
  std::vector<Value> operands = {x};
  operands.insert(operands.end(), starts.begin(), starts.end());
  rec.Operands(operands);
  if (rec.op != nullptr)
    for (int64_t d : sizes) rec.op->add_shape(d);
  for (Value v : operands)
    if (!Valid(v)) return {};
  const State& sx = values_[x.id];
  bool ok = starts.size() == sx.global.size() && sizes.size() == sx.global.size();
  for (size_t d = 0; ok && d < sizes.size(); ++d) ok = sizes[d] >= 0 && sizes[d] <= sx.global[d];
  if (!Check(ok, absl::StrCat("dynamic_slice of (", absl::StrJoin(sizes, ", "), ") out of (",
                              absl::StrJoin(sx.global, ", "), ") with ", starts.size(),
                              " starts: expected one start and a size <= the dim per dim"))) {
    return {};
  }
  // A dim cut short is gathered; whole dims keep their layout (their start clamps to 0).
  std::vector<PartitionSpec::Entry> entries = sx.spec.Padded(sx.global.size());
  for (size_t d = 0; d < entries.size(); ++d)
    if (sizes[d] != sx.global[d]) entries[d].clear();
  State s = Resolve(sx, PartitionSpec(entries), "dynamic_slice");
  Dims local = sm_.shape(s.local);
  for (size_t d = 0; d < local.size(); ++d)
    if (sizes[d] != sx.global[d]) local[d] = sizes[d];
  std::vector<ShardMapBuilder::Value> at = ReplicatedScalars(starts, "dynamic_slice");
  if (!status_.ok()) return {};
  s.local = sm_.DynamicSlice(s.local, at, local);
  s.global = sizes;
  s.spec = PartitionSpec(entries);
  // Not differentiated here: a traced jaxpr carries its transpose (dynamic_update_slice).
  return Push(std::move(s), Node(Node::kConstant));
}

JitBuilder::Value JitBuilder::DynamicUpdateSlice(Value x, Value update,
                                                 const std::vector<Value>& starts) {
  Scope rec(this, v1::GlobalOp::DYNAMIC_UPDATE_SLICE);
  std::vector<Value> operands = {x, update};
  operands.insert(operands.end(), starts.begin(), starts.end());
  rec.Operands(operands);
  for (Value v : operands)
    if (!Valid(v)) return {};
  const State& sx = values_[x.id];
  const State& su = values_[update.id];
  bool ok = starts.size() == sx.global.size() && su.global.size() == sx.global.size() &&
            su.dtype == sx.dtype;
  for (size_t d = 0; ok && d < su.global.size(); ++d) ok = su.global[d] <= sx.global[d];
  if (!Check(ok, absl::StrCat("dynamic_update_slice of (", absl::StrJoin(su.global, ", "),
                              ") into (", absl::StrJoin(sx.global, ", "), ") with ", starts.size(),
                              " starts: expected one dtype, one start per dim and an update no "
                              "larger than x"))) {
    return {};
  }
  // Dims the update covers whole keep x's layout, in both; the others are gathered.
  std::vector<PartitionSpec::Entry> entries = sx.spec.Padded(sx.global.size());
  for (size_t d = 0; d < entries.size(); ++d)
    if (su.global[d] != sx.global[d]) entries[d].clear();
  State s = Resolve(sx, PartitionSpec(entries), "dynamic_update_slice");
  const State u = Resolve(su, PartitionSpec(entries), "dynamic_update_slice");
  std::vector<ShardMapBuilder::Value> at = ReplicatedScalars(starts, "dynamic_update_slice");
  if (!status_.ok()) return {};
  s.local = sm_.DynamicUpdateSlice(s.local, u.local, at);
  s.spec = PartitionSpec(entries);
  return Push(std::move(s), Node(Node::kConstant));
}

JitBuilder::Value JitBuilder::Index(Value x, int64_t index) {
  Scope rec(this, v1::GlobalOp::INDEX);
  rec.Operands({x});
  if (rec.op != nullptr) rec.op->set_index(index);
  if (!Valid(x)) return {};
  const State& sx = values_[x.id];
  if (!Check(!sx.global.empty() && index >= 0 && index < sx.global[0],
             absl::StrCat("index ", index, " is out of range for shape (",
                          absl::StrJoin(sx.global, ", "), ")"))) {
    return {};
  }
  std::vector<PartitionSpec::Entry> entries = sx.spec.Padded(sx.global.size());
  entries[0].clear();
  State s = Resolve(sx, PartitionSpec(entries), absl::StrCat("index ", index));
  Dims sizes = sm_.shape(s.local);
  std::vector<int64_t> starts(sizes.size(), 0);
  starts[0] = index;
  sizes[0] = 1;
  s.local = sm_.Reshape(sm_.Slice(s.local, starts, sizes), Dims(sizes.begin() + 1, sizes.end()));
  s.global.erase(s.global.begin());
  s.spec = PartitionSpec(std::vector<PartitionSpec::Entry>(entries.begin() + 1, entries.end()));
  Node node(Node::kIndex, {x.id});
  node.index = index;
  return Push(std::move(s), std::move(node));
}

JitBuilder::Value JitBuilder::Stack(const std::vector<Value>& values) {
  Scope rec(this, v1::GlobalOp::STACK);
  if (rec.op != nullptr)
    for (Value v : values) rec.op->add_operands(v.id);
  if (!Check(!values.empty(), "stack: no values")) return {};
  for (Value v : values)
    if (!Valid(v)) return {};
  const State& head = values_[values[0].id];
  bool same_partial = !head.partial.empty() && head.partial_fn == "sum";
  for (Value v : values) {
    const State& s = values_[v.id];
    if (!Check(s.global == head.global,
               absl::StrCat("stack: shapes (", absl::StrJoin(head.global, ", "), ") and (",
                            absl::StrJoin(s.global, ", "), ") differ"))) {
      return {};
    }
    same_partial = same_partial && s.partial == head.partial && s.partial_fn == "sum" &&
                   s.spec == head.spec && sm_.dtype(s.local) == sm_.dtype(head.local);
  }
  // Rows that are all partial sums over the same axes in one layout stack as they are (one psum
  // of the stack later, not one per row); otherwise each row is completed and resharded to the
  // first row's layout.
  State out = same_partial ? head : Complete(head, "stack");
  std::vector<ShardMapBuilder::Value> locals;
  Node node(Node::kStack);
  for (Value v : values) {
    locals.push_back(same_partial           ? values_[v.id].local
                     : v.id == values[0].id ? out.local
                                            : Resolve(values_[v.id], out.spec, "stack").local);
    node.operands.push_back(v.id);
  }
  std::vector<PartitionSpec::Entry> entries = out.spec.Padded(out.global.size());
  entries.insert(entries.begin(), PartitionSpec::Entry{});
  out.local = sm_.Stack(locals, 0);
  out.global.insert(out.global.begin(), static_cast<int64_t>(values.size()));
  out.spec = PartitionSpec(entries);
  return Push(std::move(out), std::move(node));
}

}  // namespace meshrun
