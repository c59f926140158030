// Elastic recovery on real processes (JobSpec.recovery, WorkerRegistry::BeginRecovery): a worker
// killed or hung mid-job is reported by rank, pid and cause, the cluster re-forms with a respawned
// worker in its rank, and the job continues from its newest checkpoint with the losses of an
// uninterrupted run.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/port/process.h"
#include "core/sharding/mesh.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "meshrun/client.h"
#include "meshrun/local_cluster.h"
#include "tests/testutil/cluster.h"

namespace meshrun {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

std::unique_ptr<LocalCluster> StartRespawningCluster(const std::string& mesh,
                                                     const std::string& tag, bool respawn) {
  LocalClusterOptions o;
  o.mesh = mesh;
  o.respawn_workers = respawn;
  o.log_dir = absl::StrCat(::testing::TempDir(), "/meshrun-", tag, "-", getpid());
  auto c = LocalCluster::Start(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

// Per-step losses, the last report of each step winning (steps after a recovery run twice).
std::map<int64_t, double> Losses(const TrainResult& r) {
  std::map<int64_t, double> loss;
  for (const v1::StepReport& rep : r.reports) loss[rep.step()] = rep.loss();
  return loss;
}

bool WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  out.flush();
  return out.good();
}

// A memory cgroup `name` limited to `limit_bytes` under this process's own (cgroup v1: v2 allows
// no process beside child groups, so a test inside one cannot make one); "" with the reason in
// `why` where none can be made (no permission, no v1 memory controller).
std::string MakeMemoryCgroup(const std::string& name, int64_t limit_bytes, std::string* why) {
  // This process's memory cgroup, as the coordinator finds a worker's (core/port/process.h).
  const fs::path counter = WatchOomKills(getpid()).counter;
  if (counter.filename() != "memory.oom_control") {
    *why = absl::StrCat("no cgroup v1 memory group counts this process's OOM kills (",
                        counter.empty() ? std::string("none readable") : counter.string(), ")");
    return "";
  }
  const std::string dir = (counter.parent_path() / name).string();
  std::error_code ec;
  if (!fs::create_directory(dir, ec) || ec) {
    *why = absl::StrCat("cannot create ", dir, ": ", ec.message());
    return "";
  }
  if (!WriteFile(dir + "/memory.limit_in_bytes", std::to_string(limit_bytes))) {
    *why = absl::StrCat("cannot limit ", dir);
    fs::remove(dir, ec);
    return "";
  }
  WriteFile(dir + "/memory.memsw.limit_in_bytes", std::to_string(limit_bytes));  // with swap
  return dir;
}

class RecoveryTest : public testing::TempRootTest {
 protected:
  RecoveryTest() : TempRootTest("meshrun-recovery-") {}
};

// The case: kill -9 one of 8 workers at step 50 of a 150-step job saving every 20.
TEST_F(RecoveryTest, AKilledWorkerIsRespawnedAndTheJobContinuesFromItsCheckpoint) {
  auto cluster = StartRespawningCluster("data=8", "recovery-kill", /*respawn=*/true);
  ASSERT_NE(cluster, nullptr);
  auto client = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(client.ok()) << client.status();
  auto straight = (*client)->Train(testing::PerStepJobConfig(150));
  ASSERT_TRUE(straight.ok()) << straight.status();

  JobConfig config = testing::PerStepJobConfig(150);
  config.checkpoint.dir = (root_ / "ck").string();
  config.checkpoint.save_every = 20;
  config.recovery.max_restarts = 2;
  const pid_t victim = cluster->worker_pids()[3];
  bool killed = false;
  auto recovered = (*client)->Train(config, [&](const v1::JobEvent& e) {
    if (e.has_step() && e.step().step() == 50 && !killed) {
      killed = true;
      ASSERT_EQ(kill(victim, SIGKILL), 0);
    }
  });
  ASSERT_TRUE(killed);
  ASSERT_TRUE(recovered.ok()) << recovered.status();
  ASSERT_EQ(recovered->lost.size(), 1u);
  const v1::WorkerLost& lost = recovered->lost[0];
  EXPECT_EQ(lost.pid(), victim);
  EXPECT_EQ(lost.cause(), "killed");
  EXPECT_GE(lost.step(), 50);
  EXPECT_LT(lost.step(), 60) << "the failure is seen before the next checkpoint";
  EXPECT_THAT(lost.error(), HasSubstr(absl::StrCat("rank ", lost.rank())));
  ASSERT_EQ(recovered->recoveries.size(), 1u);
  const v1::Recovered& back = recovered->recoveries[0];
  EXPECT_EQ(back.step(), 40);
  EXPECT_EQ(fs::path(back.checkpoint()).filename().string(), "step_00000040");
  EXPECT_GT(back.seconds(), 0);
  EXPECT_GE(back.seconds(), back.reform_seconds());
  // For the record (a measurement, not a check): the step time before the loss and after.
  double before = 0, after = 0;
  int n_before = 0, n_after = 0;
  bool recovered_yet = false;
  for (const v1::StepReport& r : recovered->reports) {
    recovered_yet |= r.step() == 41 && n_before > 0;
    if (!recovered_yet && r.step() > 10 && r.step() <= 50) before += r.step_seconds(), ++n_before;
    if (recovered_yet && r.step() > 60) after += r.step_seconds(), ++n_after;
  }
  std::printf(
      "recovery: %.2f s (re-forming %.2f s) from the step-40 checkpoint; step %.2f ms "
      "before, %.2f ms after\n",
      back.seconds(), back.reform_seconds(), 1e3 * before / std::max(1, n_before),
      1e3 * after / std::max(1, n_after));
  EXPECT_EQ(cluster->respawns(), 1);
  EXPECT_NE(cluster->worker_pids()[3], victim);

  // Losses: bit for bit an uninterrupted run's, before the failure and after the recovery.
  const std::map<int64_t, double> want = Losses(*straight), got = Losses(*recovered);
  ASSERT_EQ(want.size(), 150u);
  ASSERT_EQ(got.size(), 150u);
  for (int64_t step = 1; step <= 150; ++step)
    EXPECT_EQ(got.at(step), want.at(step)) << "step " << step;
  // The steps 41..50 ran twice: the reports hold them before and after the recovery.
  EXPECT_GE(recovered->reports.size(), 160u);

  // The re-formed cluster serves the next job.
  auto next = (*client)->Train(testing::PerStepJobConfig(3));
  EXPECT_TRUE(next.ok()) << next.status();
  ASSERT_TRUE(cluster->Stop().ok());
}

// The lost worker's state is healed from its peers' memory (recovery.peer_state_every), with no
// checkpoint on disk at all: the job goes on from the newest in-memory copy with an
// uninterrupted run's losses. Under FSDP every rank holds other blocks, so each must come back
// from its own copy (kept over its restart) or, for the lost rank, from its successor's.
TEST_F(RecoveryTest, AKilledWorkersStateIsHealedFromItsPeersMemory) {
  auto cluster = StartRespawningCluster("data=4", "recovery-peers", /*respawn=*/true);
  ASSERT_NE(cluster, nullptr);
  auto client = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(client.ok()) << client.status();
  JobConfig base = testing::PerStepJobConfig(60);
  base.sharding.layout = "fsdp";
  auto straight = (*client)->Train(base);
  ASSERT_TRUE(straight.ok()) << straight.status();

  // Killed after step 32: the peers hold step 30 (every 5), the disk run's checkpoint is step 30
  // too (every 10); each recovery's time is printed for the record.
  const auto run_and_kill = [&](const JobConfig& config, int victim_rank) {
    const pid_t victim = cluster->worker_pids()[victim_rank];
    bool killed = false;
    auto result = (*client)->Train(config, [&](const v1::JobEvent& e) {
      // For the record: how long the restore itself took.
      if (e.has_info() && (absl::StartsWith(e.info(), "restored step") ||
                           absl::StartsWith(e.info(), "resumed from")))
        std::printf("%s\n", e.info().c_str());
      if (e.has_step() && e.step().step() == 32 && !killed) {
        killed = true;
        ASSERT_EQ(kill(victim, SIGKILL), 0);
      }
    });
    EXPECT_TRUE(killed);
    return result;
  };
  JobConfig from_peers = base;
  from_peers.recovery.max_restarts = 1;
  from_peers.recovery.peer_state_every = 5;
  auto healed = run_and_kill(from_peers, 2);
  ASSERT_TRUE(healed.ok()) << healed.status();
  ASSERT_EQ(healed->lost.size(), 1u);
  ASSERT_EQ(healed->recoveries.size(), 1u);
  const v1::Recovered& back = healed->recoveries[0];
  EXPECT_EQ(back.source(), "peers");
  EXPECT_EQ(back.checkpoint(), "");
  EXPECT_EQ(back.step(), healed->lost[0].step() / 5 * 5) << "the newest copy before the loss";
  EXPECT_GE(back.step(), 30);
  const std::map<int64_t, double> want = Losses(*straight);
  ASSERT_EQ(want.size(), 60u);
  const std::map<int64_t, double> got = Losses(*healed);
  ASSERT_EQ(got.size(), 60u);
  for (int64_t step = 1; step <= 60; ++step)
    EXPECT_EQ(got.at(step), want.at(step)) << "step " << step;

  JobConfig from_disk = base;
  from_disk.recovery.max_restarts = 1;
  from_disk.checkpoint.dir = (root_ / "ck").string();
  from_disk.checkpoint.save_every = 10;
  auto restored = run_and_kill(from_disk, 1);
  ASSERT_TRUE(restored.ok()) << restored.status();
  ASSERT_EQ(restored->recoveries.size(), 1u);
  const v1::Recovered& disk = restored->recoveries[0];
  EXPECT_EQ(disk.source(), "checkpoint");
  EXPECT_EQ(disk.step(), restored->lost[0].step() / 10 * 10);
  const std::map<int64_t, double> got_disk = Losses(*restored);
  ASSERT_EQ(got_disk.size(), 60u);
  for (int64_t step = 1; step <= 60; ++step)
    EXPECT_EQ(got_disk.at(step), want.at(step)) << "step " << step;
  std::printf(
      "recovery from the peers' memory: %.2f s (re-forming %.2f s); from disk: %.2f s "
      "(re-forming %.2f s)\n",
      back.seconds(), back.reform_seconds(), disk.seconds(), disk.reform_seconds());
  EXPECT_EQ(cluster->respawns(), 2);
  ASSERT_TRUE(cluster->Stop().ok());
}

// A worker the OOM killer ends (its memory cgroup's limit is far below what opening the dataset
// takes) is reported with the cause "out of memory", and the job goes on with its replacement.
TEST_F(RecoveryTest, AWorkerTheOomKillerEndsIsReportedAsOutOfMemory) {
  auto cluster = StartRespawningCluster("data=2", "recovery-oom", /*respawn=*/true);
  ASSERT_NE(cluster, nullptr);
  auto client = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(client.ok()) << client.status();
  std::string why;
  const std::string cgroup =
      MakeMemoryCgroup(absl::StrCat("meshrun-oom-", getpid()), int64_t{32} << 20, &why);
  if (cgroup.empty()) GTEST_SKIP() << "no memory cgroup to limit a worker in: " << why;
  const pid_t victim = cluster->worker_pids()[1];
  ASSERT_TRUE(WriteFile(cgroup + "/cgroup.procs", std::to_string(victim)));
  // A heartbeat (every 0.5 s) lets the coordinator see the worker's new memory cgroup.
  absl::SleepFor(absl::Milliseconds(1500));
  JobConfig config = testing::PerStepJobConfig(10);
  config.recovery.max_restarts = 1;
  auto result = (*client)->Train(config);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->lost.size(), 1u);
  EXPECT_EQ(result->lost[0].pid(), victim);
  EXPECT_EQ(result->lost[0].cause(), "out of memory") << result->lost[0].error();
  EXPECT_EQ(Losses(*result).rbegin()->first, 10);
  ASSERT_TRUE(cluster->Stop().ok());
  std::error_code ec;
  for (int i = 0; i < 50 && !fs::remove(cgroup, ec); ++i) absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(fs::exists(cgroup)) << ec.message();
}

// A stopped (SIGSTOP) worker is found by its heartbeats, reported as hung, ended by the
// coordinator (same host) and respawned; the job goes on.
TEST_F(RecoveryTest, AHungWorkerIsReplacedAndTheJobGoesOn) {
  auto cluster = StartRespawningCluster("data=4", "recovery-hung", /*respawn=*/true);
  ASSERT_NE(cluster, nullptr);
  auto client = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(client.ok()) << client.status();
  JobConfig config = testing::PerStepJobConfig(40);
  config.checkpoint.dir = (root_ / "ck").string();
  config.checkpoint.save_every = 10;
  config.recovery.max_restarts = 1;
  const pid_t victim = cluster->worker_pids()[1];
  bool stopped = false;
  auto result = (*client)->Train(config, [&](const v1::JobEvent& e) {
    if (e.has_step() && e.step().step() == 15 && !stopped) {
      stopped = true;
      ASSERT_EQ(kill(victim, SIGSTOP), 0);
    }
  });
  ASSERT_TRUE(stopped);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->lost.size(), 1u);
  EXPECT_EQ(result->lost[0].pid(), victim);
  EXPECT_EQ(result->lost[0].cause(), "hung");
  ASSERT_EQ(result->recoveries.size(), 1u);
  EXPECT_EQ(result->recoveries[0].step(), 10);
  EXPECT_EQ(Losses(*result).rbegin()->first, 40);
  EXPECT_EQ(cluster->respawns(), 1);
  ASSERT_TRUE(cluster->Stop().ok());
}

// Nobody replaces the lost worker: the job fails after recovery.timeout_seconds, naming the lost
// rank, and the client saw the WorkerLost event first.
TEST_F(RecoveryTest, WithoutAReplacementTheJobFailsAfterTheRecoveryTimeout) {
  auto cluster = StartRespawningCluster("data=4", "recovery-none", /*respawn=*/false);
  ASSERT_NE(cluster, nullptr);
  auto client = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(client.ok()) << client.status();
  JobConfig config = testing::PerStepJobConfig(1000);
  config.recovery.max_restarts = 3;
  config.recovery.timeout_seconds = 3;
  const pid_t victim = cluster->worker_pids()[2];
  std::vector<v1::WorkerLost> lost;
  bool killed = false;
  auto result = (*client)->Train(config, [&](const v1::JobEvent& e) {
    if (e.has_worker_lost()) lost.push_back(e.worker_lost());
    if (e.has_step() && !killed) {
      killed = true;
      ASSERT_EQ(kill(victim, SIGKILL), 0);
    }
  });
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kDeadlineExceeded) << result.status();
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].pid(), victim);
  EXPECT_THAT(result.status().message(),
              HasSubstr(absl::StrCat("lost ranks [", lost[0].rank(), "]")));
  EXPECT_THAT(result.status().message(), HasSubstr("did not re-form within 3s"));
  ASSERT_TRUE(cluster->Stop().ok());
}

// No replacement, but recovery.min_workers: the 7 workers that rejoin are more than data=4 needs,
// so the job goes on on 4 of them from its step-40 checkpoint (resharded onto the smaller mesh),
// tracking the uninterrupted 8-worker run.
TEST_F(RecoveryTest, WithoutAReplacementTheJobContinuesOnFewerWorkers) {
  auto cluster = StartRespawningCluster("data=8", "recovery-shrink", /*respawn=*/false);
  ASSERT_NE(cluster, nullptr);
  auto client = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(client.ok()) << client.status();
  // No dropout: its masks follow each device's data index (the seed's fold_rng_over_axis), so
  // they differ on another mesh; without it the losses must agree to rounding.
  JobConfig base = testing::PerStepJobConfig(100);
  base.model.dropout_rate = 0;
  auto straight = (*client)->Train(base);
  ASSERT_TRUE(straight.ok()) << straight.status();

  JobConfig config = base;
  config.checkpoint.dir = (root_ / "ck").string();
  config.checkpoint.save_every = 20;
  config.recovery.max_restarts = 1;
  config.recovery.timeout_seconds = 10;  // the survivors rejoin within it; nobody else comes
  config.recovery.min_workers = 4;
  const pid_t victim = cluster->worker_pids()[5];
  bool killed = false;
  std::vector<std::string> info;
  auto result = (*client)->Train(config, [&](const v1::JobEvent& e) {
    if (e.has_info()) info.push_back(e.info());
    if (e.has_step() && e.step().step() == 50 && !killed) {
      killed = true;
      ASSERT_EQ(kill(victim, SIGKILL), 0);
    }
  });
  ASSERT_TRUE(killed);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->recoveries.size(), 1u);
  EXPECT_EQ(result->recoveries[0].step(), 40);
  auto mesh = Mesh::FromProto(result->recoveries[0].mesh());
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  EXPECT_EQ(mesh->ToString(), Mesh::Parse("data=4")->ToString());
  EXPECT_THAT(info, ::testing::Contains(HasSubstr("no replacement came: continuing on")));
  const std::map<int64_t, double> want = Losses(*straight), got = Losses(*result);
  ASSERT_EQ(got.size(), 100u);
  for (int64_t step = 1; step <= 40; ++step)
    EXPECT_EQ(got.at(step), want.at(step)) << "step " << step;
  // On 4 workers the sums run in another order: the same losses to rounding.
  for (int64_t step = 41; step <= 100; ++step)
    EXPECT_NEAR(got.at(step), want.at(step), 1e-4) << "step " << step;
  auto status = (*client)->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->expected_workers(), 4);
  // The smaller cluster serves the next job.
  auto next = (*client)->Train(testing::PerStepJobConfig(3));
  EXPECT_TRUE(next.ok()) << next.status();
  ASSERT_TRUE(cluster->Stop().ok());
}

// Arrays made before a worker was lost do not survive the re-form (the workers start afresh): a
// later call naming one is refused by the coordinator as gone, naming the array, rather than by
// every worker as missing; a fresh array works.
TEST_F(RecoveryTest, AnArrayFromBeforeTheClusterReformedIsReportedGoneByName) {
  auto cluster = StartRespawningCluster("data=4", "recovery-gone", /*respawn=*/true);
  ASSERT_NE(cluster, nullptr);
  auto client = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(client.ok()) << client.status();
  const Tensor x = testing::NormalTensor({8, 3}, 7);
  auto before = (*client)->Put(x, PartitionSpec::Of({"data", ""}));
  ASSERT_TRUE(before.ok()) << before.status();
  ASSERT_TRUE((*client)->Get(before->id()).ok());
  ASSERT_EQ(kill(cluster->worker_pids()[1], SIGKILL), 0);
  // Unreachable until the respawned worker has joined; then gone.
  absl::Status s;
  for (const absl::Time deadline = absl::Now() + absl::Seconds(60); absl::Now() < deadline;
       absl::SleepFor(absl::Milliseconds(200))) {
    s = (*client)->Get(before->id()).status();
    if (s.code() == absl::StatusCode::kNotFound) break;
  }
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(s.message(),
              HasSubstr(absl::StrCat("array '", before->id(), "' is gone: the cluster re-formed")));
  auto after = (*client)->Put(x, PartitionSpec::Of({"data", ""}));
  ASSERT_TRUE(after.ok()) << after.status();
  auto got = (*client)->Get(after->id());
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->dims(), x.dims());
  EXPECT_EQ(std::memcmp(got->raw(), x.raw(), x.size_bytes()), 0);
}

}  // namespace
}  // namespace meshrun
