// NamedSharding: a PartitionSpec bound to a Mesh. Mirrors jax.sharding.NamedSharding.
#ifndef MESHRUN_CORE_SHARDING_NAMED_SHARDING_H_
#define MESHRUN_CORE_SHARDING_NAMED_SHARDING_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/sharding/mesh.h"
#include "core/sharding/partition_spec.h"
#include "core/tensor.h"

namespace meshrun {

// Immutable value type. A dim sharded over axes (a, b) is split into size(a) * size(b) equal blocks;
// the block a device holds is given by its coordinates on a (major) and b (minor). Devices whose
// coordinates differ only on axes the spec does not name hold the same block (replicas).
class NamedSharding {
 public:
  NamedSharding(Mesh mesh, PartitionSpec spec) : mesh_(std::move(mesh)), spec_(std::move(spec)) {}

  const Mesh& mesh() const { return mesh_; }
  const PartitionSpec& spec() const { return spec_; }

  // OK if the spec fits `global_dims` on this mesh. Errors (InvalidArgument), each naming the value:
  // more entries than dims, an axis not in the mesh, an axis used twice, a dim not divisible by
  // the product of its axes' sizes.
  absl::Status Validate(const Dims& global_dims) const;
  // Shape of the block each device holds. REQUIRES: Validate(global_dims).ok().
  Dims ShardDims(const Dims& global_dims) const;
  // Start index of `rank`'s block along every dim. REQUIRES: Validate(global_dims).ok().
  std::vector<int64_t> ShardOffsets(const Dims& global_dims, int rank) const;

  v1::NamedSharding ToProto() const;
  static absl::StatusOr<NamedSharding> FromProto(const v1::NamedSharding& proto);
  // "NamedSharding(mesh=Mesh('data': 8), spec=PartitionSpec('data',))"
  std::string ToString() const;
  bool operator==(const NamedSharding& o) const { return mesh_ == o.mesh_ && spec_ == o.spec_; }

 private:
  // Number of blocks dim `dim` is split into.
  int64_t NumBlocks(int dim) const;

  Mesh mesh_;
  PartitionSpec spec_;
};

}  // namespace meshrun

#endif  // MESHRUN_CORE_SHARDING_NAMED_SHARDING_H_
