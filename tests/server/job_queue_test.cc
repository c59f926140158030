#include "server/job_queue.h"

#include <algorithm>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

namespace meshrun {
namespace {

TEST(JobQueueTest, AnIdleQueueRunsAtOnceAndABusyOneMakesTheNextWait) {
  JobQueue q;
  int ahead = -1;
  const uint64_t first = q.Join(&ahead);
  EXPECT_EQ(ahead, 0);
  ASSERT_TRUE(q.WaitTurn(first, absl::ZeroDuration()));
  const uint64_t second = q.Join(&ahead);
  EXPECT_EQ(ahead, 1);
  EXPECT_FALSE(q.WaitTurn(second, absl::Milliseconds(20))) << "the first still runs";
  q.Done(first);
  EXPECT_TRUE(q.WaitTurn(second, absl::ZeroDuration()));
}

TEST(JobQueueTest, WaitingJobsRunInArrivalOrderOneAtATime) {
  JobQueue q;
  int ahead = 0;
  const uint64_t running = q.Join(&ahead);
  ASSERT_TRUE(q.WaitTurn(running, absl::ZeroDuration()));
  std::vector<uint64_t> tickets;
  for (int i = 0; i < 4; ++i) {
    tickets.push_back(q.Join(&ahead));
    EXPECT_EQ(ahead, i + 1);
  }
  absl::Mutex mu;
  std::vector<int> order;
  int concurrent = 0, most = 0;
  std::vector<std::thread> jobs;
  for (int i = 3; i >= 0; --i) {  // started in reverse: the queue, not the threads, orders them
    jobs.emplace_back([&, i] {
      while (!q.WaitTurn(tickets[i], absl::Milliseconds(10))) {
      }
      {
        absl::MutexLock lock(&mu);
        order.push_back(i);
        most = std::max(most, ++concurrent);
      }
      absl::SleepFor(absl::Milliseconds(5));
      {
        absl::MutexLock lock(&mu);
        --concurrent;
      }
      q.Done(tickets[i]);
    });
  }
  absl::SleepFor(absl::Milliseconds(50));
  {
    absl::MutexLock lock(&mu);
    EXPECT_TRUE(order.empty()) << "none runs while the first does";
  }
  q.Done(running);
  for (std::thread& t : jobs) t.join();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(most, 1);
}

TEST(JobQueueTest, AJobThatLeavesGivesItsPlaceToTheNext) {
  JobQueue q;
  int ahead = 0;
  const uint64_t running = q.Join(&ahead);
  ASSERT_TRUE(q.WaitTurn(running, absl::ZeroDuration()));
  const uint64_t gone = q.Join(&ahead);
  const uint64_t next = q.Join(&ahead);
  EXPECT_EQ(ahead, 2);
  q.Leave(gone);
  q.Done(running);
  EXPECT_TRUE(q.WaitTurn(next, absl::ZeroDuration()));
  EXPECT_FALSE(q.WaitTurn(gone, absl::ZeroDuration()));
  q.Join(&ahead);
  EXPECT_EQ(ahead, 1) << "only `next`, running, is ahead";
}

}  // namespace
}  // namespace meshrun
