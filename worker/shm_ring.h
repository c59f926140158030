// A single-producer single-consumer message ring in a POSIX shared-memory segment, written by one
// process and read by another on the same host (the building block of ShmTransport, as a
// shared-memory FIFO is of NCCL's SHM transport).
//
// Layout: one 4 KiB header page (head and tail byte counters and two futex words, each on its own
// cache line), then `capacity` bytes of data used circularly. A message travels as one or more
// frames: a 24-byte frame header {tag, total message bytes, fragment bytes, first/last flags}
// and the fragment, padded to 8 bytes. A frame is written only when it fits whole, so an
// abandoned Write leaves whole frames behind; a fragment is at most half the ring, so one
// always fits once the consumer catches up. The producer publishes `head` and wakes the
// consumer's futex; the consumer publishes `tail` after each frame and wakes the producer's.
#ifndef MESHRUN_WORKER_SHM_RING_H_
#define MESHRUN_WORKER_SHM_RING_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

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
  // Writes `data` as one message tagged `tag`. While waiting for room it wakes at least every
  // `poll` and calls `keep_waiting`; a non-OK result is returned as is. Errors: DeadlineExceeded
  // when the ring stays full past `deadline`; whatever `keep_waiting` returns.
  absl::Status Write(uint64_t tag, absl::string_view data, absl::Time deadline, absl::Duration poll,
                     const std::function<absl::Status()>& keep_waiting);
  // Wakes a Write blocked waiting for room, so that it calls keep_waiting now (for Abort).
  void WakeProducer();

  // --- Consumer (one thread) ---
  // Waits up to `timeout` for frames, then consumes every frame present, calling `deliver` for
  // each completed message (the frames an abandoned Write left, which never end in a last
  // frame, are dropped when the next message starts). Returns DataLoss if a frame header is
  // corrupt (the ring is then unusable); OK otherwise.
  absl::Status Drain(absl::Duration timeout,
                     const std::function<void(uint64_t tag, std::string message)>& deliver);
  // Wakes a Drain blocked waiting for frames (to stop its thread).
  void WakeConsumer();

 private:
  struct Header;
  ShmRing(std::string name, void* base, size_t mapped_bytes);
  void CopyIn(uint64_t pos, const void* src, size_t n);
  void CopyOut(uint64_t pos, void* dst, size_t n) const;
  void AppendOut(uint64_t pos, size_t n, std::string* out) const;

  const std::string name_;
  void* const base_;
  const size_t mapped_bytes_;
  Header* const header_;
  char* const data_;
  const size_t capacity_;
  // Consumer state: the message being assembled from fragments.
  std::string partial_;
  uint64_t partial_tag_ = 0;
};

}  // namespace meshrun

#endif  // MESHRUN_WORKER_SHM_RING_H_
