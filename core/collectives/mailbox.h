// Per-sender FIFO queues of received messages with blocking, deadline-bounded receive.
#ifndef MESHRUN_CORE_COLLECTIVES_MAILBOX_H_
#define MESHRUN_CORE_COLLECTIVES_MAILBOX_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/collectives/transport.h"

namespace meshrun {

// The receiving half of a Transport. Thread-safe: Deliver / MarkPeerFailed / BeginInPlace come
// from network threads, Take / TakeInto from the collective's thread (one at a time per source).
//
// Collective epochs: every message carries the epoch its sender was in when it sent it, and the
// Mailbox is in one epoch at a time (Reset moves it on). A message of an earlier epoch belongs to
// collectives that were aborted or timed out, and is dropped, whether it is queued when the epoch
// changes or arrives later (a stream or ring still holding it); so a later collective can never
// sum a stale contribution. A message of a later epoch (a peer that moved on first) is kept for
// when this side moves on too; a Take that meets one fails with Aborted naming the peer, since
// this rank then runs a collective its peer has abandoned.
class Mailbox {
 public:
  // `failure_grace`: how long a peer marked failed may still prove itself alive by sending
  // (see MarkPeerFailed) before Take reports the failure. `spin`: when a wait listener is set (a
  // transport that holds messages in its own memory), a Take or TakeInto that finds nothing
  // polls through the listener for this long, yielding the core between polls, before it
  // sleeps: a message that comes meanwhile goes into the receive on this thread, with no wake-up
  // of a drain thread and then of this one (spin-then-block, as MPI's shared-memory transports
  // poll).
  explicit Mailbox(int world_size, absl::Duration failure_grace = absl::Seconds(2),
                   absl::Duration spin = absl::ZeroDuration());

  // Queues `payload`, sent by `src` in `epoch`, for Take(src), or hands it to the control handler
  // of `tag` if one is set (control messages belong to no epoch). Drops it if `epoch` is earlier
  // than this Mailbox's.
  // The payload may be a Cord over the transport's own buffers (gRPC's received slices): it is
  // queued as is, and TakeInto passes its chunks to the sink with no copy.
  void Deliver(int src, uint64_t epoch, uint64_t tag, absl::Cord payload);
  void Deliver(int src, uint64_t epoch, uint64_t tag, std::string payload) {
    Deliver(src, epoch, tag, absl::Cord(std::move(payload)));
  }
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
  // Fails every Take with `reason` until Reset moves to a later epoch.
  void Abort(absl::Status reason);
  // Moves to `epoch`: drops every queued message of an earlier epoch (and, from now on, every
  // such message delivered), peer failure marks and the abort. Nothing happens unless `epoch` is
  // later than the current one: only a new epoch clears an abort.
  void Reset(uint64_t epoch);
  // The current epoch (0 at construction); takes no lock.
  uint64_t epoch();
  // Messages dropped because they came from an earlier epoch, since construction.
  int64_t stale_dropped();

  // Next message from `src` (flattened: a copy when it came in pieces); see Transport::Recv for
  // the errors.
  absl::StatusOr<std::string> Take(int src, uint64_t expected_tag, absl::Time deadline);
  // The same, as it was delivered (a Cord over a transport's buffers stays one: no copy).
  absl::StatusOr<absl::Cord> TakeCord(int src, uint64_t expected_tag, absl::Time deadline);

  // Next message from `src`, `size` bytes, passed to `sink` (Transport::RecvInto). A message
  // already queued is passed from its copy; otherwise the receive stays posted until the message
  // comes, so a transport that calls BeginInPlace hands its bytes over where they lie. Errors:
  // those of Take; WrongMessageSize if the message is not `size` bytes.
  absl::Status TakeInto(int src, uint64_t expected_tag, size_t size, absl::Time deadline,
                        RecvSink sink);

  // For a transport that holds a whole message of `size` bytes from `src` in memory of its own
  // (a shared-memory ring): if the message is of the current epoch, a TakeInto for exactly this
  // tag and size is posted and nothing from `src` is queued before it, claims it and returns its
  // sink; the caller passes the
  // message through the sink, then calls EndInPlace(src). Otherwise returns null and the caller
  // Delivers a copy. The TakeInto returns only after EndInPlace, even past its deadline.
  const RecvSink* BeginInPlace(int src, uint64_t epoch, uint64_t tag, size_t size);
  void EndInPlace(int src);

  // Whether a Take or TakeInto from `src` waits, having found nothing queued (a transport that
  // leaves messages in its own memory until they are wanted hands them over then).
  bool Waiting(int src);
  // What a waiting Take or TakeInto tells the wait listener, on its own thread.
  enum class WaitEvent {
    // It starts to wait (after a TakeInto is posted), or, spinning, polls again: hand over what
    // the transport holds for it.
    kPoll,
    // It is about to sleep until something is delivered: from now on a message from src must
    // wake a thread that hands it over (a transport whose messages wait in its own memory need
    // wake no one before this), and what the transport holds already is handed over now.
    kSleep,
    // A wait that announced kSleep is over (message found, error or deadline).
    kAwake,
  };
  // Called with src and the event, on the receiving thread, with no lock of this Mailbox held:
  // the listener may hand messages over (Deliver, BeginInPlace) but not call SetWaitListener.
  // Every kSleep is followed by one kAwake. One listener; a null one removes it, waiting for a
  // call in progress.
  using WaitListener = std::function<void(int src, WaitEvent event)>;
  void SetWaitListener(WaitListener listener);

 private:
  struct Message {
    uint64_t epoch;
    uint64_t tag;
    absl::Cord payload;
  };
  // A TakeInto waiting for its message (it lives on that call's stack).
  struct PostedRecv {
    uint64_t tag;
    size_t size;
    const RecvSink* sink;
    enum class State { kPosted, kClaimed, kDone } state = State::kPosted;
  };
  // The front message from `src` (REQUIRES: one is queued), or Aborted if it is of a later epoch.
  absl::StatusOr<Message> PopFront(int src) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits until `src` has a queued message (OK), or returns the abort, failure or deadline error
  // that ends the wait; `posted`, when set, also ends the wait once done (OK).
  absl::Status AwaitMessage(int src, uint64_t expected_tag, absl::Time deadline,
                            const PostedRecv* posted) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Polls for up to `until` (calling the wait listener, yielding the core between polls) and
  // returns whether `changed` came true meanwhile; mu_ is released while polling.
  template <typename Changed>
  bool Spin(int src, absl::Time until, Changed& changed) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const absl::Duration failure_grace_;
  const absl::Duration spin_;
  absl::Mutex control_mu_;  // held while a control handler runs
  uint64_t control_tag_ ABSL_GUARDED_BY(control_mu_) = 0;
  ControlHandler control_ ABSL_GUARDED_BY(control_mu_);
  absl::Mutex mu_;
  std::vector<std::deque<Message>> queues_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Status> peer_failed_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Time> failed_at_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> failure_marks_ ABSL_GUARDED_BY(mu_);  // marks ever made, per src
  absl::Status aborted_ ABSL_GUARDED_BY(mu_);
  // Written under mu_; read without it by epoch(), which every Send calls to stamp its message.
  std::atomic<uint64_t> epoch_{0};
  int64_t stale_dropped_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<PostedRecv*> posted_ ABSL_GUARDED_BY(mu_);  // per src, null when none
  std::vector<int> waiting_ ABSL_GUARDED_BY(mu_);         // Takes in progress, per src
  absl::Mutex listener_mu_;                               // held while the listener runs
  WaitListener listener_ ABSL_GUARDED_BY(listener_mu_);
  // A Take from src found nothing queued and waits: counts it in waiting_ and calls the
  // listener (with mu_ released meanwhile).
  void StartWaiting(int src) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) ABSL_LOCKS_EXCLUDED(listener_mu_);
  // Calls the listener, if there is one, with mu_ released meanwhile; returns whether it did.
  bool Notify(int src, WaitEvent event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_)
      ABSL_LOCKS_EXCLUDED(listener_mu_);
  // AwaitMessage's loop; sets *slept once it has told the listener kSleep.
  absl::Status AwaitMessageOrSleep(int src, uint64_t expected_tag, absl::Time deadline,
                                   const PostedRecv* posted, bool* slept)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
};

}  // namespace meshrun

#endif  // MESHRUN_CORE_COLLECTIVES_MAILBOX_H_
