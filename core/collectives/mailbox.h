// Per-sender FIFO queues of received messages with blocking, deadline-bounded receive.
#ifndef MESHRUN_CORE_COLLECTIVES_MAILBOX_H_
#define MESHRUN_CORE_COLLECTIVES_MAILBOX_H_

#include <cstdint>
#include <deque>
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
  explicit Mailbox(int world_size);

  void Deliver(int src, uint64_t tag, std::string payload);
  // Future Take(src) calls fail with `status` once src's queue is drained.
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
  absl::Mutex mu_;
  std::vector<std::deque<Message>> queues_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Status> peer_failed_ ABSL_GUARDED_BY(mu_);
  absl::Status aborted_ ABSL_GUARDED_BY(mu_);
};

}  // namespace meshrun

#endif  // MESHRUN_CORE_COLLECTIVES_MAILBOX_H_
