// ShmArena: pooled memfd segments that another process maps through /proc/<pid>/fd.
#include "worker/shm_arena.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "absl/strings/str_split.h"
#include "core/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace meshrun {
namespace {

using ::testing::HasSubstr;

TEST(ShmArenaTest, AFreedSegmentIsReusedForTheSameSizeAndIdleOnesPastTheCapAreClosed) {
  ShmArena::Options o;
  o.max_idle_bytes = 1 << 20;
  ShmArena arena(o);
  void* first = arena.Allocate(1 << 20).get();  // freed at once: pooled
  EXPECT_EQ(arena.live_segments(), 1);
  std::shared_ptr<void> again = arena.Allocate((1 << 20) - 100);  // same whole pages
  EXPECT_EQ(again.get(), first);
  std::shared_ptr<void> other = arena.Allocate(3 << 20);
  EXPECT_NE(other.get(), first);
  EXPECT_EQ(arena.live_segments(), 2);
  again.reset();  // 1 MiB idle: within the cap
  other.reset();  // 3 MiB more would pass it: closed
  EXPECT_EQ(arena.live_segments(), 1);
}

TEST(ShmArenaTest, ExportCoversOnlyRangesInsideOneLiveSegment) {
  ShmArena arena{ShmArena::Options()};
  std::shared_ptr<void> seg = arena.Allocate(8192);
  char* base = static_cast<char*>(seg.get());
  EXPECT_NE(arena.Export(base, 8192), "");
  EXPECT_NE(arena.Export(base + 100, 50), "");
  EXPECT_EQ(arena.Export(base + 100, 8192), "");  // runs past its end
  std::vector<char> heap(64);
  EXPECT_EQ(arena.Export(heap.data(), heap.size()), "");
}

TEST(ShmArenaTest, AnImportedHandleIsTheSameMemoryAtAnotherAddress) {
  ShmArena owner{ShmArena::Options()}, peer{ShmArena::Options()};
  std::shared_ptr<void> seg = owner.Allocate(1 << 16);
  int* mine = static_cast<int*>(seg.get());
  absl::StatusOr<void*> theirs = peer.Import(getpid(), owner.Export(mine + 10, 40));
  ASSERT_TRUE(theirs.ok()) << theirs.status();
  EXPECT_NE(*theirs, static_cast<void*>(mine + 10));  // a second mapping of the segment
  static_cast<int*>(*theirs)[0] = 1234;
  EXPECT_EQ(mine[10], 1234);
  mine[11] = 99;
  EXPECT_EQ(static_cast<int*>(*theirs)[1], 99);
  EXPECT_EQ(peer.imported_segments(), 1);
  ASSERT_TRUE(peer.Import(getpid(), owner.Export(mine, 4)).ok());
  EXPECT_EQ(peer.imported_segments(), 1);  // the mapping is kept and reused
}

TEST(ShmArenaTest, AChildProcessWritesTheParentsSegmentThroughItsHandle) {
  ShmArena arena{ShmArena::Options()};
  std::shared_ptr<void> seg = arena.Allocate(1 << 20);
  float* data = static_cast<float*>(seg.get());
  std::fill_n(data, (1 << 20) / 4, 0.0f);
  const std::string handle = arena.Export(data, 1 << 20);
  const pid_t parent = getpid();
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ShmArena mine{ShmArena::Options()};
    absl::StatusOr<void*> p = mine.Import(parent, handle);
    if (!p.ok()) _exit(2);
    float* theirs = static_cast<float*>(*p);
    for (int i = 0; i < (1 << 20) / 4; ++i) theirs[i] = static_cast<float>(i);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  EXPECT_EQ(data[0], 0.0f);
  EXPECT_EQ(data[12345], 12345.0f);
  EXPECT_EQ(data[(1 << 20) / 4 - 1], (1 << 20) / 4 - 1.0f);
}

TEST(ShmArenaTest, MalformedAndStaleHandlesAreRefusedNamingWhatIsWrong) {
  ShmArena owner{ShmArena::Options{0}}, peer{ShmArena::Options()};  // nothing kept idle
  EXPECT_THAT(peer.Import(getpid(), "not-a-handle").status().message(),
              HasSubstr("malformed shared-memory handle"));
  std::string handle;
  {
    std::shared_ptr<void> seg = owner.Allocate(4096);
    handle = owner.Export(seg.get(), 4096);
  }  // freed and, with no idle room, closed
  absl::StatusOr<void*> stale = peer.Import(getpid(), handle);
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(stale.status().message(), HasSubstr("has no shared segment"));
  // A handle of a process that does not exist.
  std::shared_ptr<void> live = owner.Allocate(4096);
  EXPECT_EQ(peer.Import(1 << 30, owner.Export(live.get(), 4096)).status().code(),
            absl::StatusCode::kUnavailable);
}

TEST(ShmArenaTest, LargeTensorsComeFromTheInstalledAllocatorAndSmallOnesFromTheHeap) {
  ShmArena arena{ShmArena::Options()};
  SetLargeTensorAllocator(1 << 16, [&arena](size_t bytes) { return arena.Allocate(bytes); });
  Tensor large(v1::DTYPE_F32, {1 << 16});  // 256 KiB
  Tensor small(v1::DTYPE_F32, {16});
  EXPECT_NE(arena.Export(large.raw(), large.size_bytes()), "");
  EXPECT_EQ(arena.Export(small.raw(), small.size_bytes()), "");
  EXPECT_EQ(large.data<float>()[(1 << 16) - 1], 0.0f);  // zero-filled as ever
  Tensor copy = large;
  EXPECT_NE(arena.Export(copy.raw(), copy.size_bytes()), "");
  SetLargeTensorAllocator(0, nullptr);
  Tensor heap(v1::DTYPE_F32, {1 << 16});
  EXPECT_EQ(arena.Export(heap.raw(), heap.size_bytes()), "");
}

}  // namespace
}  // namespace meshrun
