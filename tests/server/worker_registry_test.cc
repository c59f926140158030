#include "server/worker_registry.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <set>
#include <thread>

#include "core/port/process.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace meshrun {
namespace {

using ::testing::HasSubstr;

v1::RegisterRequest Req(const std::string& address, int requested_rank = -1) {
  v1::RegisterRequest r;
  r.set_address(address);
  r.set_pid(100);
  r.set_hostname("host");
  r.set_requested_rank(requested_rank);
  return r;
}

TEST(WorkerRegistryTest, AssignsRanksCoordsAndRingNeighboursOnceAllJoined) {
  WorkerRegistry reg(*Mesh::Parse("data=2,model=2"), "c1");
  std::vector<absl::StatusOr<v1::RegisterResponse>> out(4, absl::UnknownError("unset"));
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      // Worker 0 (first to arrive) asks for rank 3; the others take free ranks in arrival order.
      out[i] = reg.Register(Req("w" + std::to_string(i), i == 0 ? 3 : -1),
                            absl::Now() + absl::Seconds(5));
    });
    if (i == 0) absl::SleepFor(absl::Milliseconds(50));
  }
  for (auto& t : threads) t.join();
  std::set<int> ranks;
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(out[i].ok()) << out[i].status();
    ranks.insert(out[i]->rank());
    EXPECT_EQ(out[i]->peers_size(), 4);
    EXPECT_EQ(out[i]->ring_next(), (out[i]->rank() + 1) % 4);
    EXPECT_EQ(out[i]->ring_prev(), (out[i]->rank() + 3) % 4);
  }
  EXPECT_EQ(ranks.size(), 4u);
  EXPECT_EQ(out[0]->rank(), 3);
  EXPECT_EQ(std::vector<int>(out[0]->coords().begin(), out[0]->coords().end()),
            (std::vector<int>{1, 1}));
}

TEST(WorkerRegistryTest, TimesOutSayingHowManyAreMissing) {
  WorkerRegistry reg(*Mesh::Parse("data=3"), "c1");
  auto r = reg.Register(Req("w0"), absl::Now() + absl::Milliseconds(50));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(r.status().message(), HasSubstr("only 1 of 3 workers have joined"));
  // Registering again from the same address keeps the rank.
  r = reg.Register(Req("w0"), absl::Now() + absl::Milliseconds(10));
  EXPECT_THAT(r.status().message(), HasSubstr("registered as rank 0"));
}

// 3 of 4 workers join and leave (one by its deadline, two cancelled), then 4 fresh ones form the
// mesh: a worker that gives up before the mesh is complete frees its rank.
TEST(WorkerRegistryTest, WorkersThatLeaveAnIncompleteMeshFreeTheirRanks) {
  WorkerRegistry reg(*Mesh::Parse("data=4"), "c1");
  std::atomic<bool> leave{false};
  std::vector<absl::StatusOr<v1::RegisterResponse>> early(3, absl::UnknownError("unset"));
  std::vector<std::thread> threads;
  threads.emplace_back(
      [&] { early[0] = reg.Register(Req("gone0", 2), absl::Now() + absl::Milliseconds(200)); });
  for (int i = 1; i < 3; ++i) {
    threads.emplace_back([&, i] {
      early[i] = reg.Register(Req("gone" + std::to_string(i)), absl::Now() + absl::Seconds(30),
                              [&] { return leave.load(); });
    });
  }
  absl::SleepFor(absl::Milliseconds(300));
  leave = true;
  for (auto& t : threads) t.join();
  EXPECT_EQ(early[0].status().code(), absl::StatusCode::kDeadlineExceeded) << early[0].status();
  for (int i = 1; i < 3; ++i) {
    EXPECT_EQ(early[i].status().code(), absl::StatusCode::kCancelled) << early[i].status();
    EXPECT_THAT(early[i].status().message(), HasSubstr("its rank is free"));
  }
  threads.clear();
  std::vector<absl::StatusOr<v1::RegisterResponse>> fresh(4, absl::UnknownError("unset"));
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      fresh[i] = reg.Register(Req("fresh" + std::to_string(i), i == 0 ? 2 : -1),
                              absl::Now() + absl::Seconds(5));
    });
    // fresh0 holds rank 2 before the others ask (they take the free ranks left).
    while (i == 0 && reg.Describe(2).find("fresh0") == std::string::npos)
      absl::SleepFor(absl::Milliseconds(5));
  }
  for (auto& t : threads) t.join();
  std::set<int> ranks;
  for (const auto& r : fresh) {
    ASSERT_TRUE(r.ok()) << r.status();
    ranks.insert(r->rank());
  }
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2, 3}));
  EXPECT_EQ(fresh[0]->rank(), 2) << "the rank the first leaver asked for is free again";
}

TEST(WorkerRegistryTest, RejectsAFullClusterAndTakenRanks) {
  WorkerRegistry reg(*Mesh::Parse("data=1"), "c1");
  ASSERT_TRUE(reg.Register(Req("w0"), absl::Now() + absl::Seconds(1)).ok());
  std::atomic<bool> done{false};
  std::thread heartbeats([&] {  // w0 stays alive
    while (!done) {
      EXPECT_FALSE(*reg.Heartbeat(0, "c1"));
      absl::SleepFor(absl::Milliseconds(100));
    }
  });
  const absl::Time start = absl::Now();
  auto r = reg.Register(Req("w1"), absl::Now() + absl::Seconds(10));
  done = true;
  heartbeats.join();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("cluster is full"));
  // Not at once: the newcomer waited out the heartbeat timeout (3 s) for a holder to fall silent.
  EXPECT_GE(absl::Now() - start, absl::Seconds(3));
  r = reg.Register(Req("w2", 5), absl::Now() + absl::Seconds(1));
  EXPECT_THAT(r.status().message(), HasSubstr("requested rank 5 is out of range"));
}

TEST(WorkerRegistryTest, HeartbeatsDecideReadinessAndLiveness) {
  WorkerRegistry reg(*Mesh::Parse("data=1"), "c1");
  ASSERT_TRUE(reg.Register(Req("w0"), absl::Now() + absl::Seconds(1)).ok());
  EXPECT_EQ(reg.WaitUntilReady(absl::Now() + absl::Milliseconds(20)).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(reg.Heartbeat(0, "other-cluster").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(reg.Heartbeat(0, "c1").ok());
  EXPECT_TRUE(reg.WaitUntilReady(absl::Now() + absl::Milliseconds(20)).ok());
  EXPECT_TRUE(reg.DeadRanks(absl::Seconds(5)).empty());
  absl::SleepFor(absl::Milliseconds(30));
  using Dead = std::vector<std::pair<int, std::string>>;
  EXPECT_EQ(reg.DeadRanks(absl::Milliseconds(10)), (Dead{{0, "missed heartbeats for 10ms"}}));
  EXPECT_EQ(reg.Describe(0), "rank 0 (w0, pid 100)");
}

// Shutdown waits for every registered worker to have been told by a heartbeat's answer, and no
// longer than its deadline for one that never asks.
TEST(WorkerRegistryTest, ShutdownWaitsUntilEveryWorkerWasTold) {
  WorkerRegistry reg(*Mesh::Parse("data=2"), "c1");
  std::vector<std::thread> joins;
  for (int i = 0; i < 2; ++i) {
    joins.emplace_back([&, i] {
      ASSERT_TRUE(reg.Register(Req("w" + std::to_string(i)), absl::Now() + absl::Seconds(5)).ok());
    });
  }
  for (auto& t : joins) t.join();
  EXPECT_FALSE(reg.TellShutdown(0));  // nothing to tell yet, and nothing recorded
  reg.RequestShutdown();
  EXPECT_FALSE(reg.AwaitShutdownTold(absl::Now() + absl::Milliseconds(20)));
  EXPECT_TRUE(reg.TellShutdown(0));
  EXPECT_FALSE(reg.AwaitShutdownTold(absl::Now() + absl::Milliseconds(20)));  // rank 1 not yet
  std::thread heartbeat([&] {
    absl::SleepFor(absl::Milliseconds(50));
    reg.TellShutdown(1);
  });
  const absl::Time start = absl::Now();
  EXPECT_TRUE(reg.AwaitShutdownTold(absl::Now() + absl::Seconds(10)));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));  // woken by the answer, not the deadline
  heartbeat.join();
}

// A worker on the coordinator's host that is stopped or has exited is dead at once, whatever its
// last heartbeat; after SIGCONT it is alive again.
TEST(WorkerRegistryTest, ALocalWorkerStoppedOrExitedIsDeadAtOnce) {
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    for (;;) pause();
  }
  const std::string identity = ProcessIdentity(child);
  ASSERT_FALSE(identity.empty());
  auto state_is = [&](ProcessState want) {
    for (int i = 0; i < 200 && ObserveProcess(identity) != want; ++i)
      absl::SleepFor(absl::Milliseconds(10));
    return ObserveProcess(identity) == want;
  };
  WorkerRegistry reg(*Mesh::Parse("data=1"), "c1");
  v1::RegisterRequest req = Req("w0");
  req.set_pid(child);
  req.set_process_identity(identity);
  ASSERT_TRUE(reg.Register(req, absl::Now() + absl::Seconds(1)).ok());
  ASSERT_TRUE(reg.Heartbeat(0, "c1").ok());
  using Dead = std::vector<std::pair<int, std::string>>;
  EXPECT_EQ(reg.DeadRanks(absl::Seconds(60)), Dead{});
  ASSERT_EQ(kill(child, SIGSTOP), 0);
  ASSERT_TRUE(state_is(ProcessState::kStopped));
  EXPECT_EQ(reg.DeadRanks(absl::Seconds(60)), (Dead{{0, "is stopped (SIGSTOP)"}}));
  ASSERT_EQ(kill(child, SIGCONT), 0);
  ASSERT_TRUE(state_is(ProcessState::kRunning));
  EXPECT_EQ(reg.DeadRanks(absl::Seconds(60)), Dead{});
  ASSERT_EQ(kill(child, SIGKILL), 0);
  ASSERT_TRUE(state_is(ProcessState::kGone)) << "a zombie not yet reaped counts as gone";
  EXPECT_EQ(reg.DeadRanks(absl::Seconds(60)), (Dead{{0, "has exited"}}));
  reg.set_process_checks(false);
  EXPECT_EQ(reg.DeadRanks(absl::Seconds(60)), Dead{}) << "heartbeats only";
  reg.set_process_checks(true);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);
  EXPECT_EQ(reg.DeadRanks(absl::Seconds(60)), (Dead{{0, "has exited"}}));
}

// Registers `addresses` (asking for `ranks`, -1: any) in parallel; every call returns once the
// mesh is whole.
std::vector<absl::StatusOr<v1::RegisterResponse>> RegisterAll(
    WorkerRegistry& reg, const std::vector<std::string>& addresses, const std::vector<int>& ranks) {
  std::vector<absl::StatusOr<v1::RegisterResponse>> out(addresses.size(),
                                                        absl::UnknownError("unset"));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < addresses.size(); ++i) {
    threads.emplace_back([&, i] {
      out[i] = reg.Register(Req(addresses[i], ranks[i]), absl::Now() + absl::Seconds(5));
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

// Elastic recovery: after BeginRecovery the old generation's heartbeats say restart, the
// survivors get their ranks back (asking for them), a fresh worker takes the lost rank, and the
// whole mesh is ready again in the new generation.
TEST(WorkerRegistryTest, RecoveryReformsTheMeshWithAFreshWorkerInTheLostRank) {
  WorkerRegistry reg(*Mesh::Parse("data=3"), "c1");
  auto first = RegisterAll(reg, {"a", "b", "c"}, {0, 1, 2});
  for (auto& r : first) ASSERT_TRUE(r.ok()) << r.status();
  const uint64_t old_generation = first[0]->generation();
  for (int r = 0; r < 3; ++r) ASSERT_EQ(*reg.Heartbeat(r, "c1", old_generation), false);
  const uint64_t generation = reg.BeginRecovery({1}, "rank 1 died");
  EXPECT_GT(generation, old_generation);
  EXPECT_EQ(reg.generation(), generation);
  EXPECT_EQ(*reg.Heartbeat(0, "c1", old_generation), true) << "a survivor is told to restart";
  EXPECT_EQ(reg.WaitUntilReady(absl::Now() + absl::Milliseconds(20)).code(),
            absl::StatusCode::kDeadlineExceeded);
  // The fresh worker arrives first and asks for any rank: it gets the lost one, not a survivor's.
  auto again = RegisterAll(reg, {"fresh", "a2", "c2"}, {-1, 0, 2});
  for (auto& r : again) ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(again[0]->rank(), 1);
  EXPECT_EQ(again[1]->rank(), 0);
  EXPECT_EQ(again[2]->rank(), 2);
  for (auto& r : again) EXPECT_EQ(r->generation(), generation);
  EXPECT_EQ(again[0]->peers(1).address(), "fresh");
  for (int r = 0; r < 3; ++r) EXPECT_EQ(*reg.Heartbeat(r, "c1", generation), false);
  EXPECT_TRUE(reg.WaitUntilReady(absl::Now() + absl::Milliseconds(20)).ok());
  // A worker of the old generation that comes back late is still told to restart.
  EXPECT_EQ(*reg.Heartbeat(1, "c1", old_generation), true);
}

TEST(WorkerRegistryTest, SurvivorRanksAreKeptFromFreshWorkers) {
  WorkerRegistry reg(*Mesh::Parse("data=2"), "c1");
  for (auto& r : RegisterAll(reg, {"a", "b"}, {-1, -1})) ASSERT_TRUE(r.ok()) << r.status();
  reg.BeginRecovery({1}, "rank 1 died");
  std::thread fresh(
      [&] { EXPECT_TRUE(reg.Register(Req("fresh"), absl::Now() + absl::Seconds(5)).ok()); });
  absl::SleepFor(absl::Milliseconds(50));
  // Rank 0 is kept for its survivor; rank 1 is being taken: a second fresh worker is refused.
  auto refused = reg.Register(Req("another"), absl::Now() + absl::Seconds(1));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("kept for the surviving workers"));
  auto survivor = reg.Register(Req("a", 0), absl::Now() + absl::Seconds(5));
  fresh.join();
  ASSERT_TRUE(survivor.ok()) << survivor.status();
  EXPECT_EQ(survivor->rank(), 0);
}

// A fresh worker that finds the mesh full but a rank silent past the heartbeat timeout takes
// that rank: the cluster re-forms (a replacement is not refused while the dead worker's
// registration lingers).
TEST(WorkerRegistryTest, AFreshWorkerReplacesASilentRank) {
  WorkerRegistry reg(*Mesh::Parse("data=2"), "c1", false, absl::Milliseconds(100));
  auto first = RegisterAll(reg, {"a", "b"}, {0, 1});
  for (auto& r : first) ASSERT_TRUE(r.ok()) << r.status();
  auto full = reg.Register(Req("early"), absl::Now() + absl::Milliseconds(50));
  EXPECT_THAT(full.status().message(), HasSubstr("cluster is full")) << "nobody is silent yet";
  absl::SleepFor(absl::Milliseconds(150));
  ASSERT_FALSE(*reg.Heartbeat(0, "c1", first[0]->generation()));
  ASSERT_EQ(reg.DeadRanks(absl::Milliseconds(100)).size(), 1u);
  EXPECT_EQ(reg.DeadRanks(absl::Milliseconds(100))[0].first, 1);
  absl::StatusOr<v1::RegisterResponse> replacement = absl::UnknownError("unset");
  std::thread joining(
      [&] { replacement = reg.Register(Req("replacement"), absl::Now() + absl::Seconds(5)); });
  absl::SleepFor(absl::Milliseconds(50));  // the survivor rejoins once told to (below)
  EXPECT_TRUE(*reg.Heartbeat(0, "c1", first[0]->generation())) << "the survivor is told to restart";
  auto survivor = reg.Register(Req("a", 0), absl::Now() + absl::Seconds(5));
  joining.join();
  ASSERT_TRUE(replacement.ok()) << replacement.status();
  ASSERT_TRUE(survivor.ok()) << survivor.status();
  EXPECT_EQ(replacement->rank(), 1);
  EXPECT_EQ(survivor->rank(), 0);
  EXPECT_GT(replacement->generation(), first[0]->generation());
  EXPECT_TRUE(*reg.Heartbeat(0, "c1", first[0]->generation())) << "the survivor's old heartbeat";
}

// A new process at a registered worker's address (compose restarts a killed container on the
// same host:port) replaces it at once: the old one is gone, since the port was free to bind.
TEST(WorkerRegistryTest, ANewProcessAtAWorkersAddressReplacesItAtOnce) {
  WorkerRegistry reg(*Mesh::Parse("data=2"), "c1");
  auto first = RegisterAll(reg, {"w0:1", "w1:1"}, {0, 1});
  for (auto& r : first) ASSERT_TRUE(r.ok()) << r.status();
  v1::RegisterRequest same = Req("w1:1", 1);
  auto again = reg.Register(same, absl::Now() + absl::Seconds(1));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->generation(), first[0]->generation()) << "the same process keeps its rank";
  v1::RegisterRequest fresh = Req("w1:1", 1);
  fresh.set_incarnation(42);
  fresh.set_pid(777);
  absl::StatusOr<v1::RegisterResponse> replaced = absl::UnknownError("unset");
  std::thread joining([&] { replaced = reg.Register(fresh, absl::Now() + absl::Seconds(5)); });
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_GT(reg.generation(), first[0]->generation())
      << "re-forming began without a heartbeat timeout";
  ASSERT_EQ(reg.last_lost().size(), 1u);
  EXPECT_EQ(reg.last_lost()[0].pid(), 100);
  EXPECT_TRUE(*reg.Heartbeat(0, "c1", first[0]->generation()));
  auto survivor = reg.Register(Req("w0:1", 0), absl::Now() + absl::Seconds(5));
  joining.join();
  ASSERT_TRUE(replaced.ok()) << replaced.status();
  ASSERT_TRUE(survivor.ok()) << survivor.status();
  EXPECT_EQ(replaced->rank(), 1);
  EXPECT_EQ(replaced->peers(1).pid(), 777);
}

// recovery.min_workers: the workers that rejoined take ranks 0..n-1 of the smaller mesh in their
// rank order; their pending registrations answer with it; one left out is told so.
TEST(WorkerRegistryTest, ShrinkRenumbersTheRejoinedWorkersOntoTheSmallerMesh) {
  WorkerRegistry reg(*Mesh::Parse("data=4"), "c1");
  for (auto& r : RegisterAll(reg, {"a", "b", "c", "d"}, {0, 1, 2, 3}))
    ASSERT_TRUE(r.ok()) << r.status();
  reg.BeginRecovery({0}, "rank 0 died");
  std::vector<absl::StatusOr<v1::RegisterResponse>> back(3, absl::UnknownError("unset"));
  std::vector<std::thread> threads;
  const std::vector<std::string> who = {"b", "c", "d"};
  for (int i = 0; i < 3; ++i) {
    threads.emplace_back(
        [&, i] { back[i] = reg.Register(Req(who[i], i + 1), absl::Now() + absl::Seconds(2)); });
  }
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(reg.RegisteredCount(), 3);
  const uint64_t before = reg.generation();
  EXPECT_EQ(reg.Shrink(*Mesh::Parse("data=4")).code(), absl::StatusCode::kFailedPrecondition)
      << "3 workers cannot fill 4 devices";
  ASSERT_TRUE(reg.Shrink(*Mesh::Parse("data=2")).ok());
  for (auto& t : threads) t.join();
  EXPECT_GT(reg.generation(), before);
  EXPECT_EQ(reg.expected(), 2);
  ASSERT_TRUE(back[0].ok()) << back[0].status();
  ASSERT_TRUE(back[1].ok()) << back[1].status();
  EXPECT_EQ(back[0]->rank(), 0);  // b, was rank 1
  EXPECT_EQ(back[1]->rank(), 1);  // c, was rank 2
  EXPECT_EQ(back[0]->peers_size(), 2);
  EXPECT_EQ(back[1]->peers(0).address(), "b");
  EXPECT_EQ(back[0]->mesh().axes(0).size(), 2);
  EXPECT_EQ(back[2].status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(back[2].status().message(), HasSubstr("without this worker"));
}

// A registration is bound to its process (RegisterRequest.incarnation): another process cannot
// keep the rank alive with heartbeats.
TEST(WorkerRegistryTest, OnlyTheRegisteredProcessKeepsItsRankAlive) {
  WorkerRegistry reg(*Mesh::Parse("data=1"), "c1");
  v1::RegisterRequest r = Req("w0");
  r.set_incarnation(7);
  auto got = reg.Register(r, absl::Now() + absl::Seconds(1));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_FALSE(*reg.Heartbeat(0, "c1", got->generation(), 7));
  auto impostor = reg.Heartbeat(0, "c1", got->generation(), 8);
  EXPECT_EQ(impostor.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(impostor.status().message(), HasSubstr("rank 0 is held by another process (w0"));
}

// While the mesh forms, registered workers send no heartbeats yet: a worker asking for a taken
// rank is refused (not taken for a replacement of a silent one), and a new process at a waiting
// worker's address simply takes its place, without re-forming anything.
TEST(WorkerRegistryTest, WhileTheMeshFormsNobodyIsSilentAndANewProcessTakesItsPlace) {
  WorkerRegistry reg(*Mesh::Parse("data=2"), "c1", false, absl::Milliseconds(50));
  const uint64_t generation = reg.generation();
  absl::StatusOr<v1::RegisterResponse> old_process = absl::UnknownError("unset");
  std::thread waiting(
      [&] { old_process = reg.Register(Req("w0:1", 0), absl::Now() + absl::Milliseconds(600)); });
  absl::SleepFor(absl::Milliseconds(100));  // past the heartbeat timeout
  auto taken = reg.Register(Req("other:1", 0), absl::Now() + absl::Milliseconds(100));
  EXPECT_THAT(taken.status().message(), HasSubstr("requested rank 0 is taken by w0:1"));
  // A new process at w0:1 (the old one crashed while waiting) takes its place at once.
  v1::RegisterRequest restarted = Req("w0:1", 0);
  restarted.set_incarnation(5);
  absl::StatusOr<v1::RegisterResponse> joined = absl::UnknownError("unset");
  std::thread rejoining([&] { joined = reg.Register(restarted, absl::Now() + absl::Seconds(5)); });
  absl::SleepFor(absl::Milliseconds(50));
  ASSERT_TRUE(reg.Register(Req("w1:1", 1), absl::Now() + absl::Seconds(5)).ok());
  rejoining.join();
  waiting.join();
  ASSERT_TRUE(joined.ok()) << joined.status();
  EXPECT_EQ(joined->rank(), 0);
  EXPECT_EQ(old_process.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(old_process.status().message(), HasSubstr("without this worker"));
  EXPECT_EQ(reg.generation(), generation) << "forming, not re-forming";
}

}  // namespace
}  // namespace meshrun
