// JitBuilder's shard_map regions (core/spmd/jit.h): entering and leaving a region, and the
// collectives and axis_index inside it, which run on each block as jax.shard_map's body does.
#include "absl/strings/str_cat.h"
#include "core/sharding/named_sharding.h"
#include "core/spmd/jit.h"

namespace meshrun {

JitBuilder::Value JitBuilder::ShardMapEnter(Value x, const PartitionSpec& in_spec) {
  Scope rec(this, v1::GlobalOp::SHARD_MAP_ENTER);
  rec.Operands({x});
  if (rec.op != nullptr) *rec.op->mutable_spec() = in_spec.ToProto();
  if (!Valid(x)) return {};
  absl::Status fits = NamedSharding(mesh_, in_spec).Validate(values_[x.id].global);
  if (!Check(fits.ok(), absl::StrCat("shard_map in_spec: ", fits.message()))) return {};
  State s = Resolve(values_[x.id], in_spec, "shard_map");
  s.global = sm_.shape(s.local);
  s.spec = PartitionSpec();
  return Push(std::move(s), Node(Node::kConstant));
}

JitBuilder::Value JitBuilder::ShardMapExit(Value block, const PartitionSpec& out_spec) {
  Scope rec(this, v1::GlobalOp::SHARD_MAP_EXIT);
  rec.Operands({block});
  if (rec.op != nullptr) *rec.op->mutable_spec() = out_spec.ToProto();
  if (!Valid(block)) return {};
  State s = Complete(values_[block.id], "shard_map");
  const std::vector<PartitionSpec::Entry> entries = out_spec.Padded(s.global.size());
  if (!Check(entries.size() == s.global.size(),
             absl::StrCat("shard_map out_spec ", out_spec.ToString(),
                          " has more entries than the "
                          "block's rank ",
                          s.global.size()))) {
    return {};
  }
  for (size_t d = 0; d < entries.size(); ++d) {
    for (const std::string& axis : entries[d]) {
      absl::StatusOr<int> a = mesh_.AxisIndex(axis);
      if (!Check(a.ok(), absl::StrCat("shard_map out_spec: ", a.status().message()))) return {};
      s.global[d] *= mesh_.axis_size(*a);
    }
  }
  s.spec = out_spec;
  return Push(std::move(s), Node(Node::kConstant));
}

JitBuilder::Value JitBuilder::ManualCollective(const std::string& fn, Value x,
                                               const std::vector<std::string>& axes, int64_t dim,
                                               const std::vector<int64_t>& dims, bool tiled) {
  Scope rec(this, v1::GlobalOp::MANUAL_COLLECTIVE);
  rec.Operands({x});
  if (rec.op != nullptr) {
    rec.op->set_fn(fn);
    for (const std::string& a : axes) rec.op->add_axes(a);
    rec.op->set_index(dim);
    for (int64_t d : dims) rec.op->add_dims(d);
    rec.op->set_value(tiled ? 1.0f : 0.0f);
  }
  if (!Valid(x)) return {};
  State s = Complete(values_[x.id], fn);
  if (fn == "psum") {
    s.local = sm_.Psum(s.local, axes);
  } else if (fn == "pmax") {
    s.local = sm_.Pmax(s.local, axes);
  } else if (fn == "all_gather") {
    s.local = sm_.AllGather(s.local, axes, dim, tiled);
  } else if (fn == "psum_scatter") {
    s.local = sm_.PsumScatter(s.local, axes, dim, tiled);
  } else if (fn == "all_to_all" && dims.size() == 1) {
    s.local = sm_.AllToAll(s.local, axes, dim, dims[0]);
  } else if (fn == "ppermute" && dims.size() % 2 == 0) {
    std::vector<std::pair<int, int>> perm;
    for (size_t i = 0; i + 1 < dims.size(); i += 2)
      perm.push_back({static_cast<int>(dims[i]), static_cast<int>(dims[i + 1])});
    s.local = sm_.Ppermute(s.local, axes, perm);
  } else {
    Check(false, absl::StrCat("shard_map collective '", fn, "' (", dims.size(),
                              " dims) is not one of psum pmax all_gather psum_scatter ppermute "
                              "all_to_all"));
    return {};
  }
  if (!sm_.status().ok()) return {};
  s.global = sm_.shape(s.local);
  s.spec = PartitionSpec();
  return Push(std::move(s), Node(Node::kConstant));
}

JitBuilder::Value JitBuilder::ManualAxisIndex(const std::vector<std::string>& axes) {
  Scope rec(this, v1::GlobalOp::AXIS_INDEX);
  if (rec.op != nullptr)
    for (const std::string& a : axes) rec.op->add_axes(a);
  if (!status_.ok() || !sm_.status().ok()) return {};
  State s;
  s.local = sm_.AxisIndex(axes);
  if (!sm_.status().ok()) return {};
  s.dtype = sm_.dtype(s.local);
  s.global = sm_.shape(s.local);
  return Push(std::move(s), Node(Node::kConstant));
}

}  // namespace meshrun
