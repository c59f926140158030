// JitBuilder's layout ops (core/spmd/jit.h): broadcast_in_dim, reshape, transpose, slice,
// cumulative ops, reverse, sort and concatenate; each chooses its result's layout from its
// operands' and records itself on the global program.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/sharding/named_sharding.h"
#include "core/spmd/jit.h"

namespace meshrun {

JitBuilder::Value JitBuilder::BroadcastInDim(Value x, const Dims& out_dims,
                                             const std::vector<int64_t>& broadcast_dimensions,
                                             const PartitionSpec& out_spec) {
  return Broadcast(x, out_dims, broadcast_dimensions, &out_spec);
}

JitBuilder::Value JitBuilder::BroadcastInDimPropagated(
    Value x, const Dims& out_dims, const std::vector<int64_t>& broadcast_dimensions) {
  return Broadcast(x, out_dims, broadcast_dimensions, nullptr);
}

JitBuilder::Value JitBuilder::Broadcast(Value x, const Dims& out_dims,
                                        const std::vector<int64_t>& broadcast_dimensions,
                                        const PartitionSpec* out_spec) {
  Scope rec(this, v1::GlobalOp::BROADCAST_IN_DIM);
  rec.Operands({x});
  if (rec.op != nullptr) {
    for (int64_t d : out_dims) rec.op->add_shape(d);
    for (int64_t d : broadcast_dimensions) rec.op->add_dims(d);
    if (out_spec != nullptr) *rec.op->mutable_spec() = out_spec->ToProto();
  }
  if (!Valid(x)) return {};
  const Dims in = values_[x.id].global;
  bool ok = broadcast_dimensions.size() == in.size();
  for (size_t i = 0; ok && i < in.size(); ++i) {
    const int64_t d = broadcast_dimensions[i];
    ok = d >= 0 && d < static_cast<int64_t>(out_dims.size()) &&
         (out_dims[d] == in[i] || in[i] == 1) && (i == 0 || d > broadcast_dimensions[i - 1]);
  }
  if (!Check(ok, absl::StrCat("broadcast_in_dim: (", absl::StrJoin(in, ", "), ") to (",
                              absl::StrJoin(out_dims, ", "), ") with broadcast_dimensions (",
                              absl::StrJoin(broadcast_dimensions, ", "),
                              "): expected increasing dims of equal size (or 1)"))) {
    return {};
  }
  PartitionSpec spec;
  if (out_spec != nullptr) {
    spec = *out_spec;
  } else {
    // Propagated: the operand's (completed) layout on the dims it keeps.
    const std::vector<PartitionSpec::Entry> from = values_[x.id].spec.Padded(in.size());
    std::vector<PartitionSpec::Entry> entries(out_dims.size());
    for (size_t i = 0; i < in.size(); ++i)
      if (out_dims[broadcast_dimensions[i]] == in[i]) entries[broadcast_dimensions[i]] = from[i];
    spec = PartitionSpec(entries);
  }
  const NamedSharding sharding(mesh_, spec);
  absl::Status fits = sharding.Validate(out_dims);
  if (!Check(fits.ok(), absl::StrCat("broadcast_in_dim: ", fits.message()))) return {};
  const std::vector<PartitionSpec::Entry> out_entries = spec.Padded(out_dims.size());
  std::vector<PartitionSpec::Entry> in_entries;
  for (size_t i = 0; i < in.size(); ++i) {
    const int64_t d = broadcast_dimensions[i];
    in_entries.push_back(out_dims[d] == in[i] ? out_entries[d] : PartitionSpec::Entry());
  }
  State s = Resolve(values_[x.id], PartitionSpec(in_entries), "broadcast_in_dim");
  const Dims local_out = sharding.ShardDims(out_dims);
  Dims keep(out_dims.size(), 1);
  for (size_t i = 0; i < broadcast_dimensions.size(); ++i) {
    const int64_t d = broadcast_dimensions[i];
    if (out_dims[d] == in[i]) keep[d] = local_out[d];
  }
  if (keep != sm_.shape(s.local)) s.local = sm_.Reshape(s.local, keep);
  if (keep != local_out) s.local = sm_.BroadcastTo(s.local, local_out);
  s.global = out_dims;
  s.spec = spec;
  Node node(Node::kBroadcast, {x.id});
  node.dims = broadcast_dimensions;
  node.spec = spec;
  return Push(std::move(s), std::move(node));
}

JitBuilder::Value JitBuilder::Reshape(Value x, const Dims& global_dims) {
  Scope rec(this, v1::GlobalOp::RESHAPE);
  rec.Operands({x});
  if (rec.op != nullptr)
    for (int64_t d : global_dims) rec.op->add_shape(d);
  if (!Valid(x)) return {};
  const State& sx = values_[x.id];
  const Dims& in = sx.global;
  int64_t in_count = 1, out_count = 1;
  bool ok = true;
  for (int64_t d : in) in_count *= d;  // CheckedByteSize bounded every value's size
  for (int64_t d : global_dims) {
    ok = ok && d > 0 && out_count <= (int64_t{1} << 46) / d;
    if (ok) out_count *= d;
  }
  if (!Check(ok && in_count > 0 && in_count == out_count,
             absl::StrCat("reshape: (", absl::StrJoin(in, ", "), ") to (",
                          absl::StrJoin(global_dims, ", "),
                          "): expected positive dims with the same element count"))) {
    return {};
  }
  const std::vector<PartitionSpec::Entry> from = sx.spec.Padded(in.size());
  std::vector<PartitionSpec::Entry> target = from;
  std::vector<PartitionSpec::Entry> out(global_dims.size());
  size_t i = 0, j = 0;
  while (i < in.size() || j < global_dims.size()) {
    if (i < in.size() && in[i] == 1) {
      ++i;  // a unit dim is never sharded (a mesh axis of size 1 aside: dropped)
      target[i - 1].clear();
      continue;
    }
    if (j < global_dims.size() && global_dims[j] == 1) {
      ++j;
      continue;
    }
    // One group: in[i0, i) and out[j0, j) multiply to the same product.
    const size_t i0 = i, j0 = j;
    int64_t pi = in[i++], pj = global_dims[j++];
    while (pi != pj) {
      if (pi < pj) {
        pi *= in[i++];
      } else {
        pj *= global_dims[j++];
      }
    }
    int64_t devices = 1;
    for (const std::string& axis : from[i0]) {
      absl::StatusOr<int> a = mesh_.AxisIndex(axis);
      if (a.ok()) devices *= mesh_.axis_size(*a);
    }
    // The group's minor input dims are gathered; its major one keeps its sharding if it fits.
    for (size_t k = i0 + 1; k < i; ++k) target[k].clear();
    if (global_dims[j0] % devices == 0) {
      out[j0] = from[i0];
    } else {
      target[i0].clear();
    }
  }
  State s = Resolve(sx, PartitionSpec(target), "reshape");
  const PartitionSpec spec(out);
  s.local = sm_.Reshape(s.local, NamedSharding(mesh_, spec).ShardDims(global_dims));
  s.global = global_dims;
  s.spec = spec;
  return Push(std::move(s), Node(Node::kReshape, {x.id}));
}

JitBuilder::Value JitBuilder::Transpose(Value x, const std::vector<int64_t>& perm) {
  Scope rec(this, v1::GlobalOp::TRANSPOSE);
  rec.Operands({x});
  if (rec.op != nullptr)
    for (int64_t d : perm) rec.op->add_dims(d);
  if (!Valid(x)) return {};
  State s = Complete(values_[x.id], "transpose");
  std::vector<int64_t> sorted = perm;
  std::sort(sorted.begin(), sorted.end());
  bool ok = perm.size() == s.global.size();
  for (size_t i = 0; ok && i < sorted.size(); ++i) ok = sorted[i] == static_cast<int64_t>(i);
  if (!Check(ok, absl::StrCat("transpose: perm (", absl::StrJoin(perm, ", "),
                              ") is not a permutation of the ", s.global.size(), " dims"))) {
    return {};
  }
  const std::vector<PartitionSpec::Entry> in = s.spec.Padded(s.global.size());
  std::vector<PartitionSpec::Entry> entries;
  Dims global;
  for (int64_t p : perm) {
    entries.push_back(in[p]);
    global.push_back(s.global[p]);
  }
  s.local = sm_.Transpose(s.local, perm);
  s.global = global;
  s.spec = PartitionSpec(entries);
  Node node(Node::kTranspose, {x.id});
  node.dims = perm;
  return Push(std::move(s), std::move(node));
}

JitBuilder::Value JitBuilder::Slice(Value x, const std::vector<int64_t>& starts,
                                    const std::vector<int64_t>& limits) {
  Scope rec(this, v1::GlobalOp::SLICE);
  rec.Operands({x});
  if (rec.op != nullptr) {
    for (int64_t d : starts) rec.op->add_dims(d);
    for (int64_t d : limits) rec.op->add_shape(d);
  }
  if (!Valid(x)) return {};
  const State& sx = values_[x.id];
  bool ok = starts.size() == sx.global.size() && limits.size() == sx.global.size();
  for (size_t d = 0; ok && d < starts.size(); ++d)
    ok = starts[d] >= 0 && starts[d] < limits[d] && limits[d] <= sx.global[d];
  if (!Check(ok, absl::StrCat("slice of (", absl::StrJoin(sx.global, ", "), ") from (",
                              absl::StrJoin(starts, ", "), ") to (", absl::StrJoin(limits, ", "),
                              "): expected 0 <= start < limit <= size in every dim"))) {
    return {};
  }
  std::vector<PartitionSpec::Entry> entries = sx.spec.Padded(sx.global.size());
  Dims out_dims(sx.global.size());
  for (size_t d = 0; d < entries.size(); ++d) {
    out_dims[d] = limits[d] - starts[d];
    if (out_dims[d] != sx.global[d]) entries[d].clear();
  }
  State s = Resolve(sx, PartitionSpec(entries), "slice");
  const Dims local = sm_.shape(s.local);
  std::vector<int64_t> local_starts(starts.size(), 0);
  Dims sizes = local;
  for (size_t d = 0; d < starts.size(); ++d) {
    if (out_dims[d] != sx.global[d]) {
      local_starts[d] = starts[d];
      sizes[d] = out_dims[d];
    }
  }
  if (sizes != local) s.local = sm_.Slice(s.local, local_starts, sizes);
  s.global = out_dims;
  s.spec = PartitionSpec(entries);
  return Push(std::move(s), Node(Node::kConstant));  // no gradient flows back (yet)
}

JitBuilder::Value JitBuilder::Cumulative(Value x, const std::string& fn, int64_t dim,
                                         bool reverse) {
  Scope rec(this, v1::GlobalOp::CUMULATIVE);
  rec.Operands({x});
  if (rec.op != nullptr) {
    rec.op->set_fn(fn);
    rec.op->set_index(dim);
    rec.op->set_value(reverse ? 1.0f : 0.0f);
  }
  if (!Valid(x)) return {};
  const State& sx = values_[x.id];
  if (!Check(dim >= 0 && dim < static_cast<int64_t>(sx.global.size()),
             absl::StrCat("cumulative ", fn, " along dim ", dim, " of (",
                          absl::StrJoin(sx.global, ", "), ")")))
    return {};
  std::vector<PartitionSpec::Entry> entries = sx.spec.Padded(sx.global.size());
  entries[dim].clear();  // the scanned dim whole on each device
  State s = Resolve(sx, PartitionSpec(entries), "cumulative");
  s.local = sm_.Cumulative(s.local, fn, dim, reverse);
  s.spec = PartitionSpec(entries);
  return Push(std::move(s), Node(Node::kConstant));
}

JitBuilder::Value JitBuilder::Reverse(Value x, const std::vector<int64_t>& dims) {
  Scope rec(this, v1::GlobalOp::REVERSE);
  rec.Operands({x});
  if (rec.op != nullptr)
    for (int64_t d : dims) rec.op->add_dims(d);
  if (!Valid(x)) return {};
  const State& sx = values_[x.id];
  std::vector<PartitionSpec::Entry> entries = sx.spec.Padded(sx.global.size());
  for (int64_t d : dims) {
    if (!Check(d >= 0 && d < static_cast<int64_t>(sx.global.size()),
               absl::StrCat("rev of dim ", d, " of (", absl::StrJoin(sx.global, ", "), ")")))
      return {};
    entries[d].clear();  // a reversed dim whole on each device
  }
  State s = Resolve(sx, PartitionSpec(entries), "rev");
  s.local = sm_.Reverse(s.local, dims);
  s.spec = PartitionSpec(entries);
  return Push(std::move(s), Node(Node::kConstant));
}

JitBuilder::Value JitBuilder::Sort(const std::vector<Value>& operands, int64_t dim, int num_keys,
                                   int result) {
  Scope rec(this, v1::GlobalOp::SORT);
  rec.Operands(operands);
  if (rec.op != nullptr) {
    rec.op->set_index(dim);
    rec.op->add_dims(num_keys);
    rec.op->add_dims(result);
  }
  for (Value v : operands)
    if (!Valid(v)) return {};
  if (!Check(!operands.empty() && result >= 0 && result < static_cast<int>(operands.size()),
             absl::StrCat("sort: result ", result, " of ", operands.size(), " operands")))
    return {};
  const State& first = values_[operands[0].id];
  bool ok = dim >= 0 && dim < static_cast<int64_t>(first.global.size());
  for (Value v : operands) ok = ok && values_[v.id].global == first.global;
  if (!Check(ok, absl::StrCat("sort along dim ", dim, " of (", absl::StrJoin(first.global, ", "),
                              "): expected operands of that one shape")))
    return {};
  std::vector<PartitionSpec::Entry> entries = first.spec.Padded(first.global.size());
  entries[dim].clear();  // the sorted dim whole on each device
  std::vector<ShardMapBuilder::Value> local;
  State s;
  for (size_t i = 0; i < operands.size(); ++i) {
    State r = Resolve(values_[operands[i].id], PartitionSpec(entries), "sort");
    local.push_back(r.local);
    if (static_cast<int>(i) == result) s = std::move(r);
  }
  s.local = sm_.Sort(local, dim, num_keys, result);
  s.spec = PartitionSpec(entries);
  return Push(std::move(s), Node(Node::kConstant));
}

std::vector<PartitionSpec::Entry> JitBuilder::MostPartitioned(const std::vector<Value>& values,
                                                              int64_t dim, int64_t rank) const {
  // The first operand with the most partitioned dims other than `dim`: a replicated operand (a
  // padding block) is then sliced locally to its layout, rather than a partitioned operand
  // all-gathered to the replicated one.
  std::vector<PartitionSpec::Entry> best;
  int most = -1;
  for (Value v : values) {
    std::vector<PartitionSpec::Entry> e = values_[v.id].spec.Padded(rank);
    int count = 0;
    for (int64_t d = 0; d < rank; ++d) count += d != dim && !e[d].empty() ? 1 : 0;
    if (count > most) {
      most = count;
      best = std::move(e);
    }
  }
  return best;
}

JitBuilder::Value JitBuilder::Concatenate(const std::vector<Value>& values, int64_t dim) {
  Scope rec(this, v1::GlobalOp::CONCATENATE);
  if (rec.op != nullptr) {
    for (Value v : values) rec.op->add_operands(v.id);
    rec.op->set_index(dim);
  }
  if (!Check(!values.empty(), "concatenate: no values")) return {};
  for (Value v : values)
    if (!Valid(v)) return {};
  const State& head = values_[values[0].id];
  const int64_t rank = static_cast<int64_t>(head.global.size());
  if (!Check(dim >= 0 && dim < rank, absl::StrCat("concatenate: dim ", dim, " of rank ", rank))) {
    return {};
  }
  Dims out_dims = head.global;
  out_dims[dim] = 0;
  for (Value v : values) {
    const State& s = values_[v.id];
    bool ok = static_cast<int64_t>(s.global.size()) == rank && s.dtype == head.dtype;
    for (int64_t d = 0; ok && d < rank; ++d) ok = d == dim || s.global[d] == head.global[d];
    if (!Check(ok, absl::StrCat("concatenate along ", dim, ": shapes (",
                                absl::StrJoin(head.global, ", "), ") and (",
                                absl::StrJoin(s.global, ", "), ") or their dtypes differ"))) {
      return {};
    }
    out_dims[dim] += s.global[dim];
  }
  std::vector<PartitionSpec::Entry> entries = MostPartitioned(values, dim, rank);
  entries[dim].clear();
  const PartitionSpec spec(entries);
  std::vector<ShardMapBuilder::Value> locals;
  Node node(Node::kConcatenate);
  node.index = dim;
  State out;
  for (Value v : values) {
    State r = Resolve(values_[v.id], spec, "concatenate");
    if (locals.empty()) out = r;
    locals.push_back(r.local);
    node.operands.push_back(v.id);
  }
  out.local = sm_.Concatenate(locals, dim);
  out.global = out_dims;
  out.spec = spec;
  return Push(std::move(out), std::move(node));
}

}  // namespace meshrun
