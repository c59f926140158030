// Per-sender FIFO queues of received messages with blocking, deadline-bounded receive.
#ifndef MESHRUN_CORE_COLLECTIVES_MAILBOX_H_
#define MESHRUN_CORE_COLLECTIVES_MAILBOX_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace meshrun {

// The receiving half of a Transport. Thread-safe: Deliver / MarkPeerFailed come from network
// threads, Take from the collective's thread.
class Mailbox {
 public:
  // `failure_grace`: how long a peer marked failed may still prove itself alive by sending
  // (see MarkPeerFailed) before Take reports the failure.
  explicit Mailbox(int world_size, absl::Duration failure_grace = absl::Seconds(2));

  // Queues `payload` for Take(src), or hands it to the control handler of `tag` if one is set.
  void Deliver(int src, uint64_t tag, std::string payload);
  // Messages tagged `tag` go to `handler` on the delivering thread instead of the queues (a
  // transport's own control messages, e.g. ShmTransport's ring announcements). One tag at a time;
  // a null handler removes it, waiting for a call in progress to return. `handler` must not call
  // SetControlHandler.
  using ControlHandler = std::function<void(int src, const std::string& payload)>;
  void SetControlHandler(uint64_t tag, ControlHandler handler);
  // Take(src) fails with `status` once src's queue is drained and `failure_grace` has passed
  // since the mark with nothing more from src: a message from src clears the mark. (A stream
  // that src cancelled in an abort may be seen ending after this side's Reset; src, alive,
  // clears the stale mark with its next message. A dead src is reported within the grace.)
  void MarkPeerFailed(int src, absl::Status status);
  // Fails every Take with `reason` until Reset().
  void Abort(absl::Status reason);
  // Drops queued messages, failures and aborts.
  void Reset();

  // Next message from `src`; see Transport::Recv for the errors.
  absl::StatusOr<std::string> Take(int src, uint64_t expected_tag, absl::Time deadline);

 private:
  struct Message {
    uint64_t tag;
    std::string payload;
  };
  const absl::Duration failure_grace_;
  absl::Mutex control_mu_;  // held while a control handler runs
  uint64_t control_tag_ ABSL_GUARDED_BY(control_mu_) = 0;
  ControlHandler control_ ABSL_GUARDED_BY(control_mu_);
  absl::Mutex mu_;
  std::vector<std::deque<Message>> queues_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Status> peer_failed_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Time> failed_at_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> failure_marks_ ABSL_GUARDED_BY(mu_);  // marks ever made, per src
  absl::Status aborted_ ABSL_GUARDED_BY(mu_);
};

}  // namespace meshrun

#endif  // MESHRUN_CORE_COLLECTIVES_MAILBOX_H_
