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

}  // namespace
}  // namespace meshrun
