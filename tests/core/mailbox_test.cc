// Mailbox: per-sender FIFOs with deadlines, and how a peer's failure mark is reported.
#include "core/collectives/mailbox.h"

#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace meshrun {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kGrace = absl::Milliseconds(150);

TEST(MailboxTest, AFailedPeerIsReportedOnceTheGraceHasPassed) {
  Mailbox box(2, kGrace);
  box.MarkPeerFailed(1, absl::UnavailableError("rank 1 disconnected"));
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> m = box.Take(1, 7, start + absl::Seconds(20));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(m.status().message(), HasSubstr("rank 1 disconnected"));
  EXPECT_GE(absl::Now() - start, kGrace);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST(MailboxTest, QueuedMessagesComeFirstAndAMarkDuringAWaitIsReportedAfterTheGrace) {
  Mailbox box(2, kGrace);
  box.Deliver(1, 7, "before");
  box.MarkPeerFailed(1, absl::UnavailableError("rank 1 disconnected"));
  EXPECT_EQ(*box.Take(1, 7, absl::Now() + absl::Seconds(1)), "before");

  Mailbox waiting(2, kGrace);
  const absl::Time start = absl::Now();
  std::thread marker([&] {
    absl::SleepFor(absl::Milliseconds(50));
    waiting.MarkPeerFailed(1, absl::UnavailableError("rank 1 disconnected"));
  });
  absl::StatusOr<std::string> m = waiting.Take(1, 8, start + absl::Seconds(20));
  marker.join();
  EXPECT_EQ(m.status().code(), absl::StatusCode::kUnavailable) << m.status();
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(50) + kGrace);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

// A peer that cancelled a stream in an abort is marked failed when the end of that stream is seen
// (possibly after this side's Reset); its next message shows it alive.
TEST(MailboxTest, AMessageFromAMarkedPeerClearsTheMark) {
  Mailbox box(2, kGrace);
  box.MarkPeerFailed(1, absl::UnavailableError("rank 1 disconnected"));
  std::thread sender([&] {
    absl::SleepFor(absl::Milliseconds(30));
    box.Deliver(1, 9, "alive");
  });
  EXPECT_EQ(*box.Take(1, 9, absl::Now() + absl::Seconds(5)), "alive");
  sender.join();
  absl::StatusOr<std::string> m = box.Take(1, 10, absl::Now() + kGrace * 2);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kDeadlineExceeded)
      << "the mark is gone: " << m.status();
  EXPECT_THAT(m.status().message(), HasSubstr("rank 1"));
}

TEST(MailboxTest, AControlMessageAlsoClearsTheMarkAndSkipsTheQueue) {
  Mailbox box(2, kGrace);
  std::string seen;
  box.SetControlHandler(
      99, [&](int src, const std::string& payload) { seen = absl::StrCat(src, ":", payload); });
  box.MarkPeerFailed(1, absl::UnavailableError("rank 1 disconnected"));
  box.Deliver(1, 99, "ring-name");
  EXPECT_EQ(seen, "1:ring-name");
  absl::StatusOr<std::string> m = box.Take(1, 10, absl::Now() + kGrace * 2);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kDeadlineExceeded) << m.status();
  box.SetControlHandler(99, nullptr);
}

}  // namespace
}  // namespace meshrun
