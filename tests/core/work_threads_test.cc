#include "core/port/work_threads.h"

#include <atomic>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace meshrun {
namespace {

TEST(WorkThreadsTest, EveryWorkRunsAndTheDestructorWaitsForTheUnfinished) {
  std::atomic<int> ran{0};
  absl::Notification release;
  std::atomic<int> released{0};
  {
    WorkThreads threads;
    for (int i = 0; i < 200; ++i) threads.Start([&] { ++ran; });  // finished ones are joined
    for (int i = 0; i < 3; ++i) {
      threads.Start([&] {
        release.WaitForNotification();
        ++released;
      });
    }
    threads.Start([&] { release.Notify(); });
  }  // joins the three waiting ones
  EXPECT_EQ(ran.load(), 200);
  EXPECT_EQ(released.load(), 3);
}

TEST(WorkThreadsTest, WorkThatWaitsDoesNotHoldUpOtherWork) {
  absl::Notification first_waiting, second_ran;
  WorkThreads threads;
  threads.Start([&] {
    first_waiting.Notify();
    second_ran.WaitForNotification();  // ends only once the second one has run
  });
  first_waiting.WaitForNotification();
  threads.Start([&] { second_ran.Notify(); });
  EXPECT_TRUE(second_ran.WaitForNotificationWithTimeout(absl::Seconds(30)));
}

}  // namespace
}  // namespace meshrun
