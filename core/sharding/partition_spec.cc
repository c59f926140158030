#include "core/sharding/partition_spec.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace meshrun {

PartitionSpec PartitionSpec::Of(std::vector<std::string> names) {
  std::vector<Entry> entries;
  for (auto& n : names) entries.push_back(n.empty() ? Entry{} : Entry{n});
  return PartitionSpec(std::move(entries));
}

PartitionSpec::Entry PartitionSpec::entry(int dim) const {
  return dim < static_cast<int>(entries_.size()) ? entries_[dim] : Entry{};
}

std::vector<PartitionSpec::Entry> PartitionSpec::Padded(size_t rank) const {
  std::vector<Entry> out(rank);
  for (size_t d = 0; d < rank; ++d) out[d] = entry(static_cast<int>(d));
  return out;
}

PartitionSpec PartitionSpec::FromProto(const v1::PartitionSpec& proto) {
  std::vector<Entry> entries;
  for (const auto& e : proto.entries()) entries.emplace_back(e.axis_names().begin(), e.axis_names().end());
  return PartitionSpec(std::move(entries));
}

v1::PartitionSpec PartitionSpec::ToProto() const {
  v1::PartitionSpec proto;
  for (const auto& e : entries_) {
    auto* pe = proto.add_entries();
    for (const auto& n : e) pe->add_axis_names(n);
  }
  return proto;
}

std::string PartitionSpec::ToString() const {
  std::vector<std::string> parts;
  for (const auto& e : entries_) {
    if (e.empty()) {
      parts.push_back("None");
    } else if (e.size() == 1) {
      parts.push_back(absl::StrCat("'", e[0], "'"));
    } else {
      parts.push_back(absl::StrCat("(", absl::StrJoin(e, ", ", [](std::string* out, const std::string& s) {
                                     absl::StrAppend(out, "'", s, "'");
                                   }),
                                   ")"));
    }
  }
  return absl::StrCat("PartitionSpec(", absl::StrJoin(parts, ", "), ")");
}

bool PartitionSpec::operator==(const PartitionSpec& o) const {
  size_t n = std::max(entries_.size(), o.entries_.size());
  for (size_t i = 0; i < n; ++i) {
    if (entry(i) != o.entry(i)) return false;
  }
  return true;
}

}  // namespace meshrun
