// ProcessAlive: this process is alive; a child that exited is dead both as a zombie (not yet
// reaped) and once reaped; an unknown pid is taken as alive.
#include "core/port/process.h"

#include <sys/wait.h>
#include <unistd.h>

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

}  // namespace
}  // namespace meshrun
