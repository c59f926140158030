#include "meshrun/jit.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/sharding/named_sharding.h"

namespace meshrun {
namespace {

std::vector<int> ToInt(const std::vector<int64_t>& v) {
  return std::vector<int>(v.begin(), v.end());
}

}  // namespace

bool JitBuilder::Check(bool ok, const std::string& message) {
  if (!ok && status_.ok()) status_ = absl::InvalidArgumentError(message);
  return ok && status_.ok();
}

JitBuilder::Value JitBuilder::Add(State s) {
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
  State s = in;
  if (!s.partial.empty() && s.partial_fn != "sum") {
    // mean / max of per-device results: pmean / pmax (an all-reduce, as psum), then reshard.
    const int64_t bytes =
        spmd::ReductionBytesPerDevice({spmd::Reduction::kPsum, s.partial}, s.global, s.spec, mesh_,
                                      static_cast<int>(DTypeSize(s.dtype)));
    collectives_.push_back(
        {s.partial_fn == "mean" ? "pmean" : "pmax", s.partial, -1, bytes, reason});
    s.local = s.partial_fn == "mean" ? sm_.Pmean(s.local, s.partial) : sm_.Pmax(s.local, s.partial);
    s.partial.clear();
  }
  absl::StatusOr<spmd::PartialSumPlan> plan =
      spmd::PlanPartialSum(s.global, s.spec, s.partial, target, mesh_);
  if (!Check(plan.ok(), absl::StrCat(reason, ": ", plan.status().message()))) return s;
  for (const spmd::Reduction& r : plan->reductions) {
    const int64_t bytes = spmd::ReductionBytesPerDevice(r, s.global, s.spec, mesh_,
                                                        static_cast<int>(DTypeSize(s.dtype)));
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
  return ApplyReshards(std::move(s), plan->reshards, reason);
}

JitBuilder::Value JitBuilder::Input(DType dtype, const Dims& global_dims,
                                    const PartitionSpec& in_spec) {
  if (!status_.ok()) return {};
  absl::Status fits = NamedSharding(mesh_, in_spec).Validate(global_dims);
  if (!Check(fits.ok(), absl::StrCat("input ", values_.size(), ": ", fits.message()))) return {};
  return Add({sm_.Input(dtype, global_dims, in_spec), dtype, global_dims, in_spec, {}, ""});
}

void JitBuilder::Output(Value v, const PartitionSpec& out_spec) {
  if (!Valid(v)) return;
  State s = Resolve(values_[v.id], out_spec, absl::StrCat("output ", out_spec.ToString()));
  sm_.Output(s.local, out_spec);
}

JitBuilder::Value JitBuilder::WithShardingConstraint(Value v, const PartitionSpec& spec) {
  if (!Valid(v)) return {};
  return Add(
      Resolve(values_[v.id], spec, absl::StrCat("with_sharding_constraint ", spec.ToString())));
}

JitBuilder::Value JitBuilder::Unary(const std::string& fn, Value x) {
  if (!Valid(x)) return {};
  State s = Complete(values_[x.id], fn);
  s.local = sm_.Unary(fn, s.local);
  return Add(std::move(s));
}

JitBuilder::Value JitBuilder::Binary(const std::string& fn, Value a, Value b) {
  if (!Valid(a) || !Valid(b)) return {};
  const State& sa = values_[a.id];
  const State& sb = values_[b.id];
  if (!Check(sa.global == sb.global,
             absl::StrCat(fn, ": operand shapes (", absl::StrJoin(sa.global, ", "), ") and (",
                          absl::StrJoin(sb.global, ", "), ") differ"))) {
    return {};
  }
  State l = Complete(sa, fn);
  State r = Complete(sb, fn);
  absl::StatusOr<spmd::OpPlan> plan = spmd::PlanElementwise(l.global, l.spec, r.spec, mesh_);
  if (!Check(plan.ok(), absl::StrCat(fn, ": ", plan.status().message()))) return {};
  r = ApplyReshards(std::move(r), plan->reshards, fn);
  l.local = sm_.Binary(fn, l.local, r.local);
  return Add(std::move(l));
}

JitBuilder::Value JitBuilder::DotGeneral(Value a, Value b,
                                         const std::vector<int64_t>& lhs_contracting,
                                         const std::vector<int64_t>& rhs_contracting,
                                         const std::vector<int64_t>& lhs_batch,
                                         const std::vector<int64_t>& rhs_batch) {
  if (!Valid(a) || !Valid(b)) return {};
  State l = Complete(values_[a.id], "dot_general");
  State r = Complete(values_[b.id], "dot_general");
  const spmd::DotDimensionNumbers dn{ToInt(lhs_contracting), ToInt(rhs_contracting),
                                     ToInt(lhs_batch), ToInt(rhs_batch)};
  absl::StatusOr<spmd::OpPlan> plan =
      spmd::PlanDotGeneral(l.global, l.spec, r.global, r.spec, dn, mesh_);
  if (!Check(plan.ok(), absl::StrCat("dot_general: ", plan.status().message()))) return {};
  std::vector<spmd::Reshard> lhs_reshards, rhs_reshards;
  for (const spmd::Reshard& rs : plan->reshards)
    (rs.operand == 0 ? lhs_reshards : rhs_reshards).push_back(rs);
  l = ApplyReshards(std::move(l), lhs_reshards, "dot_general lhs");
  r = ApplyReshards(std::move(r), rhs_reshards, "dot_general rhs");
  State out;
  out.local =
      sm_.DotGeneral(l.local, r.local, lhs_contracting, rhs_contracting, lhs_batch, rhs_batch);
  out.dtype = l.dtype;
  for (size_t i = 0; i < lhs_batch.size(); ++i) out.global.push_back(l.global[lhs_batch[i]]);
  for (size_t d = 0; d < l.global.size(); ++d) {
    const auto in = [&](const std::vector<int64_t>& v) {
      return std::find(v.begin(), v.end(), d) != v.end();
    };
    if (!in(lhs_contracting) && !in(lhs_batch)) out.global.push_back(l.global[d]);
  }
  for (size_t d = 0; d < r.global.size(); ++d) {
    const auto in = [&](const std::vector<int64_t>& v) {
      return std::find(v.begin(), v.end(), d) != v.end();
    };
    if (!in(rhs_contracting) && !in(rhs_batch)) out.global.push_back(r.global[d]);
  }
  out.spec = plan->result;
  out.partial = plan->partial_sum_axes;
  out.partial_fn = "sum";
  return Add(std::move(out));
}

JitBuilder::Value JitBuilder::Reduce(const std::string& fn, Value x,
                                     const std::vector<int64_t>& dims) {
  if (!Valid(x)) return {};
  if (!Check(fn == "sum" || fn == "mean" || fn == "max",
             absl::StrCat("reduce: fn '", fn, "' is not one of sum, mean, max"))) {
    return {};
  }
  State s = Complete(values_[x.id], fn);
  absl::StatusOr<spmd::OpPlan> plan = spmd::PlanReduce(s.global, s.spec, ToInt(dims), mesh_);
  if (!Check(plan.ok(), absl::StrCat("reduce: ", plan.status().message()))) return {};
  State out;
  out.local = sm_.Reduce(fn, s.local, dims);
  out.dtype = s.dtype;
  for (size_t d = 0; d < s.global.size(); ++d) {
    if (std::find(dims.begin(), dims.end(), static_cast<int64_t>(d)) == dims.end())
      out.global.push_back(s.global[d]);
  }
  out.spec = plan->result;
  out.partial = plan->partial_sum_axes;
  out.partial_fn = fn;
  return Add(std::move(out));
}

absl::StatusOr<v1::ShardMapProgram> JitBuilder::Build() const {
  if (!status_.ok()) return status_;
  return sm_.Build();
}

}  // namespace meshrun
