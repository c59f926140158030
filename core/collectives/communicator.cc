#include "core/collectives/communicator.h"

#include <algorithm>

#include "core/collectives/ring_all_reduce.h"

namespace meshrun {

Communicator::Communicator(Transport* transport, std::vector<int> group, CollectiveOptions options)
    : transport_(transport), group_(std::move(group)), options_(options) {
  auto it = std::find(group_.begin(), group_.end(), transport_->rank());
  index_ = it == group_.end() ? -1 : static_cast<int>(it - group_.begin());
}

absl::Status Communicator::AllReduce(void* data, int64_t count, DType dtype, ReduceOp op) {
  return RingAllReduce(*this, data, count, dtype, op);
}

}  // namespace meshrun
