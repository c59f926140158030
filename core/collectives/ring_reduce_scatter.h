// Ring reduce-scatter: the input is P blocks; rank at position p ends with the reduction over
// the group of block p (jax.lax.psum_scatter with tiled=True over flat blocks).
//
// Blocks are `count` elements, chunked as in the all-reduce. Step t = 0 .. P-2: send block
// (p - 1 - t), receive block (p - 2 - t) into `out` (straight from the transport, see
// Transport::RecvInto) and add this rank's block (p - 2 - t) to it there; the block received at
// step t is sent on from `out` at step t+1, chunk by chunk. The input is only read. After step
// P-2, `out` holds block p fully reduced; pmean divides it by P. Each rank sends (P-1)/P of the input: busbw factor
// (n-1)/n.
#ifndef MESHRUN_CORE_COLLECTIVES_RING_REDUCE_SCATTER_H_
#define MESHRUN_CORE_COLLECTIVES_RING_REDUCE_SCATTER_H_

#include "core/collectives/communicator.h"

namespace meshrun {

// `in`: size() * count elements (block i for group position i); `out`: count elements.
// REQUIRES: `out` does not overlap `in` (it is written at every step).
absl::Status RingReduceScatter(Communicator& comm, const void* in, int64_t count, DType dtype, ReduceOp op,
                               void* out);

}  // namespace meshrun

#endif  // MESHRUN_CORE_COLLECTIVES_RING_REDUCE_SCATTER_H_
