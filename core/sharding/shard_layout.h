// Moving blocks between a global array and its shards under a NamedSharding (what device_put
// and device_get do with the data), and the sharding grid jax.debug.visualize_array_sharding
// prints.
#ifndef MESHRUN_CORE_SHARDING_SHARD_LAYOUT_H_
#define MESHRUN_CORE_SHARDING_SHARD_LAYOUT_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/sharding/named_sharding.h"
#include "core/tensor.h"

namespace meshrun {

// The block of `global` that `rank` holds. Errors: those of sharding.Validate(global.dims()).
absl::StatusOr<Tensor> ExtractShard(const Tensor& global, const NamedSharding& sharding, int rank);
// As ExtractShard, into `out`: NumElements(sharding.ShardDims(global.dims())) elements of
// global's dtype, row-major (e.g. the data field of a request being serialised).
// REQUIRES: sharding.Validate(global.dims()).ok().
void ExtractShardInto(const Tensor& global, const NamedSharding& sharding, int rank, char* out);

// Writes `shard` (rank's block) into `global`. Errors: InvalidArgument if the shard's shape or
// dtype is not the block's.
absl::Status InsertShard(const Tensor& shard, const NamedSharding& sharding, int rank,
                         Tensor& global);

// For each distinct block, the ranks holding it (ascending). Blocks are listed row-major by block
// coordinates. REQUIRES: sharding.Validate(global_dims).ok().
std::vector<std::vector<int>> BlockHolders(const Dims& global_dims, const NamedSharding& sharding);

// The grid jax.debug.visualize_array_sharding prints, for 1-D and 2-D arrays: one cell per
// block, naming the devices that hold it, e.g. for P(None, 'model') on ('data': 2, 'model': 4):
//   +---------+---------+---------+---------+
//   | CPU 0,4 | CPU 1,5 | CPU 2,6 | CPU 3,7 |
//   +---------+---------+---------+---------+
// Errors: InvalidArgument for other ranks (JAX supports only 1-D and 2-D too), those of Validate.
absl::StatusOr<std::string> VisualizeSharding(const Dims& global_dims,
                                              const NamedSharding& sharding);

}  // namespace meshrun

#endif  // MESHRUN_CORE_SHARDING_SHARD_LAYOUT_H_
