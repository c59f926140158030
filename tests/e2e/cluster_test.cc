// End to end with real processes on loopback: meshrun-coordinator + meshrun-worker processes,
// driven through the client SDK and the meshrun CLI.
#include "tests/testutil/cluster.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "meshrun/client.h"
#include "meshrun/local_cluster.h"
#include "tests/testutil/process_util.h"

namespace meshrun {
namespace {

using ::meshrun::testing::ProcessExists;
using ::meshrun::testing::ReadFile;
using ::meshrun::testing::RunCommand;
using ::meshrun::testing::WriteTempFile;
using ::testing::HasSubstr;

std::unique_ptr<LocalCluster> StartCluster(const std::string& mesh) {
  return testing::StartCluster(mesh, "e2e");
}

void ExpectAllReaped(const LocalCluster& c) {
  EXPECT_FALSE(ProcessExists(c.coordinator_pid())) << "coordinator pid " << c.coordinator_pid();
  for (pid_t p : c.worker_pids()) EXPECT_FALSE(ProcessExists(p)) << "worker pid " << p;
}

// Trains `steps` steps (no evaluation) and expects them all reported.
// Connects to a restarted coordinator and waits for every worker to rejoin it, within 10 s. Null
// (the failure recorded) if they do not.
std::unique_ptr<Client> AfterRejoin(const LocalCluster& cluster) {
  const absl::Time start = absl::Now();
  auto client = Client::Connect(cluster.coordinator_address());
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return nullptr;
  const absl::Status joined = (*client)->WaitForWorkers(absl::Seconds(10));
  EXPECT_TRUE(joined.ok()) << "the workers did not rejoin: " << joined;
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  return joined.ok() ? *std::move(client) : nullptr;
}

void ExpectTrains(Client& client, int steps) {
  JobConfig config;
  config.train.max_steps = steps;
  config.train.evaluate = false;
  auto result = client.Train(config);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->reports.back().step(), steps);
}

// A job of `max_steps` run by `client` on a thread of its own; Start returns once its first step
// is reported (or it failed before one).
class BackgroundJob {
 public:
  ~BackgroundJob() {
    if (thread_.joinable()) thread_.join();  // a test that failed before Join
  }
  void Start(Client* client, int max_steps) {
    thread_ = std::thread([this, client, max_steps] {
      JobConfig config;
      config.train.max_steps = max_steps;
      config.train.evaluate = false;
      result_ = client->Train(config, [this](const v1::JobEvent& e) {
        if (e.has_step() && !stepping_.HasBeenNotified()) stepping_.Notify();
      });
      ended_ = absl::Now();
      if (!stepping_.HasBeenNotified()) stepping_.Notify();
    });
    stepping_.WaitForNotification();
  }
  // Waits for the job to end.
  const absl::StatusOr<TrainResult>& Join() {
    thread_.join();
    return result_;
  }
  // When Train returned (valid after Join).
  absl::Time ended() const { return ended_; }

 private:
  std::thread thread_;
  absl::Time ended_ = absl::InfiniteFuture();
  absl::Notification stepping_;
  absl::StatusOr<TrainResult> result_;
};

TEST(ClusterE2ETest, EightWorkersTrainOneHundredStepsAndShutDownCleanly) {
  auto cluster = StartCluster("data=8");
  ASSERT_NE(cluster, nullptr);
  auto client = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(client.ok()) << client.status();
  auto status = (*client)->GetStatus();
  ASSERT_TRUE(status.ok());
  ASSERT_EQ(status->workers_size(), 8);
  for (const auto& w : status->workers()) EXPECT_TRUE(w.alive());

  JobConfig config;
  config.train.max_steps = 100;
  config.train.log_every = 20;
  auto result = (*client)->Train(config);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->reports.size(), 5u);
  EXPECT_EQ(result->reports.back().step(), 100);
  EXPECT_GT(result->reports.front().loss(), result->reports.back().loss());
  EXPECT_LT(result->reports.back().loss(), 0.8);
  ASSERT_TRUE(result->reports.back().has_accuracy());  // a classifier's accuracy
  EXPECT_GT(result->reports.back().accuracy(), 0.5);
  EXPECT_THAT(FormatProgress(result->reports.back()), HasSubstr(" | acc 0."));
  ASSERT_TRUE(result->evaluated);
  EXPECT_EQ(result->test_examples, 10000);
  EXPECT_GT(result->test_accuracy, 0.7);

  ASSERT_TRUE(cluster->Stop().ok());
  ExpectAllReaped(*cluster);
}

// Mean loss per step with dropout off, as reported by the coordinator.
std::vector<double> LossesPerStep(const std::string& mesh, int steps) {
  auto cluster = StartCluster(mesh);
  if (cluster == nullptr) return {};
  auto client = Client::Connect(cluster->coordinator_address());
  if (!client.ok()) return {};
  JobConfig config;
  config.model.dropout_rate = 0;
  config.train.max_steps = steps;
  config.train.log_every = 1;
  config.train.evaluate = false;
  auto result = (*client)->Train(config);
  EXPECT_TRUE(result.ok()) << result.status();
  std::vector<double> losses;
  if (result.ok()) {
    for (const auto& r : result->reports) losses.push_back(r.loss());
  }
  return losses;
}

TEST(ClusterE2ETest, DataParallelEightProcessesMatchOne) {
  std::vector<double> one = LossesPerStep("data=1", 20);
  std::vector<double> eight = LossesPerStep("data=8", 20);
  ASSERT_EQ(one.size(), 20u);
  ASSERT_EQ(eight.size(), 20u);
  for (int s = 0; s < 20; ++s) {
    EXPECT_LE(std::abs(one[s] - eight[s]) / one[s], 1e-4)
        << "step " << s << ": " << one[s] << " vs " << eight[s];
  }
}

TEST(ClusterE2ETest, BadInputIsRejectedAndTheClusterKeepsServing) {
  auto cluster = StartCluster("data=2");
  ASSERT_NE(cluster, nullptr);
  const std::string cli = ExecutableDir() + "/meshrun";

  // An unknown config key, through the CLI: rejected before anything runs, naming the key.
  const std::string bad = WriteTempFile("bad-job.json", R"({"model": {"hidden": 3}})");
  auto r = RunCommand(
      {cli, "train", "--config", bad, "--coordinator", cluster->coordinator_address()}, 30);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.output, HasSubstr("unknown key 'model.hidden'"));

  // A missing dataset path: every worker fails to load; the error names the path and a rank.
  auto client = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(client.ok());
  JobConfig config;
  config.data.path = "/nonexistent/fashion";
  config.train.max_steps = 2;
  auto result = (*client)->Train(config);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(result.status().message(),
              HasSubstr("/nonexistent/fashion/train-images-idx3-ubyte.gz"));
  EXPECT_THAT(result.status().message(), HasSubstr("rank "));

  // A mesh the cluster does not have.
  config = JobConfig();
  config.mesh = {{"data", 4}};
  result = (*client)->Train(config);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(result.status().message(), HasSubstr("does not match the cluster's Mesh('data': 2)"));

  // The cluster still trains.
  ExpectTrains(**client, 5);
}

TEST(ClusterE2ETest, WorkerGivesUpOnAnAbsentCoordinatorWithAClearError) {
  // Port 1 on loopback: nobody listens there.
  auto r = RunCommand({ExecutableDir() + "/meshrun-worker", "--coordinator=127.0.0.1:1",
                       "--join_timeout=2s", "--insecure"},
                      30);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.output, HasSubstr("could not join the cluster at coordinator 127.0.0.1:1 after"));
  EXPECT_THAT(r.output, HasSubstr("retrying"));  // it backed off and retried
  EXPECT_LT(r.seconds, 10);
}

// Ports are bound exclusively: a second worker started on a live worker's port cannot take its
// traffic (or, through re-registration from that address, its rank); it exits naming the port,
// and the cluster still trains.
TEST(ClusterE2ETest, ASecondWorkerOnALiveWorkersPortIsRefused) {
  auto cluster = StartCluster("data=2");
  ASSERT_NE(cluster, nullptr);
  auto client = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<v1::GetStatusResponse> status = (*client)->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  ASSERT_EQ(status->workers_size(), 2);
  const std::string live = status->workers(1).peer().address();
  const std::string port = live.substr(live.rfind(':') + 1);
  auto r = RunCommand({ExecutableDir() + "/meshrun-worker",
                       "--coordinator=" + cluster->coordinator_address(), "--host=127.0.0.1",
                       "--port=" + port, "--join_timeout=5s", "--insecure", "--metrics_port=-1"},
                      30);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.output, HasSubstr("cannot listen on 127.0.0.1:" + port));
  EXPECT_THAT(r.output, HasSubstr("held by another process"));
  ExpectTrains(**client, 3);
}

// kill -9 the coordinator mid-job and start it again on its address: the job's client is told
// the coordinator closed the connection and at which step; the same worker processes rejoin the
// new one as their ranks (within 10 s) and the cluster trains again.
TEST(ClusterE2ETest, WorkersRejoinARestartedCoordinatorAsTheirRanks) {
  auto cluster = StartCluster("data=2");
  ASSERT_NE(cluster, nullptr);
  // Each rank's process before the restart (ranks follow arrival, not spawn order).
  std::map<int, int64_t> pid_of_rank;
  {
    auto before = Client::Connect(cluster->coordinator_address());
    ASSERT_TRUE(before.ok()) << before.status();
    absl::StatusOr<v1::GetStatusResponse> status = (*before)->GetStatus();
    ASSERT_TRUE(status.ok()) << status.status();
    for (const auto& w : status->workers()) pid_of_rank[w.peer().rank()] = w.peer().pid();
  }
  ASSERT_EQ(pid_of_rank.size(), 2u);
  // A job in flight when the coordinator dies: its client is told where the job was.
  auto job_client = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(job_client.ok()) << job_client.status();
  BackgroundJob job;
  job.Start(job_client->get(), 100000);
  ASSERT_TRUE(cluster->RestartCoordinator().ok());
  const absl::StatusOr<TrainResult>& interrupted = job.Join();
  EXPECT_EQ(interrupted.status().code(), absl::StatusCode::kUnavailable) << interrupted.status();
  EXPECT_THAT(
      interrupted.status().message(),
      HasSubstr("coordinator " + cluster->coordinator_address() + " closed the connection"));
  std::unique_ptr<Client> client = AfterRejoin(*cluster);
  ASSERT_NE(client, nullptr);
  absl::StatusOr<v1::GetStatusResponse> status = client->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  ASSERT_EQ(status->workers_size(), 2);
  for (const auto& w : status->workers()) {
    EXPECT_TRUE(w.alive());
    EXPECT_EQ(w.peer().pid(), pid_of_rank[w.peer().rank()])
        << "rank " << w.peer().rank() << " is the same process";
  }
  ExpectTrains(*client, 3);
}

// kill -9 the coordinator mid-job and start it again: the 8 workers rejoin within 10 s, the new
// coordinator reports the job interrupted with its last checkpoint (its state file), and the
// job resumed from that checkpoint finishes.
TEST(ClusterE2ETest, AJobInterruptedByACoordinatorRestartIsReportedAndResumes) {
  auto cluster = StartCluster("data=8");
  ASSERT_NE(cluster, nullptr);
  auto job_client = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(job_client.ok()) << job_client.status();
  const std::string dir = absl::StrCat(::testing::TempDir(), "/interrupted-", getpid());
  std::filesystem::remove_all(dir);
  JobConfig config;
  config.train.max_steps = 60;
  config.train.log_every = 1;
  config.train.evaluate = false;
  config.checkpoint.dir = dir;
  config.checkpoint.save_every = 10;
  bool restarted = false;
  auto interrupted = (*job_client)->Train(config, [&](const v1::JobEvent& e) {
    if (e.has_step() && e.step().step() == 25 && !restarted) {
      restarted = true;
      ASSERT_TRUE(cluster->RestartCoordinator().ok());
    }
  });
  ASSERT_TRUE(restarted);
  EXPECT_EQ(interrupted.status().code(), absl::StatusCode::kUnavailable) << interrupted.status();
  std::unique_ptr<Client> client = AfterRejoin(*cluster);
  ASSERT_NE(client, nullptr);
  absl::StatusOr<v1::GetStatusResponse> status = client->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->job_state(), "interrupted");
  EXPECT_GE(status->job_step(), 25);
  EXPECT_THAT(status->last_error(), HasSubstr("its last checkpoint is " + dir + "/step_00000020"));
  EXPECT_THAT(status->last_error(), HasSubstr("meshrun train --resume"));
  config.checkpoint.resume = true;
  auto resumed = client->Train(config);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  ASSERT_FALSE(resumed->reports.empty());
  EXPECT_EQ(resumed->reports.front().step(), 21);
  EXPECT_EQ(resumed->reports.back().step(), 60);
  std::filesystem::remove_all(dir);
}

// One job at a time: a job submitted while one runs waits its turn (first come, first served)
// and is told so; one that gives up while waiting leaves its place to the next.
TEST(ClusterE2ETest, ASecondJobWaitsItsTurnAndOneThatGivesUpLeavesTheQueue) {
  auto cluster = StartCluster("data=2");
  ASSERT_NE(cluster, nullptr);
  std::vector<std::unique_ptr<Client>> clients;
  for (int i = 0; i < 3; ++i) {
    auto c = Client::Connect(cluster->coordinator_address());
    ASSERT_TRUE(c.ok()) << c.status();
    clients.push_back(*std::move(c));
  }
  BackgroundJob first;
  first.Start(clients[0].get(), 3000);  // ~10 s: it outlasts the leaver's 3 s
  JobConfig config;
  config.train.max_steps = 3;
  config.train.evaluate = false;
  // A job queued behind the first that gives up (its deadline passes) before its turn.
  absl::Notification leaver_queued;
  absl::StatusOr<TrainResult> left;
  std::thread leaver([&] {
    left = clients[2]->Train(
        config,
        [&](const v1::JobEvent& e) {
          if (e.has_info() && !leaver_queued.HasBeenNotified()) leaver_queued.Notify();
        },
        absl::Seconds(3));
    if (!leaver_queued.HasBeenNotified()) leaver_queued.Notify();
  });
  leaver_queued.WaitForNotification();
  std::string queued_info;
  absl::Time first_step = absl::InfinitePast();
  auto second = clients[1]->Train(config, [&](const v1::JobEvent& e) {
    if (e.has_info() && queued_info.empty()) queued_info = e.info();
    if (e.has_step() && first_step == absl::InfinitePast()) first_step = absl::Now();
  });
  leaver.join();
  const absl::StatusOr<TrainResult>& running = first.Join();
  EXPECT_EQ(left.status().code(), absl::StatusCode::kDeadlineExceeded) << left.status();
  ASSERT_TRUE(running.ok()) << running.status();
  EXPECT_EQ(running->reports.back().step(), 3000) << "the first ran undisturbed";
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->reports.back().step(), 3);
  EXPECT_THAT(queued_info, HasSubstr("queued: a job is already running on this cluster ("));
  EXPECT_THAT(queued_info, HasSubstr(" and 1 more wait; this job starts when they end"));
  EXPECT_GT(first_step, first.ended() - absl::Milliseconds(500))
      << "the second job stepped only once the first had ended";
}

// With train.when_busy: refuse, a job submitted while one runs is refused at once, naming where
// the running one is; the first finishes undisturbed.
TEST(ClusterE2ETest, ASecondJobIsRefusedNamingTheRunningOne) {
  auto cluster = StartCluster("data=2");
  ASSERT_NE(cluster, nullptr);
  auto first = Client::Connect(cluster->coordinator_address());
  auto second = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(first.ok() && second.ok());
  BackgroundJob job;
  job.Start(first->get(), 300);
  JobConfig config;
  config.train.max_steps = 3;
  config.train.when_busy = "refuse";
  auto refused = (*second)->Train(config);
  const absl::StatusOr<TrainResult>& running = job.Join();
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("a job is already running on this cluster ("));
  EXPECT_THAT(refused.status().message(), HasSubstr("at step "));
  EXPECT_THAT(refused.status().message(), HasSubstr("(train.when_busy: refuse)"));
  ASSERT_TRUE(running.ok()) << running.status();
  EXPECT_EQ(running->reports.back().step(), 300);
}

// The rank the process `pid` holds (ranks follow registration order, not spawn order); -1 if none.
int RankOf(Client& client, pid_t pid) {
  auto status = client.GetStatus();
  if (!status.ok()) return -1;
  for (const auto& w : status->workers()) {
    if (w.peer().pid() == pid) return w.peer().rank();
  }
  return -1;
}

// How many of the `n` workers but the one spawned `victim`-th name `rank` in their logs.
int WorkersTold(const LocalCluster& cluster, int n, int victim, int rank) {
  int told = 0;
  for (int i = 0; i < n; ++i) {
    if (i == victim) continue;
    told += ReadFile(absl::StrCat(cluster.log_dir(), "/worker", i, ".log"))
                .find(absl::StrCat("rank ", rank)) != std::string::npos;
  }
  return told;
}

// A long job during which the process `pid` gets `signal` at the first step report: the job's
// result and the time from the signal to it.
struct SignalledJob {
  absl::StatusOr<TrainResult> result = absl::UnknownError("not run");
  absl::Duration to_error;
  bool signalled = false;
};
SignalledJob TrainAndSignalAtFirstStep(Client& client, pid_t pid, int signal) {
  JobConfig config;
  config.train.max_steps = 100000;
  config.train.log_every = 5;
  config.train.evaluate = false;
  SignalledJob job;
  absl::Time signalled_at = absl::InfiniteFuture();
  job.result = client.Train(config, [&](const v1::JobEvent& e) {
    if (e.has_step() && !job.signalled) {
      job.signalled = true;
      signalled_at = absl::Now();
      kill(pid, signal);
    }
  });
  job.to_error = absl::Now() - signalled_at;
  return job;
}

TEST(ClusterE2ETest, AWorkerDyingMidJobIsReportedByRankAndNothingHangs) {
  auto cluster = StartCluster("data=4");
  ASSERT_NE(cluster, nullptr);
  auto client = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(client.ok());
  const int victim = 2;
  const pid_t victim_pid = cluster->worker_pids()[victim];
  const SignalledJob job = TrainAndSignalAtFirstStep(**client, victim_pid, SIGKILL);
  ASSERT_TRUE(job.signalled);
  const absl::StatusOr<TrainResult>& result = job.result;
  ASSERT_FALSE(result.ok());
  EXPECT_LT(job.to_error, absl::Seconds(10));
  // Which rank got the pid is up to registration order: find the rank of the killed process.
  const int rank = RankOf(**client, victim_pid);
  ASSERT_GE(rank, 0);
  EXPECT_THAT(result.status().message(), HasSubstr(absl::StrCat("worker rank ", rank, " (")));
  auto status = (*client)->GetStatus();
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->job_state(), "failed");
  EXPECT_EQ(WorkersTold(*cluster, 4, victim, rank), 3) << "the surviving workers were told";
  ASSERT_TRUE(cluster->Stop().ok());
  ExpectAllReaped(*cluster);
}

// A worker stopped with SIGSTOP on the coordinator's host fails the run at once, named as
// stopped (the coordinator sees its process state; no waiting for missed heartbeats), and every
// other rank is told; after SIGCONT the cluster serves the next job.
TEST(ClusterE2ETest, AStoppedWorkerIsNamedAtOnceAndAfterSigcontTheClusterServes) {
  auto cluster = StartCluster("data=4");
  ASSERT_NE(cluster, nullptr);
  auto client = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(client.ok());
  const int victim = 1;
  const pid_t victim_pid = cluster->worker_pids()[victim];
  const SignalledJob job = TrainAndSignalAtFirstStep(**client, victim_pid, SIGSTOP);
  ASSERT_TRUE(job.signalled);
  const absl::StatusOr<TrainResult>& result = job.result;
  ASSERT_FALSE(result.ok());
  const int rank = RankOf(**client, victim_pid);
  ASSERT_GE(rank, 0);
  EXPECT_THAT(result.status().message(), HasSubstr(absl::StrCat("worker rank ", rank, " (")));
  EXPECT_THAT(result.status().message(), HasSubstr("is stopped (SIGSTOP)"))
      << "found by its process state, not by missed heartbeats";
  std::printf("stopped worker reported after %s\n", absl::FormatDuration(job.to_error).c_str());
  EXPECT_EQ(WorkersTold(*cluster, 4, victim, rank), 3) << "every other rank was told";
  ASSERT_EQ(kill(victim_pid, SIGCONT), 0);
  JobConfig config;
  config.train.max_steps = 5;
  config.train.evaluate = false;
  const absl::Time next_started = absl::Now();
  auto next = (*client)->Train(config);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->reports.back().step(), 5);
  // The resumed worker was never told of the abort (the coordinator could not reach it): the next
  // run's later epoch ends the collective it was stopped in, rather than its 30 s deadline.
  EXPECT_LT(absl::Now() - next_started, absl::Seconds(20))
      << "the resumed worker finished the abandoned run's collective only at its deadline";
  ASSERT_TRUE(cluster->Stop().ok());
}

}  // namespace
}  // namespace meshrun

namespace meshrun {
namespace {

// `meshrun up` as a user runs it: a real cluster, probed with `meshrun health` (grpc.health.v1)
// and `meshrun status`, then Ctrl-C: every process it started is gone.
TEST(CliE2ETest, UpServesHealthAndStatusAndCleansUpOnCtrlC) {
  const std::string cli = ExecutableDir() + "/meshrun";
  const std::string log = ::testing::TempDir() + "/meshrun-up.log";
  const int port = 50000 + getpid() % 10000;
  const std::string addr = absl::StrCat("127.0.0.1:", port);
  std::remove(log.c_str());  // a previous run's log would already say "cluster up"
  pid_t up = fork();
  if (up == 0) {
    FILE* f = freopen(log.c_str(), "w", stdout);
    (void)f;
    dup2(1, 2);
    execl(cli.c_str(), cli.c_str(), "up", "--mesh", "data=2,model=2", "--port",
          std::to_string(port).c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  // Whatever happens below, `up` (and with it its cluster) does not outlive the test.
  struct Reaper {
    pid_t pid;
    ~Reaper() {
      if (pid > 0 && waitpid(pid, nullptr, WNOHANG) == 0) {
        kill(pid, SIGINT);
        waitpid(pid, nullptr, 0);
      }
    }
  } reaper{up};
  // Wait for "cluster up".
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (ReadFile(log).find("cluster up") == std::string::npos && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_NE(ReadFile(log).find("cluster up"), std::string::npos) << ReadFile(log);
  auto health = RunCommand({cli, "health", "--addr", addr}, 30);
  EXPECT_EQ(health.exit_code, 0) << health.output;
  EXPECT_THAT(health.output, HasSubstr("SERVING"));
  auto status = RunCommand({cli, "status", "--coordinator", addr}, 30);
  EXPECT_EQ(status.exit_code, 0) << status.output;
  EXPECT_THAT(status.output, HasSubstr("workers 4/4"));
  EXPECT_THAT(status.output, HasSubstr("groups over (data): [0 2] [1 3]"));
  std::vector<pid_t> pids;
  auto client = Client::Connect(addr);
  ASSERT_TRUE(client.ok());
  auto st = (*client)->GetStatus();
  ASSERT_TRUE(st.ok());
  for (const auto& w : st->workers()) pids.push_back(static_cast<pid_t>(w.peer().pid()));
  ASSERT_EQ(pids.size(), 4u);
  kill(up, SIGINT);
  int wstatus = 0;
  ASSERT_EQ(waitpid(up, &wstatus, 0), up);
  reaper.pid = -1;
  EXPECT_TRUE(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0);
  // The workers were the `up` process's children, now reaped by it.
  for (pid_t p : pids) EXPECT_FALSE(ProcessExists(p)) << "worker pid " << p;
  auto gone = RunCommand({cli, "health", "--addr", addr, "--timeout", "1"}, 30);
  EXPECT_NE(gone.exit_code, 0);
  EXPECT_THAT(gone.output, HasSubstr("health check of " + addr));
}

}  // namespace
}  // namespace meshrun
