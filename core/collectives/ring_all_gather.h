// Ring all-gather: every rank contributes one block; every rank ends with all blocks in group
// order (jax.lax.all_gather over flat blocks; communicator.h adds the dims).
//
// Blocks are `count` elements, cut into chunks of at most chunk_bytes. Rank at ring position p
// sends to p+1 and receives from p-1. Step t = 0 .. P-2: send block (p - t), receive block
// (p - t - 1) into its place. The block received at step t is the one sent at step t+1, so each
// chunk is forwarded as soon as it lands. Each rank sends (P-1)/P of the output: busbw factor
// (n-1)/n.
#ifndef MESHRUN_CORE_COLLECTIVES_RING_ALL_GATHER_H_
#define MESHRUN_CORE_COLLECTIVES_RING_ALL_GATHER_H_

#include "core/collectives/communicator.h"

namespace meshrun {

// `in`: count elements; `out`: size() * count elements, block i from group position i.
// `in` and `out` must not overlap.
absl::Status RingAllGather(Communicator& comm, const void* in, int64_t count, DType dtype, void* out);

}  // namespace meshrun

#endif  // MESHRUN_CORE_COLLECTIVES_RING_ALL_GATHER_H_
