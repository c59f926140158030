// A group of ranks that run collectives together (the ranks of one mesh axis, or the whole mesh).
#ifndef MESHRUN_CORE_COLLECTIVES_COMMUNICATOR_H_
#define MESHRUN_CORE_COLLECTIVES_COMMUNICATOR_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "core/collectives/transport.h"
#include "core/tensor.h"

namespace meshrun {

// psum, pmean, pmax.
enum class ReduceOp { kSum, kMean, kMax };

struct CollectiveOptions {
  // Every collective must finish within this time, or it fails with DeadlineExceeded naming the
  // rank it was waiting for.
  absl::Duration timeout = absl::Seconds(30);
  // Messages are at most this large; a ring step is pipelined chunk by chunk.
  size_t chunk_bytes = 512 * 1024;
  // All-reduces of at most this many bytes (and at most chunk_bytes) use recursive doubling
  // (log2(P) latency-bound steps, 2 more when P is not a power of two) instead of the ring
  // (ring_all_reduce.h); 0: always the ring.
  size_t small_message_bytes = 256 * 1024;
  // All-reduces of at most this many bytes (and at most chunk_bytes) are one-shot
  // (ring_all_reduce.h: one latency, P-1 sends); 0: never.
  size_t one_shot_max_bytes = 0;
  // All-reduces, reduce-scatters and all-gathers of at least this many bytes (the whole buffer:
  // the reduce-scatter's input, the all-gather's output) among ranks that reach each other's
  // memory (Transport::peer_memory) are single-copy (direct_collectives.h) when every member's
  // buffer is shareable; 0: never.
  size_t direct_min_bytes = 256 * 1024;
  // A program's psums and pmeans of fewer bytes than this over the same axes, and Adam updates'
  // gradient reductions of fewer bytes (that are not single-copy), run as one all-reduce of them
  // side by side (worker/combine_reductions.h); 0: each on its own.
  size_t combine_max_bytes = 256 * 1024;
  // A receive over shared memory polls the ring this long before it sleeps (Mailbox's `spin`);
  // zero: it sleeps at once. Set once per worker (its Mailbox), not per collective.
  absl::Duration receive_spin = absl::Microseconds(50);
};

// The ranks of `group` (global ranks, in axis-index order) that include transport->rank().
// Every member must call the same collectives in the same order. Not thread-safe: one collective
// at a time per Communicator. Does not own the transport, which must outlive it.
class Communicator {
 public:
  // REQUIRES: `group` contains transport->rank() exactly once.
  Communicator(Transport* transport, std::vector<int> group, CollectiveOptions options = {});

  int size() const { return static_cast<int>(group_.size()); }
  // This rank's position in the group: jax.lax.axis_index over the group's axis.
  int index() const { return index_; }
  const std::vector<int>& group() const { return group_; }
  const CollectiveOptions& options() const { return options_; }

  // In-place all-reduce of `count` elements of `dtype` (f32, bf16, i32) at `data`, as
  // jax.lax.psum / pmean over the group's axis. Ring algorithm, or recursive doubling for small
  // messages (ring_all_reduce.h); single-copy through peers' memory for
  // large ones among co-located ranks (direct_collectives.h).
  // Errors: those of Transport (naming the rank that failed or timed out); InvalidArgument for an
  // unsupported dtype or pmean over integers.
  absl::Status AllReduce(void* data, int64_t count, DType dtype, ReduceOp op);

  // Each member contributes `count` elements at `in`; `out` receives size() * count elements,
  // block i from group position i (jax.lax.all_gather, tiled, over flat blocks). Ring algorithm
  // (ring_all_gather.h), or single-copy among co-located ranks, as AllReduce.
  absl::Status AllGather(const void* in, int64_t count, DType dtype, void* out);

  // `in` holds size() blocks of `count` elements; `out` receives the reduction of block index()
  // over the group (jax.lax.psum_scatter, tiled, over flat blocks; pmean / pmax likewise). Ring
  // algorithm, or single-copy among co-located ranks, as AllReduce.
  absl::Status ReduceScatter(const void* in, int64_t count, DType dtype, ReduceOp op, void* out);

  // jax.lax.ppermute over group positions; see permute.h. Errors: InvalidArgument naming a pair
  // that makes `perm` not a permutation of [0, size()).
  absl::Status Permute(const void* in, int64_t count, DType dtype,
                       const std::vector<std::pair<int, int>>& perm, void* out);

  // jax.lax.all_to_all over flat blocks: `in` and `out` hold size() blocks of `count` elements.
  absl::Status AllToAll(const void* in, int64_t count, DType dtype, void* out);

  // The tag base for the next collective (each collective reserves 2^32 tags): its sequence
  // number within the transport's collective epoch (Transport::Reset), which restarts at 1 in a
  // new epoch, so every member numbers the collectives after an abort alike, whichever of them
  // the aborted run had reached.
  uint64_t NextTagBase();
  // True if the transport reaches the memory of every other member (direct collectives may run).
  bool ReachesAllMembers() const;
  Transport* transport() { return transport_; }

 private:
  // True if a collective over a buffer of `bytes` should try the direct path.
  bool UseDirect(int64_t bytes) const;

  Transport* transport_;
  std::vector<int> group_;
  int index_ = -1;
  CollectiveOptions options_;
  uint64_t epoch_ = 0;     // the transport's epoch when sequence_ was last numbered
  uint64_t sequence_ = 0;  // collectives in epoch_
};

}  // namespace meshrun

#endif  // MESHRUN_CORE_COLLECTIVES_COMMUNICATOR_H_
