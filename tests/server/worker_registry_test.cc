#include "server/worker_registry.h"

#include <atomic>
#include <set>
#include <thread>

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
      out[i] = reg.Register(Req("w" + std::to_string(i), i == 0 ? 3 : -1), absl::Now() + absl::Seconds(5));
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
  EXPECT_EQ(std::vector<int>(out[0]->coords().begin(), out[0]->coords().end()), (std::vector<int>{1, 1}));
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
  auto r = reg.Register(Req("w1"), absl::Now() + absl::Seconds(1));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("cluster is full"));
  r = reg.Register(Req("w2", 5), absl::Now() + absl::Seconds(1));
  EXPECT_THAT(r.status().message(), HasSubstr("requested rank 5 is out of range"));
}

TEST(WorkerRegistryTest, HeartbeatsDecideReadinessAndLiveness) {
  WorkerRegistry reg(*Mesh::Parse("data=1"), "c1");
  ASSERT_TRUE(reg.Register(Req("w0"), absl::Now() + absl::Seconds(1)).ok());
  EXPECT_EQ(reg.WaitUntilReady(absl::Now() + absl::Milliseconds(20)).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(reg.Heartbeat(0, "other-cluster").code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(reg.Heartbeat(0, "c1").ok());
  EXPECT_TRUE(reg.WaitUntilReady(absl::Now() + absl::Milliseconds(20)).ok());
  EXPECT_TRUE(reg.DeadRanks(absl::Seconds(5)).empty());
  absl::SleepFor(absl::Milliseconds(30));
  EXPECT_EQ(reg.DeadRanks(absl::Milliseconds(10)), std::vector<int>{0});
  EXPECT_EQ(reg.Describe(0), "rank 0 (w0, pid 100)");
}

}  // namespace
}  // namespace meshrun
