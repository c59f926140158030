#include "core/sharding/logical_axes.h"

#include <algorithm>
#include <numeric>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace meshrun {
namespace {

std::string EntryToString(const PartitionSpec::Entry& e) {
  if (e.empty()) return "None";
  if (e.size() == 1) return absl::StrCat("'", e[0], "'");
  return absl::StrCat("(",
                      absl::StrJoin(e, ", ",
                                    [](std::string* out, const std::string& a) {
                                      absl::StrAppend(out, "'", a, "'");
                                    }),
                      ")");
}

}  // namespace

absl::StatusOr<LogicalAxisRules> ParseLogicalAxisRules(absl::string_view text) {
  LogicalAxisRules rules;
  if (absl::StripAsciiWhitespace(text).empty()) return rules;
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    item = absl::StripAsciiWhitespace(item);
    std::vector<absl::string_view> kv = absl::StrSplit(item, absl::MaxSplits('=', 1));
    if (kv.size() != 2 || absl::StripAsciiWhitespace(kv[0]).empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("logical axis rule '", item,
                       "' is not LOGICAL=MESH_AXIS, LOGICAL=AXIS1+AXIS2 or LOGICAL= (None)"));
    }
    LogicalAxisRule rule{std::string(absl::StripAsciiWhitespace(kv[0])), {}};
    absl::string_view mesh = absl::StripAsciiWhitespace(kv[1]);
    if (!mesh.empty()) {
      for (absl::string_view a : absl::StrSplit(mesh, '+')) {
        a = absl::StripAsciiWhitespace(a);
        if (a.empty()) {
          return absl::InvalidArgumentError(
              absl::StrCat("logical axis rule '", item, "' has an empty mesh axis"));
        }
        rule.mesh_axes.emplace_back(a);
      }
    }
    rules.push_back(std::move(rule));
  }
  return rules;
}

std::string LogicalAxisRulesToString(const LogicalAxisRules& rules) {
  return absl::StrCat("(",
                      absl::StrJoin(rules, ", ",
                                    [](std::string* out, const LogicalAxisRule& r) {
                                      absl::StrAppend(out, "('", r.logical, "', ",
                                                      EntryToString(r.mesh_axes), ")");
                                    }),
                      ")");
}

absl::Status ValidateLogicalAxisRules(const LogicalAxisRules& rules, const Mesh& mesh) {
  for (const LogicalAxisRule& r : rules) {
    for (const std::string& a : r.mesh_axes) {
      if (!mesh.AxisIndex(a).ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("logical axis rule ('", r.logical, "', ", EntryToString(r.mesh_axes),
                         ") names mesh axis '", a, "', which is not in ", mesh.ToString()));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<PartitionSpec> LogicalToMesh(const std::vector<std::string>& logical_names,
                                            const LogicalAxisRules& rules) {
  std::set<std::string> seen;
  for (const std::string& n : logical_names) {
    if (!n.empty() && !seen.insert(n).second) {
      return absl::InvalidArgumentError(absl::StrCat("logical axis '", n,
                                                     "' occurs more than once in (",
                                                     absl::StrJoin(logical_names, ", "), ")"));
    }
  }
  std::vector<PartitionSpec::Entry> entries(logical_names.size());
  std::vector<bool> assigned(logical_names.size(), false);
  std::set<std::string> used;  // mesh axes already in the spec
  for (const LogicalAxisRule& rule : rules) {
    auto it = std::find(logical_names.begin(), logical_names.end(), rule.logical);
    if (it == logical_names.end()) continue;
    const size_t dim = static_cast<size_t>(it - logical_names.begin());
    if (assigned[dim]) continue;
    const bool free = std::none_of(rule.mesh_axes.begin(), rule.mesh_axes.end(),
                                   [&](const std::string& a) { return used.count(a) > 0; });
    if (!free) continue;
    assigned[dim] = true;
    entries[dim] = rule.mesh_axes;
    used.insert(rule.mesh_axes.begin(), rule.mesh_axes.end());
  }
  return PartitionSpec(std::move(entries));
}

absl::StatusOr<FsdpLayout> FsdpShard(const std::vector<int64_t>& shape, const PartitionSpec& spec,
                                     const Mesh& mesh, absl::string_view axis,
                                     int64_t min_weight_size) {
  absl::StatusOr<int> axis_index = mesh.AxisIndex(axis);
  if (!axis_index.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("FSDP axis '", axis, "' is not an axis of ", mesh.ToString()));
  }
  const int64_t axis_size = mesh.axis_size(*axis_index);
  FsdpLayout out{spec, -1, ""};
  for (const PartitionSpec::Entry& e : spec.entries()) {
    if (std::find(e.begin(), e.end(), axis) != e.end()) {
      out.reason = absl::StrCat("already sharded over '", axis, "'");
      return out;
    }
  }
  const int64_t size = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
  if (size <= min_weight_size) {
    out.reason =
        absl::StrCat("too small to shard: size ", size, " <= min_weight_size ", min_weight_size);
    return out;
  }
  // numpy: argsort(shape)[::-1]; argsort is stable for these sizes, so equal dims come out in
  // ascending order and the reversal puts the later one first.
  std::vector<int> order(shape.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return shape[a] < shape[b]; });
  std::reverse(order.begin(), order.end());
  for (int d : order) {
    if (shape[d] % axis_size == 0 && spec.entry(d).empty()) {
      std::vector<PartitionSpec::Entry> entries = spec.Padded(shape.size());
      entries[d] = {std::string(axis)};
      out.spec = PartitionSpec(std::move(entries));
      out.dim = d;
      return out;
    }
  }
  out.reason = absl::StrCat("no unsharded dim of (", absl::StrJoin(shape, ", "),
                            ") is divisible by the '", axis, "' axis size ", axis_size);
  return out;
}

}  // namespace meshrun
