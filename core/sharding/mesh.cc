#include "core/sharding/mesh.h"

#include <algorithm>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace meshrun {

absl::StatusOr<Mesh> Mesh::Create(std::vector<std::pair<std::string, int>> axes) {
  std::set<std::string> seen;
  int64_t devices = 1;
  for (const auto& [name, size] : axes) {
    if (name.empty()) return absl::InvalidArgumentError("mesh axis name is empty");
    if (!seen.insert(name).second) {
      return absl::InvalidArgumentError(absl::StrCat("mesh axis '", name, "' appears twice"));
    }
    if (size < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("mesh axis '", name, "' has size ", size, "; expected >= 1"));
    }
    devices = std::min<int64_t>(devices * size, int64_t{kMaxDevices} + 1);  // no overflow
  }
  if (devices > kMaxDevices) {
    std::vector<std::string> parts;
    for (const auto& [name, size] : axes) parts.push_back(absl::StrCat(name, "=", size));
    return absl::InvalidArgumentError(absl::StrCat("mesh ", absl::StrJoin(parts, ","),
                                                   " has more than ", kMaxDevices,
                                                   " devices (one worker process each)"));
  }
  Mesh mesh;
  mesh.axes_ = std::move(axes);
  return mesh;
}

absl::StatusOr<Mesh> Mesh::Parse(absl::string_view text) {
  std::vector<std::pair<std::string, int>> axes;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    std::vector<std::string> kv = absl::StrSplit(part, '=');
    int size = 0;
    if (kv.size() != 2 || !absl::SimpleAtoi(kv[1], &size)) {
      return absl::InvalidArgumentError(absl::StrCat("bad mesh axis '", part, "' in '", text,
                                                     "'; expected NAME=SIZE, e.g. data=2,model=4"));
    }
    axes.emplace_back(std::string(absl::StripAsciiWhitespace(kv[0])), size);
  }
  if (axes.empty()) return absl::InvalidArgumentError(absl::StrCat("empty mesh '", text, "'"));
  return Create(std::move(axes));
}

absl::StatusOr<Mesh> Mesh::FromProto(const v1::Mesh& proto) {
  std::vector<std::pair<std::string, int>> axes;
  for (const auto& a : proto.axes()) axes.emplace_back(a.name(), a.size());
  return Create(std::move(axes));
}

v1::Mesh Mesh::ToProto() const {
  v1::Mesh proto;
  for (const auto& [name, size] : axes_) {
    auto* a = proto.add_axes();
    a->set_name(name);
    a->set_size(size);
  }
  return proto;
}

absl::StatusOr<int> Mesh::AxisIndex(absl::string_view name) const {
  for (int i = 0; i < num_axes(); ++i) {
    if (axes_[i].first == name) return i;
  }
  return absl::NotFoundError(absl::StrCat("mesh axis '", name, "' is not in ", ToString()));
}

int Mesh::size() const {
  int n = 1;
  for (const auto& a : axes_) n *= a.second;
  return n;
}

std::vector<int> Mesh::Coords(int rank) const {
  std::vector<int> coords(axes_.size());
  for (int i = num_axes() - 1; i >= 0; --i) {
    coords[i] = rank % axes_[i].second;
    rank /= axes_[i].second;
  }
  return coords;
}

int Mesh::RankOf(const std::vector<int>& coords) const {
  int rank = 0;
  for (int i = 0; i < num_axes(); ++i) rank = rank * axes_[i].second + coords[i];
  return rank;
}

std::vector<int> Mesh::AxisGroup(int rank, int axis) const {
  std::vector<int> coords = Coords(rank);
  std::vector<int> group;
  for (int i = 0; i < axes_[axis].second; ++i) {
    coords[axis] = i;
    group.push_back(RankOf(coords));
  }
  return group;
}

std::vector<int> Mesh::AxesGroup(int rank, const std::vector<int>& axes) const {
  std::vector<int> coords = Coords(rank);
  int total = 1;
  for (int a : axes) total *= axes_[a].second;
  std::vector<int> group;
  for (int k = 0; k < total; ++k) {
    int rest = k;
    for (int i = static_cast<int>(axes.size()) - 1; i >= 0; --i) {
      coords[axes[i]] = rest % axes_[axes[i]].second;
      rest /= axes_[axes[i]].second;
    }
    group.push_back(RankOf(coords));
  }
  return group;
}

std::vector<std::vector<int>> Mesh::GroupsOver(const std::vector<int>& axes) const {
  std::vector<std::vector<int>> groups;
  std::vector<bool> placed(size(), false);
  for (int r = 0; r < size(); ++r) {
    if (placed[r]) continue;
    groups.push_back(AxesGroup(r, axes));
    for (int m : groups.back()) placed[m] = true;
  }
  return groups;
}

std::vector<std::vector<int>> Mesh::AxisSubsets() const {
  std::vector<std::vector<int>> out;
  for (int mask = 1; mask < (1 << num_axes()); ++mask) {
    std::vector<int> subset;
    for (int a = 0; a < num_axes(); ++a) {
      if (mask & (1 << a)) subset.push_back(a);
    }
    out.push_back(subset);
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const auto& a, const auto& b) { return a.size() < b.size(); });
  return out;
}

absl::StatusOr<std::vector<int>> Mesh::AxisIndices(const std::vector<std::string>& names) const {
  std::vector<int> out;
  for (const auto& n : names) {
    absl::StatusOr<int> i = AxisIndex(n);
    if (!i.ok()) return i.status();
    for (int seen : out) {
      if (seen == *i)
        return absl::InvalidArgumentError(absl::StrCat("mesh axis '", n, "' is named twice"));
    }
    out.push_back(*i);
  }
  return out;
}

std::string Mesh::ToString() const {
  std::vector<std::string> parts;
  for (const auto& [name, size] : axes_) parts.push_back(absl::StrCat("'", name, "': ", size));
  return absl::StrCat("Mesh(", absl::StrJoin(parts, ", "), ")");
}

}  // namespace meshrun
