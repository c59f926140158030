// The SDK's shard_map program builder (ShardMapBuilder). It lives in core/spmd/shard_map.h: the
// coordinator builds the same per-shard programs when it partitions a global program.
#ifndef MESHRUN_CLIENT_INCLUDE_MESHRUN_SHARD_MAP_H_
#define MESHRUN_CLIENT_INCLUDE_MESHRUN_SHARD_MAP_H_

#include "core/spmd/shard_map.h"  // IWYU pragma: export

#endif  // MESHRUN_CLIENT_INCLUDE_MESHRUN_SHARD_MAP_H_
