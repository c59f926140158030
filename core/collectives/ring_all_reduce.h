// All-reduce algorithms. Ring all-reduce: reduce-scatter then all-gather, chunked and pipelined.
//
// The buffer of `count` elements is cut into P = group size segments (sizes differ by at most one
// element; a segment may be empty when count < P), and each segment into chunks of at most
// chunk_bytes. Rank at ring position p sends to p+1 and receives from p-1 (mod P).
//
//   Reduce-scatter, steps t = 0 .. P-2: send segment (p - t), receive segment (p - t - 1) and add
//   it into the local copy. After step P-2, position p holds the full reduction of segment (p + 1);
//   for pmean that segment is divided by P right away.
//   All-gather, steps u = 0 .. P-2: send segment (p + 1 - u), receive segment (p - u) and copy it.
//
// The 2(P-1) steps run as one pipeline: the segment received at step t is the one sent at step
// t+1, so each chunk is forwarded as soon as it is reduced (or copied), while later chunks of the
// same step are still in flight. Sends are buffered by the transport, so no step waits for the
// neighbour to post a receive. Each rank sends 2(P-1)/P of the buffer in total, the bandwidth-
// optimal amount (nccl-tests' busbw factor).
#ifndef MESHRUN_CORE_COLLECTIVES_RING_ALL_REDUCE_H_
#define MESHRUN_CORE_COLLECTIVES_RING_ALL_REDUCE_H_

#include "core/collectives/communicator.h"

namespace meshrun {

absl::Status RingAllReduce(Communicator& comm, void* data, int64_t count, DType dtype, ReduceOp op);

// Recursive doubling (butterfly) all-reduce, the latency-bound algorithm MPICH and NCCL use for
// small messages: for a group of P = 2^k ranks, k steps; at step s position p exchanges its whole
// partial result with position p XOR 2^s and both add the two. log2(P) message latencies instead
// of the ring's 2(P-1), at log2(P) times the buffer sent instead of 2(P-1)/P. Both partners add
// the same two operands, so every rank ends with the same bits.
// Any other P = 2^k + r (0 < r < 2^k) runs as MPICH's MPIR_Allreduce_intra_recursive_doubling:
// positions 2i and 2i+1 for i < r fold first (2i sends its value to 2i+1, which adds it), the
// 2^k odd-or-remaining positions run the butterfly, and each 2i+1 hands the result back to 2i:
// floor(log2(P)) + 2 latencies.
absl::Status RecursiveDoublingAllReduce(Communicator& comm, void* data, int64_t count, DType dtype,
                                        ReduceOp op);

// One-shot all-reduce, for tiny messages (as NCCL's and oneCCL's one-shot / "direct" algorithms):
// every position sends its whole buffer to every other and reduces all P buffers itself, in
// position order, so every rank ends with the same bits. One message latency, at the price of
// P-1 sends and P-1 times the buffer received per rank.
absl::Status OneShotAllReduce(Communicator& comm, void* data, int64_t count, DType dtype,
                              ReduceOp op);

}  // namespace meshrun

#endif  // MESHRUN_CORE_COLLECTIVES_RING_ALL_REDUCE_H_
