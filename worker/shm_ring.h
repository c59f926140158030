// A single-producer single-consumer message ring in a POSIX shared-memory segment, written by one
// process and read by another on the same host (the building block of ShmTransport, as a
// shared-memory FIFO is of NCCL's SHM transport).
//
// Layout: one 4 KiB header page (head and tail byte counters and two futex words, each on its own
// cache line), then `capacity` bytes of data used circularly. A message travels as one or more
// frames: a 32-byte frame header {tag, sender's collective epoch, total message bytes, fragment
// bytes, first/last flags}
// and the fragment, padded to 8 bytes. A frame is written only when it fits whole, so an
// abandoned Write leaves whole frames behind; a fragment is at most half the ring, so one
// always fits once the consumer catches up. The producer publishes `head` and bumps the
// consumer's futex word, and wakes it only while the consumer asks for wakes (SetWakeOnData: a
// receive that sleeps; one that polls, or none at all, needs no wake-up, which on a busy core
// costs more than the message); the consumer publishes `tail` after each frame and wakes the
// producer's futex only while the producer waits for room (it posts how much first).
// The consumer may leave whole messages in the ring until someone wants them (Consumer::Defer);
// a producer that finds no room posts the bytes it needs in the header and wakes the consumer,
// which copies out the oldest messages until they fit, so a sender never waits on a receiver
// that is not receiving.
#ifndef MESHRUN_WORKER_SHM_RING_H_
#define MESHRUN_WORKER_SHM_RING_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/collectives/transport.h"

namespace meshrun {

class ShmRing {
 public:
  // Creates the segment `name` (a /dev/shm name: "/" and up to 250 of [A-Za-z0-9._-]) with
  // `capacity_bytes` of ring (rounded up to 4 KiB, at least 8 KiB), its memory reserved up front.
  // Errors: AlreadyExists if the name is taken; ResourceExhausted if /dev/shm has no room
  // (posix_fallocate failed); Unavailable for any other failure of shm_open/mmap, with errno.
  static absl::StatusOr<std::unique_ptr<ShmRing>> Create(const std::string& name,
                                                         size_t capacity_bytes);
  // Maps an existing segment and removes its name (the mapping stays valid; nothing is left in
  // /dev/shm if either process dies). Errors: NotFound if no such segment; DataLoss if it is not
  // a ring (bad magic or size).
  static absl::StatusOr<std::unique_ptr<ShmRing>> OpenAndUnlink(const std::string& name);
  // Unmaps; does not unlink (the creator calls Unlink if no one opened the ring).
  ~ShmRing();
  ShmRing(const ShmRing&) = delete;
  ShmRing& operator=(const ShmRing&) = delete;

  const std::string& name() const { return name_; }
  size_t capacity() const { return capacity_; }
  // Removes the name from /dev/shm if it is still there.
  void Unlink() const;

  // --- Producer (one thread at a time) ---
  // Writes `data` as one message tagged `tag`, sent in collective epoch `epoch`. While waiting for
  // room it wakes at least every `poll` and calls `keep_waiting`; a non-OK result is returned as
  // is. Errors: DeadlineExceeded when the ring stays full past `deadline`; whatever `keep_waiting`
  // returns.
  absl::Status Write(uint64_t epoch, uint64_t tag, absl::string_view data, absl::Time deadline,
                     absl::Duration poll, const std::function<absl::Status()>& keep_waiting);
  // Wakes a Write blocked waiting for room, so that it calls keep_waiting now (for Abort).
  void WakeProducer();

  // --- Consumer (one thread) ---
  // Where Drain hands messages (the receiving transport).
  class Consumer {
   public:
    virtual ~Consumer() = default;
    // A message of `size` bytes that lies whole in the ring (one frame): a sink that takes its
    // bytes where they lie, or null to have them copied out and passed to Deliver. After
    // passing the message through a sink, Drain calls EndInPlace, then frees its ring space.
    virtual const RecvSink* BeginInPlace(uint64_t epoch, uint64_t tag, size_t size) = 0;
    virtual void EndInPlace() = 0;
    // For a whole message no sink took: true to leave it (and all after it) in the ring until
    // the next wake (WakeConsumer), false to have it copied out now. Not asked while the
    // producer waits for more room than there is: messages are copied out until it fits.
    virtual bool Defer(uint64_t tag) = 0;
    virtual void Deliver(uint64_t epoch, uint64_t tag, std::string message) = 0;
  };
  // Consumes the frames present, in order, handing each completed message to `consumer` (the
  // frames an abandoned Write left, which never end in a last frame, are dropped when the next
  // message starts), until the ring is empty or the consumer defers a message; sets `*idle` when
  // it stopped for either reason. Returns DataLoss if a frame header is corrupt (the ring is then
  // unusable); OK otherwise. Consumers on several threads must hold a lock around it.
  absl::Status Consume(Consumer& consumer, bool* idle);
  // The wake counter: read it before Consume, and WaitForData returns at once if it has moved.
  uint32_t DataSeq() const;
  // Waits up to `timeout` for a wake (new frames, WakeConsumer) after `seq`.
  void WaitForData(uint32_t seq, absl::Duration timeout);
  // Consume, then, if idle, WaitForData (one consumer thread).
  absl::Status Drain(absl::Duration timeout, Consumer& consumer);
  // Wakes a Drain blocked waiting for frames (to stop its thread).
  void WakeConsumer();
  // Whether Write wakes a consumer waiting in WaitForData (off at creation). Turning it on is
  // ordered before the consumer's next look at the ring: a message the producer did not wake it
  // for is seen by that look. WakeConsumer and a producer waiting for room wake it either way.
  void SetWakeOnData(bool on);
  // How many of this process's Writes woke the consumer's futex (SetWakeOnData), since the ring
  // was mapped here.
  uint64_t data_wakes() const { return data_wakes_.load(std::memory_order_relaxed); }
  // How many times this process's Consume woke a producer waiting for room, since the ring was
  // mapped here (a producer that never waits is never woken: no futex call per message).
  uint64_t space_wakes() const { return space_wakes_.load(std::memory_order_relaxed); }

 private:
  struct Header;
  ShmRing(std::string name, void* base, size_t mapped_bytes);
  void CopyIn(uint64_t pos, const void* src, size_t n);
  void CopyOut(uint64_t pos, void* dst, size_t n) const;
  // Passes the `n` bytes at ring position `pos` to `read` where they lie: one piece, or two
  // when they wrap past the ring's end.
  void ReadPieces(uint64_t pos, size_t n, RecvSink read) const;
  // Whether the producer waits for more room than the ring has with the consumer at `tail`.
  bool ProducerNeedsRoom(uint64_t tail) const;

  const std::string name_;
  void* const base_;
  const size_t mapped_bytes_;
  Header* const header_;
  char* const data_;
  const size_t capacity_;
  // Consumer state: the message being assembled from fragments (valid only while in_message_).
  std::string partial_;
  uint64_t partial_tag_ = 0;
  uint64_t partial_epoch_ = 0;
  bool in_message_ = false;
  std::atomic<uint64_t> data_wakes_{0};
  std::atomic<uint64_t> space_wakes_{0};
};

}  // namespace meshrun

#endif  // MESHRUN_WORKER_SHM_RING_H_
