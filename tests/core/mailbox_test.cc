// Mailbox: per-sender FIFOs with deadlines, and how a peer's failure mark is reported.
#include "core/collectives/mailbox.h"

#include <atomic>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
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
  box.Deliver(1, /*epoch=*/0, 7, "before");
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
    box.Deliver(1, /*epoch=*/0, 9, "alive");
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
  box.Deliver(1, /*epoch=*/0, 99, "ring-name");
  EXPECT_EQ(seen, "1:ring-name");
  absl::StatusOr<std::string> m = box.Take(1, 10, absl::Now() + kGrace * 2);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kDeadlineExceeded) << m.status();
  box.SetControlHandler(99, nullptr);
}

// What a transport that holds messages in its own memory sees: a receive posted, then the
// message handed over in place. Returns what the sink received.
std::string Gathered(const std::vector<std::pair<size_t, std::string>>& pieces, size_t size) {
  std::string out(size, '?');
  for (const auto& [offset, bytes] : pieces) out.replace(offset, bytes.size(), bytes);
  return out;
}

TEST(MailboxTest, APostedReceiveIsFilledInPlaceOnlyByTheMessageItWaitsFor) {
  Mailbox box(2, kGrace);
  std::vector<int> woken;
  // Called on the receiving thread.
  box.SetWaitListener([&](int src, Mailbox::WaitEvent event) {
    if (event == Mailbox::WaitEvent::kPoll) woken.push_back(src);
  });
  std::vector<std::pair<size_t, std::string>> pieces;
  absl::Status result;
  std::thread receiver([&] {
    result = box.TakeInto(1, 7, 8, absl::Now() + absl::Seconds(20),
                          [&](size_t offset, const char* data, size_t n) {
                            pieces.emplace_back(offset, std::string(data, n));
                          });
  });
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (!box.Waiting(1) && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_TRUE(box.Waiting(1));
  EXPECT_FALSE(box.Waiting(0));
  EXPECT_EQ(box.BeginInPlace(1, /*epoch=*/0, 8, 8), nullptr) << "another tag";
  EXPECT_EQ(box.BeginInPlace(1, /*epoch=*/0, 7, 9), nullptr) << "another size";
  EXPECT_EQ(box.BeginInPlace(0, /*epoch=*/0, 7, 8), nullptr) << "another sender";
  const RecvSink* sink = box.BeginInPlace(1, /*epoch=*/0, 7, 8);
  ASSERT_NE(sink, nullptr);
  EXPECT_FALSE(box.Waiting(1)) << "the message is found: nothing after it is waited for yet";
  EXPECT_EQ(box.BeginInPlace(1, /*epoch=*/0, 7, 8), nullptr) << "claimed once";
  (*sink)(0, "abcd", 4);
  (*sink)(4, "efgh", 4);
  box.EndInPlace(1);
  receiver.join();
  EXPECT_TRUE(result.ok()) << result;
  EXPECT_EQ(Gathered(pieces, 8), "abcdefgh");
  EXPECT_EQ(woken, std::vector<int>({1}));
}

// A transport whose message turns up in its memory only on the listener's `arrives_at`-th poll.
// Returns the TakeInto's result, what it received and how many polls it made.
struct SpinOutcome {
  absl::Status status;
  std::string got;
  int polls = 0;
};
SpinOutcome ReceiveWithSpin(absl::Duration spin, int arrives_at) {
  Mailbox box(2, kGrace, spin);
  SpinOutcome out;
  box.SetWaitListener([&](int src, Mailbox::WaitEvent event) {
    if (event == Mailbox::WaitEvent::kAwake) return;
    if (++out.polls != arrives_at) return;
    const RecvSink* sink = box.BeginInPlace(src, /*epoch=*/0, 7, 4);
    ASSERT_NE(sink, nullptr);
    (*sink)(0, "spun", 4);
    box.EndInPlace(src);
  });
  out.status = box.TakeInto(1, 7, 4, absl::Now() + absl::Milliseconds(300),
                            [&](size_t, const char* data, size_t n) { out.got.append(data, n); });
  box.SetWaitListener(nullptr);
  return out;
}

TEST(MailboxTest, ASpinningReceivePollsTheTransportOnItsOwnThreadBeforeItSleeps) {
  // No other thread delivers anything: only the receive's own polls can find the message.
  SpinOutcome spun = ReceiveWithSpin(absl::Seconds(5), /*arrives_at=*/3);
  EXPECT_TRUE(spun.status.ok()) << spun.status;
  EXPECT_EQ(spun.got, "spun");
  EXPECT_EQ(spun.polls, 3);

  // Without spinning the listener is asked twice, when the wait starts and as it goes to sleep,
  // and the receive sleeps.
  SpinOutcome slept = ReceiveWithSpin(absl::ZeroDuration(), /*arrives_at=*/3);
  EXPECT_EQ(slept.status.code(), absl::StatusCode::kDeadlineExceeded) << slept.status;
  EXPECT_EQ(slept.polls, 2);
  EXPECT_EQ(slept.got, "");
}

TEST(MailboxTest, AReceiveTellsTheListenerWhenItSleepsAndWhenThatWaitIsOver) {
  using Event = Mailbox::WaitEvent;
  Mailbox box(2, kGrace);  // no spin: a receive sleeps right after its first poll
  absl::Mutex mu;
  std::vector<Event> events;
  box.SetWaitListener([&](int src, Event event) {
    EXPECT_EQ(src, 1);
    absl::MutexLock lock(&mu);
    events.push_back(event);
  });
  auto seen = [&] {
    absl::MutexLock lock(&mu);
    return events;
  };
  // Delivered by another thread while the receive sleeps: it wakes, and says it is awake.
  std::thread sender([&] {
    const absl::Time give_up = absl::Now() + absl::Seconds(20);
    while (seen().size() < 2 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(1));
    box.Deliver(1, /*epoch=*/0, 7, "late");
  });
  absl::StatusOr<std::string> got = box.Take(1, 7, absl::Now() + absl::Seconds(20));
  sender.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "late");
  EXPECT_EQ(seen(), std::vector<Event>({Event::kPoll, Event::kSleep, Event::kAwake}));

  // A deadline ends the sleep too.
  events.clear();
  EXPECT_EQ(box.Take(1, 8, absl::Now() + absl::Milliseconds(50)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(seen(), std::vector<Event>({Event::kPoll, Event::kSleep, Event::kAwake}));

  // A message found by the poll that kSleep makes ends the wait before it sleeps.
  events.clear();
  box.SetWaitListener([&](int src, Event event) {
    {
      absl::MutexLock lock(&mu);
      events.push_back(event);
    }
    if (event == Event::kSleep) box.Deliver(src, /*epoch=*/0, 9, "just in time");
  });
  got = box.Take(1, 9, absl::Now() + absl::Seconds(20));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "just in time");
  EXPECT_EQ(seen(), std::vector<Event>({Event::kPoll, Event::kSleep, Event::kAwake}));

  // A receive whose message is found while it spins never sleeps.
  Mailbox spinning(2, kGrace, absl::Seconds(20));
  std::vector<Event> spun;
  spinning.SetWaitListener([&](int src, Event event) {
    spun.push_back(event);
    if (spun.size() == 3) spinning.Deliver(src, /*epoch=*/0, 7, "polled");
  });
  got = spinning.Take(1, 7, absl::Now() + absl::Seconds(20));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(spun, std::vector<Event>({Event::kPoll, Event::kPoll, Event::kPoll}));
}

// RecvSink's promise, checked piece by piece: in order, contiguous, every piece but the last
// whole 8-byte words. Returns the bytes received.
class CheckedSink {
 public:
  explicit CheckedSink(size_t size) : size_(size) {}
  void operator()(size_t offset, const char* data, size_t n) {
    EXPECT_EQ(offset, got_.size());
    EXPECT_EQ(offset % 8, 0u) << "a piece starts inside a word";
    if (offset + n < size_) {
      EXPECT_EQ(n % 8, 0u) << "a piece before the last ends inside a word";
    }
    got_.append(data, n);
  }
  const std::string& got() const { return got_; }

 private:
  size_t size_;
  std::string got_;
};

std::string Pattern(size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>('a' + i % 23);
  return s;
}

TEST(SinkStitcherTest, PiecesSplitAnywhereReachTheSinkAsWholeWords) {
  const std::vector<size_t> splits = {3, 5, 13, 1, 0, 16, 2, 7, 1, 9};
  size_t total = 0;
  for (size_t n : splits) total += n;
  const std::string message = Pattern(total);
  CheckedSink checked(total);
  auto sink = [&](size_t o, const char* d, size_t n) { checked(o, d, n); };
  SinkStitcher stitcher(sink);
  size_t at = 0;
  for (size_t n : splits) {
    stitcher.Add(message.data() + at, n);
    at += n;
  }
  stitcher.Finish();
  EXPECT_EQ(checked.got(), message);
}

TEST(MailboxTest, AMessageQueuedInPiecesIsTakenWithoutFlatteningAndWholeWords) {
  Mailbox box(2, kGrace);
  const std::string message = Pattern(1000);
  absl::Cord pieces;  // as a transport's buffers: chunks of odd sizes
  for (size_t at = 0, n = 1; at < message.size(); at += n, n = n * 3 % 97 + 1) {
    pieces.Append(absl::MakeCordFromExternal(absl::string_view(message).substr(at, n),
                                             [](absl::string_view) {}));
  }
  box.Deliver(1, /*epoch=*/0, 7, pieces);
  box.Deliver(1, /*epoch=*/0, 8, pieces);
  CheckedSink checked(message.size());
  ASSERT_TRUE(box.TakeInto(1, 7, message.size(), absl::Now() + absl::Seconds(1),
                           [&](size_t o, const char* d, size_t n) { checked(o, d, n); })
                  .ok());
  EXPECT_EQ(checked.got(), message);
  absl::StatusOr<std::string> flat = box.Take(1, 8, absl::Now() + absl::Seconds(1));
  ASSERT_TRUE(flat.ok()) << flat.status();
  EXPECT_EQ(*flat, message);
}

TEST(MailboxTest, AQueuedMessageGoesFirstAndAWrongOneIsReportedAsBefore) {
  Mailbox box(2, kGrace);
  int woken = 0;
  box.SetWaitListener([&](int, Mailbox::WaitEvent) { ++woken; });
  box.Deliver(1, /*epoch=*/0, 7, "queued!!");
  EXPECT_EQ(box.BeginInPlace(1, /*epoch=*/0, 7, 8), nullptr) << "nothing posted";
  std::string got;
  auto into = [&](size_t offset, const char* data, size_t n) { got.append(data, n); };
  ASSERT_TRUE(box.TakeInto(1, 7, 8, absl::Now() + absl::Seconds(1), into).ok());
  EXPECT_EQ(got, "queued!!");
  EXPECT_EQ(woken, 0) << "a receive that finds its message queued does not wait";

  box.Deliver(1, /*epoch=*/0, 9, "12345");
  absl::Status wrong_size = box.TakeInto(1, 9, 8, absl::Now() + absl::Seconds(1), into);
  EXPECT_EQ(wrong_size.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(wrong_size.message(), HasSubstr("rank 1 sent 5 bytes (tag 9); expected 8"));
  box.Deliver(1, /*epoch=*/0, 10, "12345678");
  absl::Status wrong_tag = box.TakeInto(1, 11, 8, absl::Now() + absl::Seconds(1), into);
  EXPECT_THAT(wrong_tag.message(), HasSubstr("rank 1 sent tag 10 but tag 11 was expected"));
  EXPECT_EQ(got, "queued!!") << "nothing reaches the sink from a wrong message";
}

TEST(MailboxTest, AReceiveClaimedBeforeItsDeadlineReturnsOnlyOnceFilled) {
  Mailbox box(2, kGrace);
  std::string got(4, '?');
  absl::Status result = absl::UnknownError("not returned");
  std::atomic<bool> returned{false};
  std::thread receiver([&] {
    result = box.TakeInto(
        1, 7, 4, absl::Now() + absl::Milliseconds(100),
        [&](size_t offset, const char* data, size_t n) { got.replace(offset, n, data, n); });
    returned.store(true);
  });
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (!box.Waiting(1) && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(1));
  const RecvSink* sink = box.BeginInPlace(1, /*epoch=*/0, 7, 4);
  ASSERT_NE(sink, nullptr);
  absl::SleepFor(absl::Milliseconds(300));  // past the deadline while the sink is being filled
  EXPECT_FALSE(returned.load()) << "the sink writes into the receiver's memory";
  (*sink)(0, "wxyz", 4);
  box.EndInPlace(1);
  receiver.join();
  EXPECT_TRUE(result.ok()) << result;
  EXPECT_EQ(got, "wxyz");

  // Not claimed: the deadline ends it, and a late message is queued, not written in place.
  absl::Status late = box.TakeInto(1, 8, 4, absl::Now() + absl::Milliseconds(50),
                                   [&](size_t, const char*, size_t) { got = "late"; });
  EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded) << late;
  EXPECT_EQ(box.BeginInPlace(1, /*epoch=*/0, 8, 4), nullptr);
  EXPECT_EQ(got, "wxyz");
}

// Collective epochs: what an abandoned collective sent never reaches a later one.
TEST(MailboxTest, MessagesOfAnEarlierEpochAreDroppedQueuedOrLate) {
  Mailbox box(2, kGrace);
  box.Reset(5);
  EXPECT_EQ(box.epoch(), 5u);
  box.Deliver(1, 5, 7, "stale-q!");  // queued in epoch 5, abandoned when 6 starts
  box.Abort(absl::AbortedError("rank 0 failed"));
  box.Reset(5);
  EXPECT_EQ(box.Take(1, 7, absl::Now() + absl::Seconds(1)).status().code(),
            absl::StatusCode::kAborted)
      << "only a later epoch clears an abort";
  box.Deliver(1, 6, 1, "fresh-6!");  // a peer that moved on first: kept
  box.Reset(6);
  box.Deliver(1, 5, 7, "late-5!!");  // still in flight from epoch 5 when 6 started
  EXPECT_EQ(box.stale_dropped(), 2);
  std::string got;
  ASSERT_TRUE(box.TakeInto(1, 1, 8, absl::Now() + absl::Seconds(1),
                           [&](size_t, const char* data, size_t n) { got.append(data, n); })
                  .ok());
  EXPECT_EQ(got, "fresh-6!");
  absl::StatusOr<std::string> none = box.Take(1, 2, absl::Now() + absl::Milliseconds(50));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kDeadlineExceeded) << none.status();
  box.Reset(4);
  EXPECT_EQ(box.epoch(), 6u) << "an earlier epoch is never entered again";
}

TEST(MailboxTest, ATakeThatMeetsALaterEpochFailsAndLeavesItQueued) {
  Mailbox box(2, kGrace);
  box.Reset(3);
  box.Deliver(1, 4, 1, "next-run");
  absl::StatusOr<std::string> m = box.Take(1, 1, absl::Now() + absl::Seconds(1));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kAborted) << m.status();
  EXPECT_THAT(m.status().message(), HasSubstr("rank 1 has moved on to collective epoch 4"));
  box.Reset(4);
  EXPECT_EQ(*box.Take(1, 1, absl::Now() + absl::Seconds(1)), "next-run");
}

TEST(MailboxTest, OnlyAMessageOfTheCurrentEpochIsHandedOverInPlace) {
  Mailbox box(2, kGrace);
  box.Reset(2);
  std::string got;
  absl::Status result;
  std::thread receiver([&] {
    result = box.TakeInto(1, 7, 4, absl::Now() + absl::Seconds(20),
                          [&](size_t, const char* data, size_t n) { got.append(data, n); });
  });
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (!box.Waiting(1) && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(box.BeginInPlace(1, 1, 7, 4), nullptr) << "an earlier epoch's message";
  box.Deliver(1, 1, 7, "old!");  // what the transport then does with it: dropped
  const RecvSink* sink = box.BeginInPlace(1, 2, 7, 4);
  ASSERT_NE(sink, nullptr);
  (*sink)(0, "new!", 4);
  box.EndInPlace(1);
  receiver.join();
  EXPECT_TRUE(result.ok()) << result;
  EXPECT_EQ(got, "new!");
}

}  // namespace
}  // namespace meshrun
