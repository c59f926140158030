#include "worker/shm_arena.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace meshrun {
namespace {

constexpr size_t kPage = 4096;
constexpr int kSweepEvery = 256;

// A segment's name: its arena's nonce (so a later process that reuses a pid is not mistaken for
// the one that exited) and its id within the arena.
std::string SegmentName(uint64_t nonce, uint64_t id) {
  return absl::StrCat("meshrun-tensor-", absl::Hex(nonce), "-", id);
}

// What /proc/<pid>/fd/<fd> links to while that fd is the segment.
std::string LinkTarget(uint64_t nonce, uint64_t id) {
  return absl::StrCat("/memfd:", SegmentName(nonce, id), " (deleted)");
}

std::string FdPath(int64_t pid, int fd) { return absl::StrCat("/proc/", pid, "/fd/", fd); }

bool LinksTo(const std::string& path, const std::string& target) {
  char buf[256];
  const ssize_t n = readlink(path.c_str(), buf, sizeof(buf));
  return n > 0 && std::string(buf, static_cast<size_t>(n)) == target;
}

// Segments hold one fd each: allow as many open files as the hard limit does.
void RaiseFileLimit() {
  rlimit limit;
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    setrlimit(RLIMIT_NOFILE, &limit);
  }
}

}  // namespace

ShmArena::ShmArena(const Options& options)
    : options_(options),
      nonce_(std::random_device()() * uint64_t{0x100000000} + std::random_device()()) {
  RaiseFileLimit();
}

ShmArena::~ShmArena() {
  absl::MutexLock lock(&mu_);
  for (const auto& [base, s] : live_) Close(s);
  for (const auto& [key, m] : imported_) munmap(m.base, m.size);
}

std::shared_ptr<void> ShmArena::Allocate(size_t bytes) {
  const size_t size = std::max(kPage, (bytes + kPage - 1) / kPage * kPage);
  char* base = nullptr;
  uint64_t id = 0;
  {
    absl::MutexLock lock(&mu_);
    if (auto it = idle_.find(size); it != idle_.end()) {
      base = it->second;
      idle_.erase(it);
      idle_bytes_ -= size;
    } else {
      id = next_id_++;
    }
  }
  if (base == nullptr) {
    const int fd = memfd_create(SegmentName(nonce_, id).c_str(), MFD_CLOEXEC);
    if (fd < 0) return nullptr;
    if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
      close(fd);
      return nullptr;
    }
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      close(fd);
      return nullptr;
    }
    base = static_cast<char*>(p);
    absl::MutexLock lock(&mu_);
    live_[reinterpret_cast<uintptr_t>(base)] = Segment{id, fd, base, size};
  }
  return std::shared_ptr<void>(base, [this](void* p) { Release(static_cast<char*>(p)); });
}

void ShmArena::Release(char* base) {
  absl::MutexLock lock(&mu_);
  auto it = live_.find(reinterpret_cast<uintptr_t>(base));
  if (it == live_.end()) return;
  const Segment s = it->second;
  if (idle_bytes_ + s.size > options_.max_idle_bytes) {
    Close(s);
    live_.erase(it);
    return;
  }
  idle_.emplace(s.size, base);
  idle_bytes_ += s.size;
}

void ShmArena::Close(const Segment& s) {
  munmap(s.base, s.size);
  close(s.fd);
}

std::string ShmArena::Export(const void* data, size_t size) const {
  const uintptr_t p = reinterpret_cast<uintptr_t>(data);
  absl::MutexLock lock(&mu_);
  auto it = live_.upper_bound(p);
  if (it == live_.begin()) return "";
  --it;
  const Segment& s = it->second;
  if (p < it->first || p + size > it->first + s.size) return "";
  return absl::StrCat(absl::Hex(nonce_), ":", s.id, ":", s.fd, ":", s.size, ":", p - it->first);
}

absl::StatusOr<void*> ShmArena::Import(int64_t pid, absl::string_view handle) {
  std::vector<absl::string_view> parts = absl::StrSplit(handle, ':');
  uint64_t nonce = 0, id = 0, size = 0, offset = 0;
  int fd = -1;
  if (parts.size() != 5 || !absl::SimpleHexAtoi(parts[0], &nonce) ||
      !absl::SimpleAtoi(parts[1], &id) || !absl::SimpleAtoi(parts[2], &fd) ||
      !absl::SimpleAtoi(parts[3], &size) || !absl::SimpleAtoi(parts[4], &offset) || offset > size) {
    return absl::InvalidArgumentError(absl::StrCat("malformed shared-memory handle '", handle,
                                                   "'; expected nonce:id:fd:size:offset"));
  }
  absl::MutexLock lock(&mu_);
  if (++imports_since_sweep_ >= kSweepEvery) SweepImportedLocked();
  const Key key{pid, nonce, id};
  auto it = imported_.find(key);
  if (it == imported_.end()) {
    const std::string path = FdPath(pid, fd);
    if (!LinksTo(path, LinkTarget(nonce, id))) {
      return absl::UnavailableError(absl::StrCat("process ", pid, " has no shared segment ", id,
                                                 " at fd ", fd, " (it exited or freed it)"));
    }
    const int local = open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (local < 0) {
      return absl::UnavailableError(
          absl::StrCat("cannot open ", path, " of process ", pid, ": ", std::strerror(errno)));
    }
    struct stat st;
    void* p = MAP_FAILED;
    if (fstat(local, &st) == 0 && static_cast<uint64_t>(st.st_size) == size) {
      p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, local, 0);
    }
    const int saved_errno = errno;
    close(local);
    if (p == MAP_FAILED) {
      return absl::UnavailableError(absl::StrCat("cannot map segment ", id, " of process ", pid,
                                                 " (", size,
                                                 " bytes): ", std::strerror(saved_errno)));
    }
    it = imported_.emplace(key, Imported{fd, static_cast<char*>(p), size}).first;
  }
  return static_cast<void*>(it->second.base + offset);
}

void ShmArena::SweepImportedLocked() {
  imports_since_sweep_ = 0;
  for (auto it = imported_.begin(); it != imported_.end();) {
    const auto& [pid, nonce, id] = it->first;
    if (LinksTo(FdPath(pid, it->second.fd), LinkTarget(nonce, id))) {
      ++it;
      continue;
    }
    munmap(it->second.base, it->second.size);
    it = imported_.erase(it);
  }
}

int ShmArena::live_segments() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(live_.size());
}

int ShmArena::imported_segments() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(imported_.size());
}

}  // namespace meshrun
