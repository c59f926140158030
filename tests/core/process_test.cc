// ProcessAlive: this process is alive; a child that exited is dead both as a zombie (not yet
// reaped) and once reaped; an unknown pid is taken as alive.
#include "core/port/process.h"

#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace meshrun {
namespace {

TEST(ProcessAliveTest, LiveZombieReapedAndUnknown) {
  EXPECT_TRUE(ProcessAlive(getpid()));
  EXPECT_TRUE(ProcessAlive(0)) << "unknown: the caller relies on its deadline";
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    char c;
    close(pipe_fds[1]);
    (void)!read(pipe_fds[0], &c, 1);  // wait for the parent's word
    _exit(0);
  }
  close(pipe_fds[0]);
  EXPECT_TRUE(ProcessAlive(child));
  ASSERT_EQ(write(pipe_fds[1], "x", 1), 1);
  close(pipe_fds[1]);
  siginfo_t info{};
  ASSERT_EQ(waitid(P_PID, child, &info, WEXITED | WNOWAIT), 0);  // exited, still a zombie
  EXPECT_FALSE(ProcessAlive(child)) << "a zombie will never run again";
  ASSERT_EQ(waitpid(child, nullptr, 0), child);
  EXPECT_FALSE(ProcessAlive(child));
}

// ProcessIdentity names this very process: observed as running here; the same pid with another
// start time (a reused pid) is gone; another host's or pid namespace's identity, or none, is
// unknown (not observable from here).
TEST(ProcessIdentityTest, ObservedOnlyWhereItMeansTheSameProcess) {
  const std::string self = ProcessIdentity(getpid());
  ASSERT_FALSE(self.empty());
  EXPECT_EQ(ObserveProcess(self), ProcessState::kRunning);
  const size_t last = self.rfind('/');
  EXPECT_EQ(ObserveProcess(self.substr(0, last + 1) + "1"), ProcessState::kGone)
      << "another start time: the pid now names another process";
  EXPECT_EQ(ObserveProcess("00000000-0000-0000-0000-000000000000" + self.substr(self.find('/'))),
            ProcessState::kUnknown)
      << "another boot id";
  EXPECT_EQ(ObserveProcess(""), ProcessState::kUnknown);
  EXPECT_EQ(ObserveProcess("garbage"), ProcessState::kUnknown);
}

// WatchOomKills finds the counter of the process's memory cgroup (v1, then v2, then the host's
// /proc/vmstat) under a fake root, and OomKilledSince sees the count grow.
TEST(OomKillWatchTest, FindsTheMemoryCgroupsCounterAndSeesItGrow) {
  const std::filesystem::path root =
      std::filesystem::path(::testing::TempDir()) / absl::StrCat("oom-root-", getpid());
  std::filesystem::remove_all(root);
  const auto write = [&](const std::string& rel, const std::string& text) {
    std::filesystem::create_directories((root / rel).parent_path());
    std::ofstream(root / rel) << text;
  };
  write("proc/7/cgroup", "4:memory:/jobs/w1\n1:cpu:/\n0::/\n");
  write("sys/fs/cgroup/memory/jobs/w1/memory.oom_control",
        "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n");
  write("proc/vmstat", "nr_free_pages 5\noom_kill 9\n");
  OomKillWatch v1 = WatchOomKills(7, root.string());
  EXPECT_EQ(v1.counter, (root / "sys/fs/cgroup/memory/jobs/w1/memory.oom_control").string());
  EXPECT_EQ(v1.kills, 2);
  EXPECT_FALSE(OomKilledSince(v1));
  write("sys/fs/cgroup/memory/jobs/w1/memory.oom_control", "oom_kill_disable 0\noom_kill 3\n");
  EXPECT_TRUE(OomKilledSince(v1));

  write("proc/8/cgroup", "0::/user.slice/w2\n");
  write("sys/fs/cgroup/user.slice/w2/memory.events", "low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n");
  OomKillWatch v2 = WatchOomKills(8, root.string());
  EXPECT_EQ(v2.counter, (root / "sys/fs/cgroup/user.slice/w2/memory.events").string());
  EXPECT_EQ(v2.kills, 1);

  write("proc/9/cgroup", "0::/nowhere\n");  // no readable cgroup file: the host's count
  OomKillWatch host = WatchOomKills(9, root.string());
  EXPECT_EQ(host.counter, (root / "proc/vmstat").string());
  EXPECT_EQ(host.kills, 9);

  OomKillWatch none = WatchOomKills(10, root.string());  // no such process
  EXPECT_EQ(none.kills, -1);
  EXPECT_FALSE(OomKilledSince(none));
  std::filesystem::remove_all(root);
}

// The resident set of this process, in bytes, grows by what it touches; its peak is at least it.
TEST(ProcessStatusBytesTest, ReadsTheResidentSetAndItsPeak) {
  const int64_t before = ProcessStatusBytes(getpid(), "VmRSS");
  ASSERT_GT(before, 0);
  std::vector<char> touched(64 << 20, 1);  // 64 MiB, every page written
  const int64_t after = ProcessStatusBytes(getpid(), "VmRSS");
  EXPECT_GE(after - before, int64_t{48} << 20) << "before " << before << ", after " << after;
  EXPECT_GE(ProcessStatusBytes(getpid(), "VmHWM"), after);
  EXPECT_EQ(touched[12345], 1);
  EXPECT_EQ(ProcessStatusBytes(getpid(), "NoSuchField"), -1);
  EXPECT_EQ(ProcessStatusBytes(-5, "VmRSS"), -1);
}

}  // namespace
}  // namespace meshrun
