#include "core/collectives/mailbox.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace meshrun {

Mailbox::Mailbox(int world_size, absl::Duration failure_grace)
    : failure_grace_(failure_grace), queues_(world_size), peer_failed_(world_size),
      failed_at_(world_size), failure_marks_(world_size, 0) {}

void Mailbox::SetControlHandler(uint64_t tag, ControlHandler handler) {
  absl::MutexLock lock(&control_mu_);
  control_tag_ = tag;
  control_ = std::move(handler);
}

void Mailbox::Deliver(int src, uint64_t tag, std::string payload) {
  // Whatever src sends proves it alive: a failure mark left by one of its old streams (one it
  // cancelled in an abort, seen ending after this side's Reset) no longer counts.
  {
    absl::MutexLock lock(&control_mu_);
    if (control_ && tag == control_tag_) {
      {
        absl::MutexLock alive(&mu_);
        peer_failed_[src] = absl::OkStatus();
      }
      control_(src, payload);
      return;
    }
  }
  absl::MutexLock lock(&mu_);
  peer_failed_[src] = absl::OkStatus();
  queues_[src].push_back(Message{tag, std::move(payload)});
}

void Mailbox::MarkPeerFailed(int src, absl::Status status) {
  absl::MutexLock lock(&mu_);
  if (!peer_failed_[src].ok()) return;
  peer_failed_[src] = std::move(status);
  failed_at_[src] = absl::Now();
  ++failure_marks_[src];
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
  for (;;) {
    if (!aborted_.ok()) return aborted_;
    if (!queues_[src].empty()) break;
    absl::Time wake = deadline;
    if (!peer_failed_[src].ok()) {
      const absl::Time due = failed_at_[src] + failure_grace_;
      if (absl::Now() >= due) return peer_failed_[src];
      wake = std::min(wake, due);
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("timed out waiting for a message from rank ", src, " (tag ", expected_tag, ")"));
    }
    const uint64_t marks = failure_marks_[src];
    auto changed = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return !aborted_.ok() || !queues_[src].empty() || failure_marks_[src] != marks;
    };
    mu_.AwaitWithDeadline(absl::Condition(&changed), wake);
  }
  Message m = std::move(queues_[src].front());
  queues_[src].pop_front();
  if (m.tag != expected_tag) {
    return absl::InternalError(absl::StrCat("rank ", src, " sent tag ", m.tag, " but tag ", expected_tag,
                                            " was expected: ranks ran collectives in different orders"));
  }
  return std::move(m.payload);
}

}  // namespace meshrun
