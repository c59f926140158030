#include "core/spmd/jit.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/sharding/named_sharding.h"

namespace meshrun {

std::vector<int64_t> JitBuilder::FreeDims(size_t rank, const std::vector<int>& contracting,
                                          const std::vector<int>& batch) {
  std::vector<int64_t> out;
  for (size_t d = 0; d < rank; ++d) {
    const auto in = [&](const std::vector<int>& v) {
      return std::find(v.begin(), v.end(), static_cast<int>(d)) != v.end();
    };
    if (!in(contracting) && !in(batch)) out.push_back(static_cast<int64_t>(d));
  }
  return out;
}

std::string JitBuilder::Collective::Short() const {
  return absl::StrCat(op, "(", absl::StrJoin(axes, ","), ")",
                      dim >= 0 ? absl::StrCat("@", dim) : "");
}

JitBuilder::Scope::Scope(JitBuilder* b, v1::GlobalOp::Kind kind) : b_(b) {
  if (b_->depth_++ == 0) {
    op = b_->global_.add_ops();
    op->set_kind(kind);
  }
}

JitBuilder::Scope& JitBuilder::Scope::Operands(std::initializer_list<Value> values) {
  return Operands(std::vector<Value>(values));
}

JitBuilder::Scope& JitBuilder::Scope::Operands(const std::vector<Value>& values) {
  if (op != nullptr)
    for (Value v : values) op->add_operands(v.id);
  return *this;
}

bool JitBuilder::Check(bool ok, const std::string& message) {
  if (!ok && status_.ok()) status_ = absl::InvalidArgumentError(message);
  return ok && status_.ok();
}

JitBuilder::Value JitBuilder::Push(State s, Node node) {
  s.node = std::move(node);
  values_.push_back(std::move(s));
  return {static_cast<int>(values_.size()) - 1};
}

JitBuilder::State JitBuilder::ApplyReshards(State s, const std::vector<spmd::Reshard>& reshards,
                                            const std::string& reason) {
  for (const spmd::Reshard& r : reshards) {
    std::vector<PartitionSpec::Entry> entries = s.spec.Padded(s.global.size());
    if (r.kind == spmd::Reshard::kSlice) {
      entries[r.dim] = r.axes;
      const int64_t size = NamedSharding(mesh_, PartitionSpec(entries)).ShardDims(s.global)[r.dim];
      s.local = sm_.DynamicSliceInDim(s.local, sm_.AxisIndex(r.axes), size, r.dim);
    } else {
      collectives_.push_back({"all_gather", r.axes, r.dim,
                              spmd::ReshardBytesPerDevice(r, s.global, s.spec, mesh_,
                                                          static_cast<int>(DTypeSize(s.dtype))),
                              reason});
      s.local = sm_.AllGather(s.local, r.axes, r.dim, /*tiled=*/true);
      entries[r.dim].clear();
    }
    s.spec = PartitionSpec(std::move(entries));
  }
  return s;
}

JitBuilder::State JitBuilder::Resolve(const State& in, const PartitionSpec& target,
                                      const std::string& reason) {
  if (!in.partial.empty() && target == in.spec) return Complete(in, reason);
  return Reduce(in, target, reason);
}

JitBuilder::State JitBuilder::Complete(const State& in, const std::string& reason) {
  if (in.partial.empty()) return Reduce(in, in.spec, reason);
  if (in.scaled != nullptr && in.scaled->local_id == in.local.id) {
    State s = Complete(in.scaled->base, reason);
    for (const Scaled::Step& k : in.scaled->steps) {
      s.local = k.scalar_first ? sm_.Binary(k.fn, k.scalar, s.local)
                               : sm_.Binary(k.fn, s.local, k.scalar);
    }
    State out = in;
    out.local = s.local;
    out.spec = s.spec;
    out.partial.clear();
    out.scaled = nullptr;
    return out;
  }
  const std::string key = absl::StrCat(in.local.id, "|", absl::StrJoin(in.partial, ","), "|",
                                       in.partial_fn, "|", in.spec.ToString());
  auto it = completed_.find(key);
  if (it == completed_.end()) it = completed_.emplace(key, Reduce(in, in.spec, reason)).first;
  State out = in;
  out.local = it->second.local;
  out.spec = it->second.spec;
  out.partial.clear();
  out.scaled = nullptr;
  return out;
}

JitBuilder::State JitBuilder::Reduce(const State& in, const PartitionSpec& target,
                                     const std::string& reason) {
  State s = in;
  s.scaled = nullptr;
  if (!s.partial.empty() && s.partial_fn != "sum") {
    // mean / max of per-device results: pmean / pmax (an all-reduce, as psum), then reshard.
    const int64_t bytes =
        spmd::ReductionBytesPerDevice({spmd::Reduction::kPsum, s.partial}, s.global, s.spec, mesh_,
                                      static_cast<int>(DTypeSize(sm_.dtype(s.local))));
    collectives_.push_back(
        {s.partial_fn == "mean" ? "pmean" : "pmax", s.partial, -1, bytes, reason});
    s.local = s.partial_fn == "mean" ? sm_.Pmean(s.local, s.partial) : sm_.Pmax(s.local, s.partial);
    s.partial.clear();
  }
  absl::StatusOr<spmd::PartialSumPlan> plan =
      spmd::PlanPartialSum(s.global, s.spec, s.partial, target, mesh_);
  if (!Check(plan.ok(), absl::StrCat(reason, ": ", plan.status().message()))) return s;
  for (const spmd::Reduction& r : plan->reductions) {
    const int64_t bytes = spmd::ReductionBytesPerDevice(
        r, s.global, s.spec, mesh_, static_cast<int>(DTypeSize(sm_.dtype(s.local))));
    std::vector<PartitionSpec::Entry> entries = s.spec.Padded(s.global.size());
    if (r.kind == spmd::Reduction::kPsum) {
      collectives_.push_back({"psum", r.axes, -1, bytes, reason});
      s.local = sm_.Psum(s.local, r.axes);
    } else {
      collectives_.push_back({"psum_scatter", r.axes, r.dim, bytes, reason});
      s.local = sm_.PsumScatter(s.local, r.axes, r.dim, /*tiled=*/true);
      entries[r.dim] = r.axes;
    }
    s.spec = PartitionSpec(std::move(entries));
  }
  s.partial.clear();
  // A bf16 value summed from f32 parts (DotGeneral) is rounded once, now that it is complete.
  if (s.dtype == v1::DTYPE_BF16 && sm_.dtype(s.local) == v1::DTYPE_F32)
    s.local = sm_.Convert(s.local, s.dtype);
  return ApplyReshards(std::move(s), plan->reshards, reason);
}

JitBuilder::Value JitBuilder::Input(DType dtype, const Dims& global_dims,
                                    const PartitionSpec& in_spec) {
  Scope rec(this, v1::GlobalOp::INPUT);
  if (rec.op != nullptr) {
    rec.op->set_dtype(dtype);
    for (int64_t d : global_dims) rec.op->add_shape(d);
    *rec.op->mutable_spec() = in_spec.ToProto();
  }
  if (!status_.ok()) return {};
  absl::Status fits = NamedSharding(mesh_, in_spec).Validate(global_dims);
  if (!Check(fits.ok(), absl::StrCat("input ", values_.size(), ": ", fits.message()))) return {};
  State s;
  s.local = sm_.Input(dtype, global_dims, in_spec);
  s.dtype = dtype;
  s.global = global_dims;
  s.spec = in_spec;
  return Push(std::move(s), Node());
}

void JitBuilder::Output(Value v, const PartitionSpec& out_spec) {
  Scope rec(this, v1::GlobalOp::OUTPUT);
  rec.Operands({v});
  if (rec.op != nullptr) *rec.op->mutable_spec() = out_spec.ToProto();
  if (!Valid(v)) return;
  State s = Resolve(values_[v.id], out_spec, absl::StrCat("output ", out_spec.ToString()));
  sm_.Output(s.local, out_spec);
}

void JitBuilder::OutputPropagated(Value v) {
  Scope rec(this, v1::GlobalOp::OUTPUT);
  rec.Operands({v});
  if (rec.op != nullptr) rec.op->set_propagated(true);
  if (!Valid(v)) return;
  const PartitionSpec spec = values_[v.id].spec;
  State s = Resolve(values_[v.id], spec, absl::StrCat("output as propagated, ", spec.ToString()));
  sm_.Output(s.local, spec);
}

JitBuilder::Value JitBuilder::WithShardingConstraint(Value v, const PartitionSpec& spec) {
  Scope rec(this, v1::GlobalOp::CONSTRAINT);
  rec.Operands({v});
  if (rec.op != nullptr) *rec.op->mutable_spec() = spec.ToProto();
  if (!Valid(v)) return {};
  Node node(Node::kConstraint, {v.id});
  node.spec = spec;
  return Push(
      Resolve(values_[v.id], spec, absl::StrCat("with_sharding_constraint ", spec.ToString())),
      std::move(node));
}

absl::StatusOr<v1::ShardMapProgram> JitBuilder::Build() const {
  if (!status_.ok()) return status_;
  return sm_.Build();
}

}  // namespace meshrun