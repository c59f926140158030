#include "core/collectives/mailbox.h"

#include <sched.h>

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace meshrun {
namespace {

absl::Status WrongTag(int src, uint64_t tag, uint64_t expected_tag) {
  return absl::InternalError(
      absl::StrCat("rank ", src, " sent tag ", tag, " but tag ", expected_tag,
                   " was expected: ranks ran collectives in different orders"));
}

}  // namespace

Mailbox::Mailbox(int world_size, absl::Duration failure_grace, absl::Duration spin)
    : failure_grace_(failure_grace),
      spin_(spin),
      queues_(world_size),
      peer_failed_(world_size),
      failed_at_(world_size),
      failure_marks_(world_size, 0),
      posted_(world_size, nullptr),
      waiting_(world_size, 0) {}

void Mailbox::SetControlHandler(uint64_t tag, ControlHandler handler) {
  absl::MutexLock lock(&control_mu_);
  control_tag_ = tag;
  control_ = std::move(handler);
}

void Mailbox::Deliver(int src, uint64_t epoch, uint64_t tag, absl::Cord payload) {
  // Whatever src sends proves it alive: a failure mark left by one of its old streams (one it
  // cancelled in an abort, seen ending after this side's Reset) no longer counts.
  {
    absl::MutexLock lock(&control_mu_);
    if (control_ && tag == control_tag_) {
      {
        absl::MutexLock alive(&mu_);
        peer_failed_[src] = absl::OkStatus();
      }
      control_(src, std::string(payload));
      return;
    }
  }
  absl::MutexLock lock(&mu_);
  peer_failed_[src] = absl::OkStatus();
  if (epoch < epoch_.load(std::memory_order_relaxed)) {
    ++stale_dropped_;
    return;
  }
  queues_[src].push_back(Message{epoch, tag, std::move(payload)});
}

void Mailbox::SetWaitListener(WaitListener listener) {
  absl::MutexLock lock(&listener_mu_);
  listener_ = std::move(listener);
}

bool Mailbox::Waiting(int src) {
  absl::MutexLock lock(&mu_);
  return waiting_[src] > 0;
}

void Mailbox::StartWaiting(int src) {
  ++waiting_[src];
  Notify(src, WaitEvent::kPoll);
}

bool Mailbox::Notify(int src, WaitEvent event) {
  mu_.Unlock();  // the listener may call back into this Mailbox
  bool called = false;
  {
    absl::MutexLock lock(&listener_mu_);
    if (listener_) {
      listener_(src, event);
      called = true;
    }
  }
  mu_.Lock();
  return called;
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

void Mailbox::Reset(uint64_t epoch) {
  absl::MutexLock lock(&mu_);
  if (epoch <= epoch_.load(std::memory_order_relaxed)) return;
  epoch_.store(epoch, std::memory_order_release);
  for (auto& q : queues_) {
    const size_t before = q.size();
    q.erase(std::remove_if(q.begin(), q.end(), [&](const Message& m) { return m.epoch < epoch; }),
            q.end());
    stale_dropped_ += static_cast<int64_t>(before - q.size());
  }
  for (auto& s : peer_failed_) s = absl::OkStatus();
  aborted_ = absl::OkStatus();
}

uint64_t Mailbox::epoch() { return epoch_.load(std::memory_order_acquire); }

int64_t Mailbox::stale_dropped() {
  absl::MutexLock lock(&mu_);
  return stale_dropped_;
}

absl::StatusOr<Mailbox::Message> Mailbox::PopFront(int src) {
  std::deque<Message>& q = queues_[src];
  if (q.front().epoch > epoch_.load(std::memory_order_relaxed)) {
    // Left queued: it is the first message of the run this rank has not started yet.
    return absl::AbortedError(absl::StrCat("rank ", src, " has moved on to collective epoch ",
                                           q.front().epoch, " while this rank is in epoch ",
                                           epoch_.load(std::memory_order_relaxed),
                                           ": this collective was abandoned"));
  }
  Message m = std::move(q.front());
  q.pop_front();
  return m;
}

absl::Status Mailbox::AwaitMessage(int src, uint64_t expected_tag, absl::Time deadline,
                                   const PostedRecv* posted) {
  bool slept = false;
  absl::Status s = AwaitMessageOrSleep(src, expected_tag, deadline, posted, &slept);
  if (slept) Notify(src, WaitEvent::kAwake);
  return s;
}

absl::Status Mailbox::AwaitMessageOrSleep(int src, uint64_t expected_tag, absl::Time deadline,
                                          const PostedRecv* posted, bool* slept) {
  auto done = [posted]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return posted != nullptr && posted->state == PostedRecv::State::kDone;
  };
  bool spun = false;
  for (;;) {
    if (!aborted_.ok()) return aborted_;
    if (!queues_[src].empty() || done()) return absl::OkStatus();
    absl::Time wake = deadline;
    if (!peer_failed_[src].ok()) {
      const absl::Time due = failed_at_[src] + failure_grace_;
      if (absl::Now() >= due) return peer_failed_[src];
      wake = std::min(wake, due);
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("timed out waiting for a message from rank ",
                                                      src, " (tag ", expected_tag, ")"));
    }
    const uint64_t marks = failure_marks_[src];
    auto changed = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return !aborted_.ok() || !queues_[src].empty() || failure_marks_[src] != marks || done();
    };
    if (!spun && spin_ > absl::ZeroDuration()) {
      spun = true;
      if (Spin(src, std::min(wake, absl::Now() + spin_), changed)) continue;
    }
    if (!*slept) {
      // The transport arms its wake-up, then hands over what came before it was armed.
      *slept = true;
      Notify(src, WaitEvent::kSleep);
      if (changed()) continue;
    }
    mu_.AwaitWithDeadline(absl::Condition(&changed), wake);
  }
}

template <typename Changed>
bool Mailbox::Spin(int src, absl::Time until, Changed& changed) {
  do {
    // The listener hands over what the transport holds (a shared-memory ring) on this thread.
    if (!Notify(src, WaitEvent::kPoll)) return false;  // messages come from other threads only
    if (changed()) return true;
    mu_.Unlock();
    sched_yield();  // a core shared with the sender lets it run
    mu_.Lock();
  } while (absl::Now() < until);
  return false;
}

absl::StatusOr<std::string> Mailbox::Take(int src, uint64_t expected_tag, absl::Time deadline) {
  absl::StatusOr<absl::Cord> payload = TakeCord(src, expected_tag, deadline);
  if (!payload.ok()) return payload.status();
  return std::string(*payload);
}

absl::StatusOr<absl::Cord> Mailbox::TakeCord(int src, uint64_t expected_tag, absl::Time deadline) {
  Message m;
  {
    absl::MutexLock lock(&mu_);
    if (!aborted_.ok()) return aborted_;  // nothing of an aborted epoch is handed out
    if (queues_[src].empty()) {
      StartWaiting(src);
      absl::Status s = AwaitMessage(src, expected_tag, deadline, nullptr);
      --waiting_[src];
      if (!s.ok()) return s;
    }
    absl::StatusOr<Message> front = PopFront(src);
    if (!front.ok()) return front.status();
    m = *std::move(front);
  }
  if (m.tag != expected_tag) return WrongTag(src, m.tag, expected_tag);
  return std::move(m.payload);
}

absl::Status Mailbox::TakeInto(int src, uint64_t expected_tag, size_t size, absl::Time deadline,
                               RecvSink sink) {
  PostedRecv posted{expected_tag, size, &sink};
  Message m;
  {
    absl::MutexLock lock(&mu_);
    if (!aborted_.ok()) return aborted_;
    if (queues_[src].empty()) {
      // Posted first, then waited for: a transport woken by the listener finds it posted.
      const bool post = posted_[src] == nullptr;
      if (post) posted_[src] = &posted;
      StartWaiting(src);
      absl::Status s = AwaitMessage(src, expected_tag, deadline, post ? &posted : nullptr);
      if (!post || posted.state == PostedRecv::State::kPosted) --waiting_[src];  // else: claimed
      if (post) {
        // A claimed receive is being filled by its transport (one local copy): wait for it,
        // even past the deadline, since the sink writes into the caller's memory.
        auto not_claimed = [&posted]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
          return posted.state != PostedRecv::State::kClaimed;
        };
        mu_.Await(absl::Condition(&not_claimed));
        posted_[src] = nullptr;
        if (posted.state == PostedRecv::State::kDone) return absl::OkStatus();
      }
      if (!s.ok()) return s;
    }
    absl::StatusOr<Message> front = PopFront(src);
    if (!front.ok()) return front.status();
    m = *std::move(front);
  }
  if (m.tag != expected_tag) return WrongTag(src, m.tag, expected_tag);
  if (m.payload.size() != size) return WrongMessageSize(src, m.tag, m.payload.size(), size);
  SinkStitcher stitcher(sink);
  for (absl::string_view chunk : m.payload.Chunks()) stitcher.Add(chunk.data(), chunk.size());
  stitcher.Finish();
  return absl::OkStatus();
}

const RecvSink* Mailbox::BeginInPlace(int src, uint64_t epoch, uint64_t tag, size_t size) {
  absl::MutexLock lock(&mu_);
  PostedRecv* p = posted_[src];
  if (!aborted_.ok() || epoch != epoch_.load(std::memory_order_relaxed) || !queues_[src].empty() ||
      p == nullptr || p->state != PostedRecv::State::kPosted || p->tag != tag || p->size != size) {
    return nullptr;
  }
  peer_failed_[src] = absl::OkStatus();  // as Deliver: src proved itself alive
  p->state = PostedRecv::State::kClaimed;
  --waiting_[src];  // the message is found: what comes after it is no longer waited for
  return p->sink;
}

void Mailbox::EndInPlace(int src) {
  absl::MutexLock lock(&mu_);
  posted_[src]->state = PostedRecv::State::kDone;
}

}  // namespace meshrun
