#include "core/spmd/sharding_rules.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/sharding/named_sharding.h"

namespace meshrun {
namespace spmd {
namespace {

using Entries = std::vector<PartitionSpec::Entry>;

bool UsesAny(const Entries& entries, const PartitionSpec::Entry& axes) {
  for (const auto& e : entries) {
    for (const auto& a : axes) {
      if (std::find(e.begin(), e.end(), a) != e.end()) return true;
    }
  }
  return false;
}

absl::Status CheckFits(const char* what, const std::vector<int64_t>& shape,
                       const PartitionSpec& spec, const Mesh& mesh) {
  absl::Status s = NamedSharding(mesh, spec).Validate(shape);
  if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat(what, ": ", s.message()));
  return absl::OkStatus();
}

// The operands' layouts as the plan changes them, recording each change.
class Layouts {
 public:
  explicit Layouts(std::vector<Entries> e) : e_(std::move(e)) {}
  Entries& operator[](int operand) { return e_[operand]; }
  void Gather(int operand, int dim) {
    reshards_.push_back({Reshard::kAllGather, operand, dim, e_[operand][dim]});
    e_[operand][dim].clear();
  }
  void Slice(int operand, int dim, const PartitionSpec::Entry& axes) {
    reshards_.push_back({Reshard::kSlice, operand, dim, axes});
    e_[operand][dim] = axes;
  }
  // Makes lhs dim `a` and rhs dim `b` (same size) laid out alike; returns their layout.
  PartitionSpec::Entry Align(int a, int b) {
    if (e_[0][a] == e_[1][b]) return e_[0][a];
    if (!e_[0][a].empty() && !e_[1][b].empty()) Gather(1, b);
    if (!e_[0][a].empty()) {
      if (!UsesAny(e_[1], e_[0][a])) {
        Slice(1, b, e_[0][a]);
      } else {
        Gather(0, a);
      }
    } else if (!e_[1][b].empty()) {
      if (!UsesAny(e_[0], e_[1][b])) {
        Slice(0, a, e_[1][b]);
      } else {
        Gather(1, b);
      }
    }
    return e_[0][a];
  }
  OpPlan Finish(Entries result, std::vector<std::string> partial) {
    OpPlan plan;
    for (auto& e : e_) plan.operands.emplace_back(std::move(e));
    plan.reshards = std::move(reshards_);
    plan.result = PartitionSpec(std::move(result));
    plan.partial_sum_axes = std::move(partial);
    return plan;
  }

 private:
  std::vector<Entries> e_;
  std::vector<Reshard> reshards_;
};

// Bytes of the block each device holds. REQUIRES: `spec` fits `shape`.
int64_t LocalBytes(const std::vector<int64_t>& shape, const PartitionSpec& spec, const Mesh& mesh,
                   int dtype_bytes) {
  int64_t bytes = dtype_bytes;
  for (int64_t d : NamedSharding(mesh, spec).ShardDims(shape)) bytes *= d;
  return bytes;
}

// Devices in one group over `axes`. REQUIRES: every axis is in `mesh`.
int64_t GroupSize(const std::vector<std::string>& axes, const Mesh& mesh) {
  int64_t n = 1;
  for (const auto& a : axes) n *= mesh.axis_size(*mesh.AxisIndex(a));
  return n;
}

absl::Status CheckDims(const char* what, const std::vector<int>& dims, size_t rank,
                       std::vector<bool>* used) {
  for (int d : dims) {
    if (d < 0 || static_cast<size_t>(d) >= rank || (*used)[d]) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " dim ", d, " is out of range or repeated (operand rank ", rank, ")"));
    }
    (*used)[d] = true;
  }
  return absl::OkStatus();
}

}  // namespace

std::string ReshardToString(const Reshard& r) {
  return absl::StrCat(r.kind == Reshard::kSlice ? "slice" : "all_gather", " ",
                      r.operand == 0 ? "lhs" : "rhs", " dim ", r.dim, " over (",
                      absl::StrJoin(r.axes, ", "), ")");
}

absl::StatusOr<OpPlan> PlanDotGeneral(const std::vector<int64_t>& lhs_shape,
                                      const PartitionSpec& lhs,
                                      const std::vector<int64_t>& rhs_shape,
                                      const PartitionSpec& rhs, const DotDimensionNumbers& dn,
                                      const Mesh& mesh) {
  if (absl::Status s = CheckFits("dot_general lhs", lhs_shape, lhs, mesh); !s.ok()) return s;
  if (absl::Status s = CheckFits("dot_general rhs", rhs_shape, rhs, mesh); !s.ok()) return s;
  if (dn.lhs_contracting.size() != dn.rhs_contracting.size() ||
      dn.lhs_batch.size() != dn.rhs_batch.size()) {
    return absl::InvalidArgumentError(absl::StrCat("dot_general: ", dn.lhs_contracting.size(),
                                                   " lhs vs ", dn.rhs_contracting.size(),
                                                   " rhs contracting dims, ", dn.lhs_batch.size(),
                                                   " vs ", dn.rhs_batch.size(), " batch dims"));
  }
  std::vector<bool> lhs_used(lhs_shape.size()), rhs_used(rhs_shape.size());
  for (absl::Status s :
       {CheckDims("lhs contracting", dn.lhs_contracting, lhs_shape.size(), &lhs_used),
        CheckDims("lhs batch", dn.lhs_batch, lhs_shape.size(), &lhs_used),
        CheckDims("rhs contracting", dn.rhs_contracting, rhs_shape.size(), &rhs_used),
        CheckDims("rhs batch", dn.rhs_batch, rhs_shape.size(), &rhs_used)}) {
    if (!s.ok()) return s;
  }
  auto check_pairs = [&](const char* what, const std::vector<int>& l,
                         const std::vector<int>& r) -> absl::Status {
    for (size_t i = 0; i < l.size(); ++i) {
      if (lhs_shape[l[i]] != rhs_shape[r[i]]) {
        return absl::InvalidArgumentError(
            absl::StrCat("dot_general ", what, " dims lhs ", l[i], " (size ", lhs_shape[l[i]],
                         ") and rhs ", r[i], " (size ", rhs_shape[r[i]], ") differ in size"));
      }
    }
    return absl::OkStatus();
  };
  if (absl::Status s = check_pairs("contracting", dn.lhs_contracting, dn.rhs_contracting); !s.ok())
    return s;
  if (absl::Status s = check_pairs("batch", dn.lhs_batch, dn.rhs_batch); !s.ok()) return s;

  Layouts layouts({lhs.Padded(lhs_shape.size()), rhs.Padded(rhs_shape.size())});
  std::vector<std::string> partial;
  for (size_t i = 0; i < dn.lhs_contracting.size(); ++i) {
    for (const auto& a : layouts.Align(dn.lhs_contracting[i], dn.rhs_contracting[i]))
      partial.push_back(a);
  }
  Entries result;
  for (size_t i = 0; i < dn.lhs_batch.size(); ++i)
    result.push_back(layouts.Align(dn.lhs_batch[i], dn.rhs_batch[i]));
  for (size_t d = 0; d < lhs_shape.size(); ++d) {
    if (!lhs_used[d]) result.push_back(layouts[0][d]);
  }
  for (size_t d = 0; d < rhs_shape.size(); ++d) {
    if (rhs_used[d]) continue;
    if (!layouts[1][d].empty() && UsesAny(result, layouts[1][d]))
      layouts.Gather(1, static_cast<int>(d));
    result.push_back(layouts[1][d]);
  }
  return layouts.Finish(std::move(result), std::move(partial));
}

absl::StatusOr<OpPlan> PlanElementwise(const std::vector<int64_t>& shape, const PartitionSpec& lhs,
                                       const PartitionSpec& rhs, const Mesh& mesh) {
  if (absl::Status s = CheckFits("element-wise lhs", shape, lhs, mesh); !s.ok()) return s;
  if (absl::Status s = CheckFits("element-wise rhs", shape, rhs, mesh); !s.ok()) return s;
  Layouts layouts({lhs.Padded(shape.size()), rhs.Padded(shape.size())});
  // Gather every rhs dim laid out differently first, so no slice meets an axis still in use.
  for (size_t d = 0; d < shape.size(); ++d) {
    if (layouts[0][d] != layouts[1][d] && !layouts[1][d].empty())
      layouts.Gather(1, static_cast<int>(d));
  }
  for (size_t d = 0; d < shape.size(); ++d) {
    if (layouts[0][d] != layouts[1][d]) layouts.Slice(1, static_cast<int>(d), layouts[0][d]);
  }
  Entries result = layouts[0];
  return layouts.Finish(std::move(result), {});
}

absl::StatusOr<OpPlan> PlanReduce(const std::vector<int64_t>& shape, const PartitionSpec& operand,
                                  const std::vector<int>& dims, const Mesh& mesh) {
  if (absl::Status s = CheckFits("reduce operand", shape, operand, mesh); !s.ok()) return s;
  std::vector<bool> reduced(shape.size());
  if (absl::Status s = CheckDims("reduce", dims, shape.size(), &reduced); !s.ok()) return s;
  Layouts layouts({operand.Padded(shape.size())});
  Entries result;
  std::vector<std::string> partial;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (reduced[d]) {
      for (const auto& a : layouts[0][d]) partial.push_back(a);
    } else {
      result.push_back(layouts[0][d]);
    }
  }
  return layouts.Finish(std::move(result), std::move(partial));
}

std::string ReductionToString(const Reduction& r) {
  if (r.kind == Reduction::kPsum)
    return absl::StrCat("psum over (", absl::StrJoin(r.axes, ", "), ")");
  return absl::StrCat("psum_scatter over (", absl::StrJoin(r.axes, ", "), ") along dim ", r.dim);
}

absl::StatusOr<PartialSumPlan> PlanPartialSum(const std::vector<int64_t>& shape,
                                              const PartitionSpec& spec,
                                              const std::vector<std::string>& partial_axes,
                                              const PartitionSpec& target, const Mesh& mesh) {
  if (absl::Status s = CheckFits("partial-sum result", shape, spec, mesh); !s.ok()) return s;
  if (absl::Status s = CheckFits("target", shape, target, mesh); !s.ok()) return s;
  Entries cur = spec.Padded(shape.size());
  const Entries want = target.Padded(shape.size());
  std::vector<std::string> left = partial_axes;
  for (const std::string& a : left) {
    if (!mesh.AxisIndex(a).ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("partial-sum axis '", a, "' is not an axis of ", mesh.ToString()));
    }
    if (UsesAny(cur, {a})) {
      return absl::InvalidArgumentError(
          absl::StrCat("partial-sum axis '", a, "' also shards a dim of ", spec.ToString()));
    }
  }
  PartialSumPlan plan;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (!cur[d].empty() || want[d].empty()) continue;
    const bool all_partial = std::all_of(want[d].begin(), want[d].end(), [&](const std::string& a) {
      return std::find(left.begin(), left.end(), a) != left.end();
    });
    if (!all_partial) continue;
    plan.reductions.push_back({Reduction::kPsumScatter, want[d], static_cast<int>(d)});
    cur[d] = want[d];
    for (const auto& a : want[d]) left.erase(std::find(left.begin(), left.end(), a));
  }
  if (!left.empty()) plan.reductions.push_back({Reduction::kPsum, left, -1});
  absl::StatusOr<OpPlan> rest = PlanElementwise(shape, target, PartitionSpec(cur), mesh);
  if (!rest.ok()) return rest.status();
  for (Reshard r : rest->reshards) {
    r.operand = 0;
    plan.reshards.push_back(std::move(r));
  }
  return plan;
}

int64_t ReductionBytesPerDevice(const Reduction& r, const std::vector<int64_t>& shape,
                                const PartitionSpec& spec, const Mesh& mesh, int dtype_bytes) {
  const int64_t n = GroupSize(r.axes, mesh);
  // The ring moves one 1/n chunk per step: 2(n-1) steps for psum, n-1 for psum_scatter.
  const int64_t total =
      (r.kind == Reduction::kPsum ? 2 : 1) * (n - 1) * LocalBytes(shape, spec, mesh, dtype_bytes);
  return (total + n - 1) / n;
}

int64_t ReshardBytesPerDevice(const Reshard& r, const std::vector<int64_t>& shape,
                              const PartitionSpec& spec, const Mesh& mesh, int dtype_bytes) {
  if (r.kind == Reshard::kSlice) return 0;
  return (GroupSize(r.axes, mesh) - 1) * LocalBytes(shape, spec, mesh, dtype_bytes);
}

}  // namespace spmd
}  // namespace meshrun
