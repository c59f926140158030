// Cluster membership with real processes, started one by one (no LocalCluster): workers that give
// up on a mesh that never fills, or die while they wait, leave no registration behind, so fresh
// workers form the mesh (issue 21: "3 of 4 workers join and leave, then 4 fresh ones form the
// mesh"), and a rank a live worker holds is refused naming it.
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "meshrun/client.h"
#include "meshrun/local_cluster.h"
#include "net/credentials.h"
#include "tests/testutil/process_util.h"

namespace meshrun {
namespace {

namespace fs = std::filesystem;
using ::meshrun::testing::ProcessExists;
using ::meshrun::testing::ReadFile;

// Starts `argv` with its output appended to `log`; it dies with this process.
pid_t Spawn(const std::vector<std::string>& argv, const std::string& log) {
  const pid_t pid = fork();
  if (pid != 0) return pid;
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  dup2(fd, 1);
  dup2(fd, 2);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  execv(args[0], args.data());
  _exit(127);
}

void KillAndReap(pid_t pid) {
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
}

class MembershipTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SetProcessCredentials(Credentials::Insecure());
    dir_ = fs::path(::testing::TempDir()) / absl::StrCat("meshrun-membership-", getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    const std::string port_file = (dir_ / "port").string();
    coordinator_ = Spawn({ExecutableDir() + "/meshrun-coordinator", "--mesh=data=4", "--port=0",
                          "--port_file=" + port_file, "--insecure", "--metrics_port=-1"},
                         (dir_ / "coordinator.log").string());
    int port = 0;
    for (int i = 0; i < 200 && port == 0; ++i) {
      if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(ReadFile(port_file)), &port)) port = 0;
      if (port == 0) usleep(50000);
    }
    ASSERT_NE(port, 0) << "the coordinator wrote no port: "
                       << ReadFile((dir_ / "coordinator.log").string());
    address_ = absl::StrCat("127.0.0.1:", port);
  }
  void TearDown() override {
    for (pid_t p : workers_) KillAndReap(p);
    if (coordinator_ > 0) KillAndReap(coordinator_);
    fs::remove_all(dir_);
  }
  // A worker of this cluster that gives up joining after `join_timeout`.
  pid_t StartWorker(const std::string& join_timeout, const std::string& tag) {
    const pid_t pid =
        Spawn({ExecutableDir() + "/meshrun-worker", "--coordinator=" + address_, "--port=0",
               "--insecure", "--metrics_port=-1", "--join_timeout=" + join_timeout},
              (dir_ / absl::StrCat("worker-", tag, ".log")).string());
    workers_.push_back(pid);
    return pid;
  }

  // Waits until the 4 workers have formed the mesh; their status in `status`.
  void WaitUntilFormed(Client& client, v1::GetStatusResponse* status) {
    const absl::Status formed = client.WaitForWorkers(absl::Seconds(30));
    ASSERT_TRUE(formed.ok()) << formed << "\n" << ReadFile((dir_ / "coordinator.log").string());
    absl::StatusOr<v1::GetStatusResponse> s = client.GetStatus();
    ASSERT_TRUE(s.ok()) << s.status();
    ASSERT_EQ(s->workers_size(), 4);
    *status = *std::move(s);
  }

  fs::path dir_;
  pid_t coordinator_ = -1;
  std::string address_;
  std::vector<pid_t> workers_;
};

TEST_F(MembershipTest, WorkersThatLeaveAnIncompleteMeshFreeTheirRanksForFreshOnes) {
  // 3 of 4: two give up at their join deadline, one is killed while it waits.
  const pid_t gives_up_1 = StartWorker("3s", "a"), gives_up_2 = StartWorker("3s", "b");
  const pid_t killed = StartWorker("60s", "c");
  auto client = Client::Connect(address_);
  ASSERT_TRUE(client.ok()) << client.status();
  for (int i = 0; i < 100; ++i) {  // all three registered
    absl::StatusOr<v1::GetStatusResponse> s = (*client)->GetStatus();
    ASSERT_TRUE(s.ok()) << s.status();
    if (s->workers_size() == 3) break;
    usleep(50000);
  }
  absl::StatusOr<v1::GetStatusResponse> three = (*client)->GetStatus();
  ASSERT_TRUE(three.ok()) << three.status();
  EXPECT_EQ(three->workers_size(), 3);
  KillAndReap(killed);
  for (pid_t p : {gives_up_1, gives_up_2}) {
    int status = 0;
    ASSERT_EQ(waitpid(p, &status, 0), p);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << "pid " << p << " gave up";
  }
  workers_.clear();
  EXPECT_THAT(ReadFile((dir_ / "worker-a.log").string()),
              ::testing::HasSubstr("could not join the cluster"));

  // 4 fresh workers form the mesh and it trains.
  for (int i = 0; i < 4; ++i) StartWorker("60s", absl::StrCat("fresh", i));
  v1::GetStatusResponse four;
  ASSERT_NO_FATAL_FAILURE(WaitUntilFormed(**client, &four));
  for (const auto& w : four.workers()) {
    EXPECT_TRUE(w.alive());
    EXPECT_NE(w.peer().pid(), killed);
    EXPECT_TRUE(ProcessExists(static_cast<pid_t>(w.peer().pid())));
  }
  JobConfig config;
  config.train.max_steps = 3;
  config.train.evaluate = false;
  auto result = (*client)->Train(config);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->reports.back().step(), 3);

  // A worker asking for a rank a live worker holds is refused, naming the holder, and the
  // cluster keeps its members and trains.
  const std::string holder = four.workers(2).peer().address();
  auto r = testing::RunCommand(
      {ExecutableDir() + "/meshrun-worker", "--coordinator=" + address_, "--port=0", "--rank=2",
       "--insecure", "--metrics_port=-1", "--join_timeout=3s"},
      30);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.output, ::testing::HasSubstr("requested rank 2 is taken by " + holder));
  result = (*client)->Train(config);
  ASSERT_TRUE(result.ok()) << result.status();
  absl::StatusOr<v1::GetStatusResponse> after = (*client)->GetStatus();
  ASSERT_TRUE(after.ok()) << after.status();
  for (int i = 0; i < 4; ++i)
    EXPECT_EQ(after->workers(i).peer().pid(), four.workers(i).peer().pid()) << "rank " << i;
}

// A worker's grpc.health.v1 server answers as soon as it starts, but its `meshrun.v1.Worker`
// service is SERVING only once it has joined: the coordinator's probe after a failure does not
// take a process restarted at a lost worker's address, still registering, for the lost worker.
TEST_F(MembershipTest, AWorkersHealthServiceServesOnlyOnceItHasJoined) {
  const std::string cli = ExecutableDir() + "/meshrun";
  setenv(kInsecureEnv, "1", 1);  // the CLI reaches these --insecure workers
  for (int i = 0; i < 3; ++i) StartWorker("60s", absl::StrCat("early", i));
  auto client = Client::Connect(address_);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<v1::GetStatusResponse> three;
  for (int i = 0; i < 200; ++i) {  // registered, waiting for the fourth
    three = (*client)->GetStatus();
    ASSERT_TRUE(three.ok()) << three.status();
    if (three->workers_size() == 3) break;
    usleep(50000);
  }
  ASSERT_EQ(three->workers_size(), 3);
  for (const auto& w : three->workers()) {
    const std::string addr = w.peer().address();
    auto up = testing::RunCommand({cli, "health", "--addr", addr}, 30);
    EXPECT_EQ(up.exit_code, 0) << addr << ": " << up.output;
    auto joined =
        testing::RunCommand({cli, "health", "--addr", addr, "--service", "meshrun.v1.Worker"}, 30);
    EXPECT_NE(joined.exit_code, 0) << addr << ": " << joined.output;
    EXPECT_THAT(joined.output, ::testing::HasSubstr("health check of " + addr));
  }
  StartWorker("60s", "last");
  v1::GetStatusResponse four;
  ASSERT_NO_FATAL_FAILURE(WaitUntilFormed(**client, &four));
  for (const auto& w : four.workers()) {
    const std::string addr = w.peer().address();
    // Join follows registration by a moment: poll briefly.
    testing::CommandResult joined;
    for (int i = 0; i < 50; ++i) {
      joined = testing::RunCommand(
          {cli, "health", "--addr", addr, "--service", "meshrun.v1.Worker"}, 30);
      if (joined.exit_code == 0) break;
      usleep(100000);
    }
    EXPECT_EQ(joined.exit_code, 0) << addr << ": " << joined.output;
    EXPECT_THAT(joined.output, ::testing::HasSubstr("SERVING"));
  }
}

}  // namespace
}  // namespace meshrun
