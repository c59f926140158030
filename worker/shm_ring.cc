#include "worker/shm_ring.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <new>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"

namespace meshrun {
namespace {

constexpr uint64_t kMagic = 0x676e69724d485352;  // "RSHMring"
constexpr size_t kHeaderBytes = 4096;
constexpr size_t kPage = 4096;
constexpr uint32_t kFirst = 1, kLast = 2;

struct FrameHeader {
  uint64_t tag;
  uint64_t epoch;  // the sender's collective epoch
  uint64_t total;  // bytes of the whole message
  uint32_t len;    // bytes of this fragment
  uint32_t flags;  // kFirst | kLast
};
static_assert(sizeof(FrameHeader) == 32);

uint64_t Pad8(uint64_t n) { return (n + 7) & ~uint64_t{7}; }

// Shared futexes (no FUTEX_PRIVATE_FLAG): the words live in a mapping shared by two processes.
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, absl::Duration timeout) {
  timespec ts = absl::ToTimespec(std::max(timeout, absl::ZeroDuration()));
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}
void FutexWake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

absl::Status Errno(absl::StatusCode code, const std::string& what, const std::string& name) {
  return absl::Status(code, absl::StrCat(what, " ", name, ": ", std::strerror(errno)));
}

}  // namespace

struct ShmRing::Header {
  uint64_t magic;
  uint64_t capacity;
  alignas(64) std::atomic<uint64_t> head;       // bytes ever written (producer)
  alignas(64) std::atomic<uint64_t> tail;       // bytes ever consumed (consumer)
  alignas(64) std::atomic<uint32_t> data_seq;   // bumped after head moves; the consumer waits on it
  alignas(64) std::atomic<uint32_t> space_seq;  // bumped after tail moves; the producer waits on it
  alignas(64) std::atomic<uint64_t> producer_needs;  // bytes the producer waits for; 0: none
  alignas(64) std::atomic<uint32_t> wake_on_data;    // 1: Write wakes the consumer's futex
};
// The counters are shared between processes: they must be lock-free (hence address-free).
static_assert(std::atomic<uint64_t>::is_always_lock_free &&
              std::atomic<uint32_t>::is_always_lock_free);

ShmRing::ShmRing(std::string name, void* base, size_t mapped_bytes)
    : name_(std::move(name)),
      base_(base),
      mapped_bytes_(mapped_bytes),
      header_(static_cast<Header*>(base)),
      data_(static_cast<char*>(base) + kHeaderBytes),
      capacity_(mapped_bytes - kHeaderBytes) {}

ShmRing::~ShmRing() { munmap(base_, mapped_bytes_); }

void ShmRing::Unlink() const { shm_unlink(name_.c_str()); }

absl::StatusOr<std::unique_ptr<ShmRing>> ShmRing::Create(const std::string& name,
                                                         size_t capacity_bytes) {
  const size_t capacity = std::max<size_t>(2 * kPage, (capacity_bytes + kPage - 1) / kPage * kPage);
  const size_t bytes = kHeaderBytes + capacity;
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) {
    return Errno(
        errno == EEXIST ? absl::StatusCode::kAlreadyExists : absl::StatusCode::kUnavailable,
        "cannot create shared-memory segment", name);
  }
  // Reserve the pages now: a tmpfs that runs out later would kill the writer with SIGBUS.
  if (const int err = posix_fallocate(fd, 0, static_cast<off_t>(bytes)); err != 0) {
    close(fd);
    shm_unlink(name.c_str());
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot reserve ", bytes, " bytes of /dev/shm for ", name, ": ", std::strerror(err)));
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) {
    const absl::Status s =
        Errno(absl::StatusCode::kUnavailable, "cannot map shared-memory segment", name);
    shm_unlink(name.c_str());
    return s;
  }
  static_assert(sizeof(Header) <= kHeaderBytes);
  std::memset(base, 0, kHeaderBytes);
  Header* h = new (base) Header{};
  h->capacity = capacity;
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = kMagic;
  return std::unique_ptr<ShmRing>(new ShmRing(name, base, bytes));
}

absl::StatusOr<std::unique_ptr<ShmRing>> ShmRing::OpenAndUnlink(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    return Errno(errno == ENOENT ? absl::StatusCode::kNotFound : absl::StatusCode::kUnavailable,
                 "cannot open shared-memory segment", name);
  }
  shm_unlink(name.c_str());
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < kHeaderBytes + 2 * kPage) {
    close(fd);
    return absl::DataLossError(
        absl::StrCat("shared-memory segment ", name, " is too small to be a ring"));
  }
  const size_t bytes = static_cast<size_t>(st.st_size);
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED)
    return Errno(absl::StatusCode::kUnavailable, "cannot map shared-memory segment", name);
  auto ring = std::unique_ptr<ShmRing>(new ShmRing(name, base, bytes));
  const Header* h = ring->header_;
  if (h->magic != kMagic || h->capacity != bytes - kHeaderBytes) {
    return absl::DataLossError(absl::StrCat("shared-memory segment ", name,
                                            " is not a meshrun ring (magic ", h->magic,
                                            ", capacity ", h->capacity, " of ", bytes, " bytes)"));
  }
  return ring;
}

void ShmRing::CopyIn(uint64_t pos, const void* src, size_t n) {
  const size_t at = pos % capacity_, first = std::min(n, capacity_ - at);
  std::memcpy(data_ + at, src, first);
  std::memcpy(data_, static_cast<const char*>(src) + first, n - first);
}

void ShmRing::ReadPieces(uint64_t pos, size_t n, RecvSink read) const {
  // Positions are 8-byte aligned and so is the ring's end: so is the cut between the pieces.
  const size_t at = pos % capacity_, first = std::min(n, capacity_ - at);
  if (first > 0) read(0, data_ + at, first);
  if (n > first) read(first, data_, n - first);
}

void ShmRing::CopyOut(uint64_t pos, void* dst, size_t n) const {
  ReadPieces(pos, n, [dst](size_t offset, const char* piece, size_t piece_bytes) {
    std::memcpy(static_cast<char*>(dst) + offset, piece, piece_bytes);
  });
}

absl::Status ShmRing::Write(uint64_t epoch, uint64_t tag, absl::string_view data,
                            absl::Time deadline, absl::Duration poll,
                            const std::function<absl::Status()>& keep_waiting) {
  const uint64_t max_fragment = capacity_ / 2 - sizeof(FrameHeader);
  uint64_t head = header_->head.load(std::memory_order_relaxed);  // only this side writes it
  size_t offset = 0;
  do {
    const uint64_t len = std::min<uint64_t>(max_fragment, data.size() - offset);
    const uint64_t need = sizeof(FrameHeader) + Pad8(len);
    bool flagged = false;  // producer_needs set (and the consumer woken) in this wait
    absl::Cleanup clear_needs = [&] {
      if (flagged) header_->producer_needs.store(0, std::memory_order_release);
    };
    for (;;) {
      const uint32_t seq = header_->space_seq.load(std::memory_order_acquire);
      if (capacity_ - (head - header_->tail.load(std::memory_order_acquire)) >= need) break;
      if (!flagged) {
        // A consumer that left messages in the ring copies out enough of them; look again after.
        header_->producer_needs.store(need, std::memory_order_release);
        // Pairs with Consume's fence: either it sees the flag and wakes this side, or the look
        // at `tail` below sees what it consumed.
        std::atomic_thread_fence(std::memory_order_seq_cst);
        WakeConsumer();
        flagged = true;
        continue;
      }
      if (absl::Status s = keep_waiting(); !s.ok()) return s;
      const absl::Time now = absl::Now();
      if (now >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat("shared-memory ring ", name_,
                                                        " stayed full (", capacity_,
                                                        " bytes) past the deadline"));
      }
      FutexWait(&header_->space_seq, seq, std::min(deadline - now, poll));
    }
    std::move(clear_needs).Invoke();
    FrameHeader frame{tag, epoch, data.size(), static_cast<uint32_t>(len), 0};
    if (offset == 0) frame.flags |= kFirst;
    if (offset + len == data.size()) frame.flags |= kLast;
    CopyIn(head, &frame, sizeof(frame));
    CopyIn(head + sizeof(frame), data.data() + offset, len);
    head += need;
    header_->head.store(head, std::memory_order_release);
    header_->data_seq.fetch_add(1, std::memory_order_release);
    // Pairs with SetWakeOnData's fence: either this sees the flag, or the consumer's look after
    // setting it sees this frame.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (header_->wake_on_data.load(std::memory_order_relaxed) != 0) {
      FutexWake(&header_->data_seq);
      data_wakes_.fetch_add(1, std::memory_order_relaxed);
    }
    offset += len;
  } while (offset < data.size());
  return absl::OkStatus();
}

void ShmRing::WakeProducer() {
  header_->space_seq.fetch_add(1, std::memory_order_release);
  FutexWake(&header_->space_seq);
}

void ShmRing::WakeConsumer() {
  header_->data_seq.fetch_add(1, std::memory_order_release);
  FutexWake(&header_->data_seq);
}

void ShmRing::SetWakeOnData(bool on) {
  header_->wake_on_data.store(on ? 1 : 0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

bool ShmRing::ProducerNeedsRoom(uint64_t tail) const {
  const uint64_t needs = header_->producer_needs.load(std::memory_order_acquire);
  return needs > 0 && capacity_ - (header_->head.load(std::memory_order_acquire) - tail) < needs;
}

uint32_t ShmRing::DataSeq() const { return header_->data_seq.load(std::memory_order_acquire); }

void ShmRing::WaitForData(uint32_t seq, absl::Duration timeout) {
  FutexWait(&header_->data_seq, seq, timeout);
}

absl::Status ShmRing::Drain(absl::Duration timeout, Consumer& consumer) {
  const uint32_t seq = DataSeq();  // before the frames: a wake meanwhile ends the wait at once
  bool idle = false;
  if (absl::Status s = Consume(consumer, &idle); !s.ok()) return s;
  if (idle) WaitForData(seq, timeout);
  return absl::OkStatus();
}

absl::Status ShmRing::Consume(Consumer& consumer, bool* idle) {
  uint64_t tail = header_->tail.load(std::memory_order_relaxed);  // only this side writes it
  const uint64_t head = header_->head.load(std::memory_order_acquire);
  bool deferred = false;
  while (tail != head) {
    FrameHeader frame;
    CopyOut(tail, &frame, sizeof(frame));
    const uint64_t size = sizeof(frame) + Pad8(frame.len);
    if (size > head - tail || frame.len > frame.total || (frame.flags & ~(kFirst | kLast)) != 0) {
      return absl::DataLossError(absl::StrCat(
          "corrupt frame in shared-memory ring ", name_, " at byte ", tail, ": ", frame.len, " of ",
          frame.total, " bytes, flags ", frame.flags, ", ", head - tail, " bytes written"));
    }
    const bool whole = (frame.flags & (kFirst | kLast)) == (kFirst | kLast);
    // A message's first frame drops whatever an abandoned Write left before it.
    if (frame.flags & kFirst) {
      partial_.clear();
      in_message_ = false;
    }
    bool deliver = false;
    if (const RecvSink* sink =
            whole ? consumer.BeginInPlace(frame.epoch, frame.tag, frame.len) : nullptr) {
      ReadPieces(tail + sizeof(frame), frame.len, *sink);  // two pieces when it wraps
      consumer.EndInPlace();
    } else if (whole && !ProducerNeedsRoom(tail) && consumer.Defer(frame.tag)) {
      deferred = true;
      break;
    } else {
      if (frame.flags & kFirst) {
        partial_.reserve(frame.total);
        partial_tag_ = frame.tag;
        partial_epoch_ = frame.epoch;
        in_message_ = true;
      }
      if (in_message_) {
        ReadPieces(tail + sizeof(frame), frame.len,
                   [this](size_t, const char* piece, size_t n) { partial_.append(piece, n); });
      }
      deliver = in_message_ && (frame.flags & kLast);
    }
    tail += size;
    header_->tail.store(tail, std::memory_order_release);
    // A producer sleeps only after flagging the room it waits for (Write): wake it then, and
    // spare the futex call, a system call per message, otherwise.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (header_->producer_needs.load(std::memory_order_relaxed) != 0) {
      WakeProducer();
      space_wakes_.fetch_add(1, std::memory_order_relaxed);
    }
    if (deliver) {
      in_message_ = false;
      consumer.Deliver(partial_epoch_, partial_tag_, std::move(partial_));
      partial_ = std::string();
    }
  }
  *idle = tail == head || deferred;
  return absl::OkStatus();
}

}  // namespace meshrun
