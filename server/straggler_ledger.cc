#include "server/straggler_ledger.h"

#include <algorithm>
#include <map>
#include <tuple>
#include <utility>

#include "absl/strings/str_split.h"

namespace meshrun {

std::vector<CollectiveSkew> ArrivalSkews(const Mesh& mesh,
                                         const std::vector<v1::RunShardMapResponse>& responses) {
  struct Seen {
    const v1::CollectiveArrival* first = nullptr;
    int64_t earliest = 0, latest = 0;
    int late_rank = -1, count = 0;
  };
  // (run, collective index, the group's lowest rank) -> what its ranks reported.
  std::map<std::tuple<int, int, int>, Seen> groups;
  std::map<std::string, std::vector<int>> axes_of;  // "i,j" -> axis indices ({-1}: unknown)
  for (int r = 0; r < static_cast<int>(responses.size()) && r < mesh.size(); ++r) {
    for (const v1::CollectiveArrival& a : responses[r].arrivals()) {
      auto found = axes_of.find(a.axes());
      if (found == axes_of.end()) {
        std::vector<int> axes;
        for (absl::string_view name : absl::StrSplit(a.axes(), ',', absl::SkipEmpty())) {
          absl::StatusOr<int> axis = mesh.AxisIndex(name);
          axes.push_back(axis.ok() ? *axis : -1);
        }
        found = axes_of.emplace(a.axes(), std::move(axes)).first;
      }
      const std::vector<int>& axes = found->second;
      if (axes.empty() || std::find(axes.begin(), axes.end(), -1) != axes.end()) continue;
      const std::vector<int> group = mesh.AxesGroup(r, axes);
      Seen& s = groups[{a.run(), a.index(), *std::min_element(group.begin(), group.end())}];
      if (s.count++ == 0) {
        s.first = &a;
        s.earliest = s.latest = a.unix_micros();
        s.late_rank = r;
      } else {
        s.earliest = std::min(s.earliest, a.unix_micros());
        if (a.unix_micros() > s.latest) {
          s.latest = a.unix_micros();
          s.late_rank = r;
        }
      }
    }
  }
  std::vector<CollectiveSkew> out;
  for (const auto& [key, s] : groups) {
    if (s.count < 2) continue;
    out.push_back({s.first->op(), s.first->axes(),
                   static_cast<double>(s.latest - s.earliest) * 1e-6, s.late_rank});
  }
  return out;
}

}  // namespace meshrun
