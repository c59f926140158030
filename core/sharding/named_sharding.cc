#include "core/sharding/named_sharding.h"

#include <set>

#include "absl/strings/str_cat.h"

namespace meshrun {

absl::Status NamedSharding::Validate(const Dims& global_dims) const {
  const auto& entries = spec_.entries();
  if (entries.size() > global_dims.size()) {
    return absl::InvalidArgumentError(absl::StrCat(spec_.ToString(), " has ", entries.size(),
                                                   " entries but shape ", DimsToString(global_dims),
                                                   " has only ", global_dims.size(), " dims"));
  }
  std::set<std::string> used;
  for (size_t d = 0; d < entries.size(); ++d) {
    int64_t blocks = 1;
    for (const auto& axis : entries[d]) {
      absl::StatusOr<int> idx = mesh_.AxisIndex(axis);
      if (!idx.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(spec_.ToString(), " names axis '", axis,
                                                       "' which is not in ", mesh_.ToString()));
      }
      if (!used.insert(axis).second) {
        return absl::InvalidArgumentError(
            absl::StrCat(spec_.ToString(), " uses mesh axis '", axis, "' more than once"));
      }
      blocks *= mesh_.axis_size(*idx);
    }
    if (global_dims[d] % blocks != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          spec_.ToString(), " does not fit shape ", DimsToString(global_dims), ": dim ", d, " (",
          global_dims[d], ") is not divisible by ", blocks, " (the product of its mesh axes)"));
    }
  }
  return absl::OkStatus();
}

int64_t NamedSharding::NumBlocks(int dim) const {
  int64_t blocks = 1;
  for (const auto& axis : spec_.entry(dim)) blocks *= mesh_.axis_size(*mesh_.AxisIndex(axis));
  return blocks;
}

Dims NamedSharding::ShardDims(const Dims& global_dims) const {
  Dims out = global_dims;
  for (size_t d = 0; d < out.size(); ++d) out[d] /= NumBlocks(d);
  return out;
}

std::vector<int64_t> NamedSharding::ShardOffsets(const Dims& global_dims, int rank) const {
  std::vector<int> coords = mesh_.Coords(rank);
  std::vector<int64_t> offsets(global_dims.size(), 0);
  for (size_t d = 0; d < global_dims.size(); ++d) {
    int64_t block = 0;
    for (const auto& axis : spec_.entry(d)) {
      int idx = *mesh_.AxisIndex(axis);
      block = block * mesh_.axis_size(idx) + coords[idx];
    }
    offsets[d] = block * (global_dims[d] / NumBlocks(d));
  }
  return offsets;
}

v1::NamedSharding NamedSharding::ToProto() const {
  v1::NamedSharding proto;
  *proto.mutable_mesh() = mesh_.ToProto();
  *proto.mutable_spec() = spec_.ToProto();
  return proto;
}

absl::StatusOr<NamedSharding> NamedSharding::FromProto(const v1::NamedSharding& proto) {
  absl::StatusOr<Mesh> mesh = Mesh::FromProto(proto.mesh());
  if (!mesh.ok()) return mesh.status();
  return NamedSharding(*std::move(mesh), PartitionSpec::FromProto(proto.spec()));
}

std::string NamedSharding::ToString() const {
  return absl::StrCat("NamedSharding(mesh=", mesh_.ToString(), ", spec=", spec_.ToString(), ")");
}

}  // namespace meshrun
