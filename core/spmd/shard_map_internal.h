// Helpers shared by the ShardMapBuilder sources (internal to client/).
#ifndef MESHRUN_CORE_SPMD_SHARD_MAP_INTERNAL_H_
#define MESHRUN_CORE_SPMD_SHARD_MAP_INTERNAL_H_

#include <string>
#include <vector>

#include "meshrun/v1/program.pb.h"

namespace meshrun::shard_map_internal {

inline v1::Op MakeOp(v1::OpKind kind, const std::vector<std::string>& inputs) {
  v1::Op op;
  op.set_kind(kind);
  for (const auto& i : inputs) op.add_inputs(i);
  return op;
}

inline void SetAxes(v1::Op& op, const std::vector<std::string>& axes) {
  for (const auto& a : axes) op.add_axis_names(a);
}

}  // namespace meshrun::shard_map_internal

#endif  // MESHRUN_CORE_SPMD_SHARD_MAP_INTERNAL_H_
