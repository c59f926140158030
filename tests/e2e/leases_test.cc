// Client leases on real processes (server/client_leases.h): a client killed mid-workload has its
// job cancelled at once and its arrays freed once its lease runs out; the cluster then serves the
// next client.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "meshrun/client.h"
#include "meshrun/local_cluster.h"

extern char** environ;

namespace meshrun {
namespace {

pid_t SpawnQuiet(const std::vector<std::string>& args, const std::string& log) {
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  pid_t pid = -1;
  if (posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ) != 0) pid = -1;
  posix_spawn_file_actions_destroy(&actions);
  return pid;
}

// Arrays owned by a client session (ListArrays' owner), and the state of the job.
int OwnedArrays(Client& client) {
  auto arrays = client.ListArrays();
  EXPECT_TRUE(arrays.ok()) << arrays.status();
  int owned = 0;
  if (arrays.ok()) {
    for (const auto& a : *arrays) owned += !a.owner().empty();
  }
  return owned;
}

std::string JobState(Client& client) {
  auto status = client.GetStatus();
  return status.ok() ? status->job_state() : std::string(status.status().message());
}

TEST(ClientLeaseTest, AKilledClientsJobStopsAtOnceAndItsArraysGoAfterTheLease) {
  LocalClusterOptions o;
  o.mesh = "data=4";
  // The client touches its lease every third of it (Client::KeepAliveLoop), so the lease runs
  // out between kLease * 2 / 3 and kLease after the kill.
  const absl::Duration kLease = absl::Seconds(4);
  o.client_lease = kLease;
  o.log_dir = absl::StrCat(::testing::TempDir(), "/meshrun-leases-", getpid());
  auto cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto watcher = Client::Connect((*cluster)->coordinator_address());
  ASSERT_TRUE(watcher.ok()) << watcher.status();
  // A workload run from the CLI: it puts its batch (arrays of its session) and trains "forever".
  const pid_t cli =
      SpawnQuiet({ExecutableDir() + "/meshrun", "train", "--workload", "mlp", "--steps", "1000000",
                  "--coordinator", (*cluster)->coordinator_address()},
                 o.log_dir + "/cli.log");
  ASSERT_GT(cli, 0);
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  int64_t step = 0;
  while (absl::Now() < deadline && step < 5) {
    auto status = (*watcher)->GetStatus();
    if (status.ok() && status->job_state() == "running") step = status->job_step();
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_GE(step, 5) << "the workload never ran; see " << o.log_dir << "/cli.log";
  const int owned = OwnedArrays(**watcher);
  EXPECT_GT(owned, 0) << "the workload's batch belongs to its session";

  ASSERT_EQ(kill(cli, SIGKILL), 0);
  ASSERT_EQ(waitpid(cli, nullptr, 0), cli);
  const absl::Time killed = absl::Now();
  while (JobState(**watcher) == "running" && absl::Now() - killed < absl::Seconds(30))
    absl::SleepFor(absl::Milliseconds(20));
  const absl::Duration to_stop = absl::Now() - killed;
  EXPECT_EQ(JobState(**watcher), "failed");
  EXPECT_LT(to_stop, absl::Seconds(2)) << "cancelled at once, not at the next report";
  auto status = (*watcher)->GetStatus();
  ASSERT_TRUE(status.ok());
  EXPECT_THAT(status->last_error(), ::testing::HasSubstr("cancelled"));

  // Within the lease the arrays stay (the client might come back); after it they are gone.
  EXPECT_EQ(OwnedArrays(**watcher), owned);
  while (OwnedArrays(**watcher) > 0 && absl::Now() - killed < absl::Seconds(15))
    absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(OwnedArrays(**watcher), 0);
  EXPECT_GE(absl::Now() - killed, kLease * 2 / 3) << "not before the lease ran out";

  // The next client's run is neither refused nor disturbed.
  JobConfig next;
  next.model.name = "mlp";
  next.data.dataset = "synthetic";
  next.train.max_steps = 3;
  auto result = (*watcher)->Train(next);
  EXPECT_TRUE(result.ok()) << result.status();
  ASSERT_TRUE((*cluster)->Stop().ok());
}

}  // namespace
}  // namespace meshrun
