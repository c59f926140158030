#include "core/collectives/communicator.h"

#include <algorithm>

#include "core/collectives/direct_collectives.h"
#include "core/collectives/permute.h"
#include "core/collectives/ring_all_gather.h"
#include "core/collectives/ring_all_reduce.h"
#include "core/collectives/ring_reduce_scatter.h"

namespace meshrun {

uint64_t Communicator::NextTagBase() {
  const uint64_t epoch = transport_->epoch();
  if (epoch != epoch_) {
    epoch_ = epoch;
    sequence_ = 0;
  }
  return (++sequence_) << 32;
}

Communicator::Communicator(Transport* transport, std::vector<int> group, CollectiveOptions options)
    : transport_(transport), group_(std::move(group)), options_(options) {
  auto it = std::find(group_.begin(), group_.end(), transport_->rank());
  index_ = it == group_.end() ? -1 : static_cast<int>(it - group_.begin());
}

absl::Status Communicator::AllReduce(void* data, int64_t count, DType dtype, ReduceOp op) {
  // Small messages are latency-bound: the butterfly's log2(P) (+ 2 when P is not a power of two)
  // steps beat the ring's 2(P-1).
  const int n = size();
  const int64_t bytes = count * static_cast<int64_t>(DTypeSize(dtype));
  if (n > 1 && bytes <= static_cast<int64_t>(options_.one_shot_max_bytes) &&
      bytes <= static_cast<int64_t>(options_.chunk_bytes)) {
    return OneShotAllReduce(*this, data, count, dtype, op);
  }
  if (n > 1 && bytes <= static_cast<int64_t>(options_.small_message_bytes) &&
      bytes <= static_cast<int64_t>(options_.chunk_bytes)) {
    return RecursiveDoublingAllReduce(*this, data, count, dtype, op);
  }
  if (UseDirect(bytes)) {
    absl::StatusOr<DirectResult> direct = DirectAllReduce(*this, data, count, dtype, op);
    if (!direct.ok() || *direct == DirectResult::kDone) return direct.status();
  }
  return RingAllReduce(*this, data, count, dtype, op);
}

bool Communicator::UseDirect(int64_t bytes) const {
  return size() > 1 && options_.direct_min_bytes > 0 &&
         bytes >= static_cast<int64_t>(options_.direct_min_bytes) && ReachesAllMembers();
}

bool Communicator::ReachesAllMembers() const {
  PeerMemory* memory = transport_->peer_memory();
  if (memory == nullptr) return false;
  for (int member : group_) {
    if (member != transport_->rank() && !memory->CanReach(member)) return false;
  }
  return true;
}

absl::Status Communicator::AllGather(const void* in, int64_t count, DType dtype, void* out) {
  if (UseDirect(size() * count * static_cast<int64_t>(DTypeSize(dtype)))) {
    absl::StatusOr<DirectResult> direct = DirectAllGather(*this, in, count, dtype, out);
    if (!direct.ok() || *direct == DirectResult::kDone) return direct.status();
  }
  return RingAllGather(*this, in, count, dtype, out);
}

absl::Status Communicator::ReduceScatter(const void* in, int64_t count, DType dtype, ReduceOp op,
                                         void* out) {
  if (UseDirect(size() * count * static_cast<int64_t>(DTypeSize(dtype)))) {
    absl::StatusOr<DirectResult> direct = DirectReduceScatter(*this, in, count, dtype, op, out);
    if (!direct.ok() || *direct == DirectResult::kDone) return direct.status();
  }
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
