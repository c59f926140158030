#include "server/job_queue.h"

#include <algorithm>

namespace meshrun {

uint64_t JobQueue::Join(int* ahead) {
  absl::MutexLock lock(&mu_);
  *ahead = static_cast<int>(waiting_.size()) + (running_ != 0 ? 1 : 0);
  const uint64_t ticket = next_++;
  waiting_.push_back(ticket);
  return ticket;
}

bool JobQueue::WaitTurn(uint64_t ticket, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto turn = [this, ticket]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return running_ == 0 && !waiting_.empty() && waiting_.front() == ticket;
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&turn), timeout)) return false;
  waiting_.pop_front();
  running_ = ticket;
  return true;
}

void JobQueue::Leave(uint64_t ticket) {
  absl::MutexLock lock(&mu_);
  waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), ticket), waiting_.end());
}

void JobQueue::Done(uint64_t ticket) {
  absl::MutexLock lock(&mu_);
  if (running_ == ticket) running_ = 0;
}

}  // namespace meshrun
