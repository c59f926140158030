// Memory that the workers on one host can map: a worker's large arrays live in memfd segments
// here, so that a co-located peer's single-copy collective (PeerMemory in
// core/collectives/transport.h, direct_all_reduce.h) reads and writes them where they lie, as
// Open MPI's XPMEM path maps a peer process's pages and NCCL's P2P transport a peer GPU's buffer.
//
// Each allocation is one segment: memfd_create("meshrun-tensor-<id>"), sized to whole pages and
// mapped shared. A freed segment goes back to a pool and is reused for the next allocation of the
// same rounded size (a step's buffers repeat every step, so they are neither unmapped nor faulted
// in again); idle segments beyond `max_idle_bytes` are closed. A segment's fd stays open while it
// lives: a peer maps it through /proc/<pid>/fd/<fd> (same user, as process_vm_readv needs), and
// everything is released when the process exits, so a crash leaves nothing behind.
//
// Thread-safe.
#ifndef MESHRUN_WORKER_SHM_ARENA_H_
#define MESHRUN_WORKER_SHM_ARENA_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace meshrun {

class ShmArena {
 public:
  struct Options {
    // Idle pooled segments are closed once they add up to more than this.
    size_t max_idle_bytes = size_t{1} << 30;
  };
  explicit ShmArena(const Options& options);
  // Unmaps the pool and every peer mapping. REQUIRES: no memory it handed out is still in use.
  ~ShmArena();
  ShmArena(const ShmArena&) = delete;
  ShmArena& operator=(const ShmArena&) = delete;

  // At least `bytes` of page-aligned shared memory, contents unspecified, returned to the pool
  // when the last copy of the pointer goes. Null if the segment cannot be made (no memfd, no
  // room, out of file descriptors): the caller falls back to the heap.
  std::shared_ptr<void> Allocate(size_t bytes);

  // A handle for [data, data + size) if it lies within one live segment of this arena, else "".
  std::string Export(const void* data, size_t size) const;

  // This process's address for `handle`, exported by the arena of process `pid` on this host.
  // The segment is mapped at the first Import and the mapping kept (checked against its owner
  // now and then, and dropped once the owner has closed it), so the address stays valid while
  // the owner keeps the exported memory alive. Errors: InvalidArgument for a malformed handle;
  // Unavailable if the process or its segment is gone or cannot be mapped.
  absl::StatusOr<void*> Import(int64_t pid, absl::string_view handle);

  // Segments live (in use or pooled), and those of other processes mapped here.
  int live_segments() const;
  int imported_segments() const;

 private:
  struct Segment {
    uint64_t id;
    int fd;
    char* base;
    size_t size;
  };
  struct Imported {
    int fd;  // the owner's fd number, to check that it still names this segment
    char* base;
    size_t size;
  };
  void Release(char* base);
  void Close(const Segment& s);
  // Unmaps imported segments whose owners closed them. REQUIRES: mu_ held.
  void SweepImportedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // (owner pid, owner arena's nonce, segment id)
  using Key = std::tuple<int64_t, uint64_t, uint64_t>;

  const Options options_;
  const uint64_t nonce_;  // random per arena: names its segments apart from any other process's
  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uintptr_t, Segment> live_ ABSL_GUARDED_BY(mu_);  // by base address, in use or idle
  std::multimap<size_t, char*> idle_ ABSL_GUARDED_BY(mu_);  // by size
  size_t idle_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<Key, Imported> imported_ ABSL_GUARDED_BY(mu_);
  int imports_since_sweep_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace meshrun

#endif  // MESHRUN_WORKER_SHM_ARENA_H_
