#include "core/collectives/communicator.h"

#include <algorithm>

#include "core/collectives/permute.h"
#include "core/collectives/ring_all_gather.h"
#include "core/collectives/ring_all_reduce.h"
#include "core/collectives/ring_reduce_scatter.h"

namespace meshrun {

Communicator::Communicator(Transport* transport, std::vector<int> group, CollectiveOptions options)
    : transport_(transport), group_(std::move(group)), options_(options) {
  auto it = std::find(group_.begin(), group_.end(), transport_->rank());
  index_ = it == group_.end() ? -1 : static_cast<int>(it - group_.begin());
}

absl::Status Communicator::AllReduce(void* data, int64_t count, DType dtype, ReduceOp op) {
  // Small messages are latency-bound: the butterfly's log2(P) steps beat the ring's 2(P-1).
  const int n = size();
  const int64_t bytes = count * static_cast<int64_t>(DTypeSize(dtype));
  if (n > 1 && (n & (n - 1)) == 0 && bytes <= static_cast<int64_t>(options_.small_message_bytes) &&
      bytes <= static_cast<int64_t>(options_.chunk_bytes)) {
    return RecursiveDoublingAllReduce(*this, data, count, dtype, op);
  }
  return RingAllReduce(*this, data, count, dtype, op);
}

absl::Status Communicator::AllGather(const void* in, int64_t count, DType dtype, void* out) {
  return RingAllGather(*this, in, count, dtype, out);
}

absl::Status Communicator::ReduceScatter(const void* in, int64_t count, DType dtype, ReduceOp op, void* out) {
  return RingReduceScatter(*this, in, count, dtype, op, out);
}

absl::Status Communicator::Permute(const void* in, int64_t count, DType dtype,
                                   const std::vector<std::pair<int, int>>& perm, void* out) {
  return meshrun::Permute(*this, in, count, dtype, perm, out);
}

absl::Status Communicator::AllToAll(const void* in, int64_t count, DType dtype, void* out) {
  return meshrun::AllToAll(*this, in, count, dtype, out);
}

}  // namespace meshrun
