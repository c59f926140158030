// The shared-memory ring: frames and fragments, messages handed over where they lie, deferred
// messages, full rings, wake-ups and segment names. Producer and consumer are two mappings of one
// segment in this process (the e2e tests run them in separate processes).
#include "worker/shm_ring.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace meshrun {
namespace {

using ::testing::HasSubstr;

std::string UniqueName(const std::string& what) {
  static int counter = 0;
  return absl::StrCat("/meshrun-test-", what, "-", getpid(), "-", counter++);
}

std::string Pattern(size_t n, int seed) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 131 + seed * 7) % 251);
  return s;
}

bool ShmNameExists(const std::string& name) {
  return access(("/dev/shm" + name).c_str(), F_OK) == 0;
}

struct Received {
  uint64_t tag;
  uint64_t epoch;
  std::string data;
  bool in_place = false;                   // passed through a sink, not copied out
  std::vector<size_t> piece_offsets = {};  // where each piece the sink got began
};

// Collects what a ring drains: the messages tagged in `in_place_tags` are taken through a sink
// (if Drain offers them) unless `defer` is set, the rest copied or, while `defer` is set, left.
class Collector : public ShmRing::Consumer {
 public:
  explicit Collector(std::set<uint64_t> in_place_tags = {})
      : in_place_tags_(std::move(in_place_tags)) {}
  const RecvSink* BeginInPlace(uint64_t epoch, uint64_t tag, size_t size) override {
    if (defer || in_place_tags_.count(tag) == 0) return nullptr;  // deferring: nothing posted
    current_ = Received{tag, epoch, std::string(size, '\0'), true};
    return &sink_;
  }
  void EndInPlace() override { got.push_back(std::move(current_)); }
  bool Defer(uint64_t tag) override {
    ++defer_asked;
    return defer;
  }
  void Deliver(uint64_t epoch, uint64_t tag, std::string message) override {
    got.push_back({tag, epoch, std::move(message)});
  }

  std::vector<Received> got;
  bool defer = false;   // what Defer answers
  int defer_asked = 0;  // how often it was asked

 private:
  const std::set<uint64_t> in_place_tags_;
  Received current_;
  std::function<void(size_t, const char*, size_t)> fill_ = [this](size_t offset, const char* data,
                                                                  size_t n) {
    ASSERT_LE(offset + n, current_.data.size());
    std::memcpy(current_.data.data() + offset, data, n);
    current_.piece_offsets.push_back(offset);
  };
  RecvSink sink_{fill_};
};

// Creates the 8 KiB ring `name` and maps it a second time, as its receiver does.
void MakeRing(const std::string& name, std::unique_ptr<ShmRing>* producer,
              std::unique_ptr<ShmRing>* consumer) {
  absl::StatusOr<std::unique_ptr<ShmRing>> created = ShmRing::Create(name, 8192);
  ASSERT_TRUE(created.ok()) << created.status();
  absl::StatusOr<std::unique_ptr<ShmRing>> opened = ShmRing::OpenAndUnlink(name);
  ASSERT_TRUE(opened.ok()) << opened.status();
  *producer = *std::move(created);
  *consumer = *std::move(opened);
}

TEST(ShmRingTest, MessagesLargerThanTheRingArriveWholeAndInOrder) {
  const std::string name = UniqueName("order");
  std::unique_ptr<ShmRing> producer, consumer;
  ASSERT_NO_FATAL_FAILURE(MakeRing(name, &producer, &consumer));
  EXPECT_FALSE(ShmNameExists(name)) << "the reader removes the name once it has mapped the ring";
  EXPECT_EQ(consumer->capacity(), 8192u);

  // Empty, one byte, exactly one fragment (half the ring minus the frame header), one more than
  // that, many ring-fulls, and a small one after them.
  const std::vector<size_t> sizes = {0, 1, 4096 - 32, 4096 - 31, 100000, 13};
  std::thread writer([&] {
    for (size_t i = 0; i < sizes.size(); ++i) {
      absl::Status s = producer->Write(/*epoch=*/1, 1000 + i, Pattern(sizes[i], i),
                                       absl::Now() + absl::Seconds(20), absl::Milliseconds(50),
                                       [] { return absl::OkStatus(); });
      ASSERT_TRUE(s.ok()) << s;
    }
  });
  Collector collector;
  std::vector<Received>& got = collector.got;
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (got.size() < sizes.size() && absl::Now() < give_up) {
    absl::Status s = consumer->Drain(absl::Milliseconds(50), collector);
    ASSERT_TRUE(s.ok()) << s;
  }
  writer.join();
  ASSERT_EQ(got.size(), sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(got[i].tag, 1000 + i);
    EXPECT_TRUE(got[i].data == Pattern(sizes[i], i))
        << "message " << i << " of " << sizes[i] << " bytes";
  }
}

TEST(ShmRingTest, AWholeMessageGoesThroughTheSinkWhereItLiesInPiecesCutAtTheRingsEnd) {
  const std::string name = UniqueName("inplace");
  std::unique_ptr<ShmRing> producer, consumer;
  ASSERT_NO_FATAL_FAILURE(MakeRing(name, &producer, &consumer));
  // Frames take 32 + 3000 bytes: message 1 lies at [32, 3032), message 2 (declined, so copied)
  // after it, message 3 from byte 6096 wraps at 8192 after 2096 bytes; message 4 (5000 bytes)
  // travels as two fragments, so it is copied however its tag is posted.
  const std::vector<size_t> sizes = {3000, 3000, 3000, 5000};
  Collector collector({1, 3, 4});
  for (size_t i = 0; i < sizes.size(); ++i) {
    std::thread writer([&] {
      ASSERT_TRUE(producer
                      ->Write(/*epoch=*/1, i + 1, Pattern(sizes[i], i),
                              absl::Now() + absl::Seconds(20), absl::Milliseconds(50),
                              [] { return absl::OkStatus(); })
                      .ok());
    });
    const absl::Time give_up = absl::Now() + absl::Seconds(20);
    while (collector.got.size() < i + 1 && absl::Now() < give_up) {
      ASSERT_TRUE(consumer->Drain(absl::Milliseconds(50), collector).ok());
    }
    writer.join();
  }
  const std::vector<Received>& got = collector.got;
  ASSERT_EQ(got.size(), sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(got[i].tag, i + 1);
    EXPECT_TRUE(got[i].data == Pattern(sizes[i], i)) << "message " << i + 1;
  }
  EXPECT_TRUE(got[0].in_place);
  EXPECT_EQ(got[0].piece_offsets, std::vector<size_t>({0}));
  EXPECT_FALSE(got[1].in_place);
  EXPECT_TRUE(got[2].in_place);
  EXPECT_EQ(got[2].piece_offsets, std::vector<size_t>({0, 2096}));
  EXPECT_FALSE(got[3].in_place) << "a message in several fragments is never in the ring whole";
}

// Drains `ring` into `collector` until it holds `count` messages (or 20 s pass).
void DrainUntil(ShmRing& ring, Collector& collector, size_t count) {
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (collector.got.size() < count && absl::Now() < give_up) {
    ASSERT_TRUE(ring.Drain(absl::Milliseconds(20), collector).ok());
  }
}

TEST(ShmRingTest, ADeferredMessageStaysUntilWantedAProducerWithNoRoomGetsTheOldestCopiedOut) {
  const std::string name = UniqueName("defer");
  std::unique_ptr<ShmRing> producer, consumer;
  ASSERT_NO_FATAL_FAILURE(MakeRing(name, &producer, &consumer));
  auto write = [&](uint64_t tag, uint64_t epoch = 1) {
    return producer->Write(epoch, tag, Pattern(3000, tag), absl::Now() + absl::Seconds(20),
                           absl::Milliseconds(50), [] { return absl::OkStatus(); });
  };
  Collector collector({1, 5});
  collector.defer = true;

  // No one wants message 1 yet: it stays in the ring, however often the consumer looks.
  ASSERT_TRUE(write(1).ok());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(consumer->Drain(absl::Milliseconds(20), collector).ok());
  EXPECT_TRUE(collector.got.empty());
  EXPECT_GE(collector.defer_asked, 3);
  // Wanted (and its receive posted): it goes through the sink.
  collector.defer = false;
  DrainUntil(*consumer, collector, 1);
  ASSERT_EQ(collector.got.size(), 1u);
  EXPECT_TRUE(collector.got[0].in_place);

  // Messages 2 and 3 fill the ring while deferred; message 4 finds no room, so the producer
  // posts what it needs and the consumer copies out the oldest, 2, which makes room enough: 3
  // and 4 stay, to come out in order when wanted, each with the epoch it was written in.
  collector.defer = true;
  std::thread writer([&] {
    for (uint64_t tag : {2, 3, 4}) ASSERT_TRUE(write(tag).ok()) << "message " << tag;
  });
  DrainUntil(*consumer, collector, 2);
  writer.join();
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(consumer->Drain(absl::Milliseconds(20), collector).ok());
  ASSERT_EQ(collector.got.size(), 2u) << "only as much as the producer needed is copied out";
  EXPECT_EQ(collector.got[1].tag, 2u);
  EXPECT_FALSE(collector.got[1].in_place);
  EXPECT_TRUE(collector.got[1].data == Pattern(3000, 2));
  collector.defer = false;
  DrainUntil(*consumer, collector, 4);
  ASSERT_TRUE(write(5, /*epoch=*/7).ok());
  DrainUntil(*consumer, collector, 5);
  ASSERT_EQ(collector.got.size(), 5u);
  for (int i = 2; i < 5; ++i) {
    EXPECT_EQ(collector.got[i].tag, static_cast<uint64_t>(i + 1));
    EXPECT_EQ(collector.got[i].epoch, i + 1 == 5 ? 7u : 1u) << "message " << i + 1;
    EXPECT_TRUE(collector.got[i].data == Pattern(3000, i + 1)) << "message " << i + 1;
  }
  EXPECT_TRUE(collector.got[4].in_place);
}

TEST(ShmRingTest, AFullRingTimesOutOrStopsWhenToldAndAnAbandonedMessageIsSkipped) {
  const std::string name = UniqueName("full");
  std::unique_ptr<ShmRing> producer, consumer;
  ASSERT_NO_FATAL_FAILURE(MakeRing(name, &producer, &consumer));
  const auto ok = [] { return absl::OkStatus(); };

  // No one drains: the first fragment fits, the rest of a 20000-byte message does not.
  const absl::Time start = absl::Now();
  absl::Status s = producer->Write(/*epoch=*/1, 1, Pattern(20000, 1),
                                   start + absl::Milliseconds(300), absl::Milliseconds(50), ok);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(), HasSubstr("stayed full"));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(300));

  int calls = 0;
  s = producer->Write(
      /*epoch=*/1, 2, Pattern(20000, 2), absl::Now() + absl::Seconds(20), absl::Milliseconds(20),
      [&] { return ++calls < 3 ? absl::OkStatus() : absl::AbortedError("told to stop"); });
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_EQ(calls, 3);

  // Only message 3 comes out: the fragments of the two abandoned ones are dropped.
  Collector collector;
  std::vector<Received>& got = collector.got;
  std::thread writer([&] {
    EXPECT_TRUE(producer
                    ->Write(/*epoch=*/1, 3, Pattern(5000, 3), absl::Now() + absl::Seconds(20),
                            absl::Milliseconds(50), ok)
                    .ok());
  });
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (got.empty() && absl::Now() < give_up) {
    ASSERT_TRUE(consumer->Drain(absl::Milliseconds(50), collector).ok());
  }
  writer.join();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].tag, 3u);
  EXPECT_TRUE(got[0].data == Pattern(5000, 3));
}

TEST(ShmRingTest, WriteWakesTheConsumerOnlyWhileItAsksToBeWoken) {
  const std::string name = UniqueName("wake");
  std::unique_ptr<ShmRing> producer, consumer;
  ASSERT_NO_FATAL_FAILURE(MakeRing(name, &producer, &consumer));
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  auto write = [&](uint64_t tag) {
    ASSERT_TRUE(producer
                    ->Write(0, tag, "abc", deadline, absl::Milliseconds(10),
                            [] { return absl::OkStatus(); })
                    .ok());
  };
  write(1);
  EXPECT_EQ(producer->data_wakes(), 0u) << "no one asked to be woken";
  consumer->SetWakeOnData(true);
  write(2);
  write(3);
  EXPECT_EQ(producer->data_wakes(), 2u);
  consumer->SetWakeOnData(false);
  write(4);
  EXPECT_EQ(producer->data_wakes(), 2u);
  // Every message is there either way, in order.
  Collector collector;
  ASSERT_TRUE(consumer->Drain(absl::Milliseconds(1), collector).ok());
  ASSERT_EQ(collector.got.size(), 4u);
  for (uint64_t i = 0; i < 4; ++i) EXPECT_EQ(collector.got[i].tag, i + 1);
}

TEST(ShmRingTest, AProducerWaitingForRoomIsWokenOnlyThenAndAtOnce) {
  const std::string name = UniqueName("room");
  std::unique_ptr<ShmRing> producer, consumer;
  ASSERT_NO_FATAL_FAILURE(MakeRing(name, &producer, &consumer));
  const auto ok = [] { return absl::OkStatus(); };
  // Messages that fit: consuming them wakes no one.
  for (uint64_t tag = 1; tag <= 3; ++tag) {
    ASSERT_TRUE(producer
                    ->Write(1, tag, Pattern(1000, 1), absl::Now() + absl::Seconds(10),
                            absl::Seconds(10), ok)
                    .ok());
  }
  Collector collector;
  ASSERT_TRUE(consumer->Drain(absl::Milliseconds(1), collector).ok());
  ASSERT_EQ(collector.got.size(), 3u);
  EXPECT_EQ(consumer->space_wakes(), 0u) << "no producer waited for room";

  // A message of three ring-fulls, with a producer that never looks again on its own (its poll
  // is an hour): only the consumer's wake-ups let it finish before its deadline. The consumer
  // starts once the producer waits for room (keep_waiting runs just before it sleeps).
  absl::Status written;
  std::atomic<bool> producer_waits{false};
  std::thread writer([&] {
    written = producer->Write(1, 4, Pattern(3 * 8192, 4), absl::Now() + absl::Seconds(30),
                              absl::Hours(1), [&] {
                                producer_waits.store(true);
                                return absl::OkStatus();
                              });
  });
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (!producer_waits.load() && absl::Now() < give_up) std::this_thread::yield();
  while (collector.got.size() < 4 && absl::Now() < give_up) {
    ASSERT_TRUE(consumer->Drain(absl::Milliseconds(50), collector).ok());
  }
  writer.join();
  EXPECT_TRUE(written.ok()) << written;
  ASSERT_EQ(collector.got.size(), 4u);
  EXPECT_TRUE(collector.got[3].data == Pattern(3 * 8192, 4));
  EXPECT_GT(consumer->space_wakes(), 0u);
}

TEST(ShmRingTest, NamesAndSegmentsAreChecked) {
  const std::string name = UniqueName("names");
  auto first = ShmRing::Create(name, 8192);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(ShmRing::Create(name, 8192).status().code(), absl::StatusCode::kAlreadyExists);
  (*first)->Unlink();
  EXPECT_FALSE(ShmNameExists(name));
  EXPECT_EQ(ShmRing::OpenAndUnlink(UniqueName("absent")).status().code(),
            absl::StatusCode::kNotFound);

  const std::string junk = UniqueName("junk");
  const int fd = shm_open(junk.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 64 * 1024), 0);
  close(fd);
  absl::Status s = ShmRing::OpenAndUnlink(junk).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("not a meshrun ring"));
  EXPECT_FALSE(ShmNameExists(junk));
}

}  // namespace
}  // namespace meshrun
