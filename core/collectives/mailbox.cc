#include "core/collectives/mailbox.h"

#include "absl/strings/str_cat.h"

namespace meshrun {

Mailbox::Mailbox(int world_size) : queues_(world_size), peer_failed_(world_size) {}

void Mailbox::SetControlHandler(uint64_t tag, ControlHandler handler) {
  absl::MutexLock lock(&control_mu_);
  control_tag_ = tag;
  control_ = std::move(handler);
}

void Mailbox::Deliver(int src, uint64_t tag, std::string payload) {
  {
    absl::MutexLock lock(&control_mu_);
    if (control_ && tag == control_tag_) {
      control_(src, payload);
      return;
    }
  }
  absl::MutexLock lock(&mu_);
  queues_[src].push_back(Message{tag, std::move(payload)});
}

void Mailbox::MarkPeerFailed(int src, absl::Status status) {
  absl::MutexLock lock(&mu_);
  if (peer_failed_[src].ok()) peer_failed_[src] = std::move(status);
}

void Mailbox::Abort(absl::Status reason) {
  absl::MutexLock lock(&mu_);
  if (aborted_.ok()) aborted_ = std::move(reason);
}

void Mailbox::Reset() {
  absl::MutexLock lock(&mu_);
  for (auto& q : queues_) q.clear();
  for (auto& s : peer_failed_) s = absl::OkStatus();
  aborted_ = absl::OkStatus();
}

absl::StatusOr<std::string> Mailbox::Take(int src, uint64_t expected_tag, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto ready = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return !aborted_.ok() || !queues_[src].empty() || !peer_failed_[src].ok();
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&ready), deadline)) {
    return absl::DeadlineExceededError(
        absl::StrCat("timed out waiting for a message from rank ", src, " (tag ", expected_tag, ")"));
  }
  if (!aborted_.ok()) return aborted_;
  if (queues_[src].empty()) return peer_failed_[src];
  Message m = std::move(queues_[src].front());
  queues_[src].pop_front();
  if (m.tag != expected_tag) {
    return absl::InternalError(absl::StrCat("rank ", src, " sent tag ", m.tag, " but tag ", expected_tag,
                                            " was expected: ranks ran collectives in different orders"));
  }
  return std::move(m.payload);
}

}  // namespace meshrun
