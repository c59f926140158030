// The shared-memory ring and transport: frames and fragments, full rings, dead and aborted peers,
// and the routing between shared memory and gRPC. Ranks are threads of this process, each with
// its own mapping of the rings (the e2e tests run them as separate processes).
#include "worker/shm_transport.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <thread>

#include "absl/strings/str_cat.h"
#include "core/collectives/communicator.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testutil/transport_set.h"
#include "worker/shm_ring.h"

namespace meshrun {
namespace {

using ::testing::HasSubstr;
using testing::TransportKind;
using testing::TransportSet;
using testing::TransportSetOptions;

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
  std::string data;
};

TEST(ShmRingTest, MessagesLargerThanTheRingArriveWholeAndInOrder) {
  const std::string name = UniqueName("order");
  auto producer = ShmRing::Create(name, 8192);
  ASSERT_TRUE(producer.ok()) << producer.status();
  auto consumer = ShmRing::OpenAndUnlink(name);
  ASSERT_TRUE(consumer.ok()) << consumer.status();
  EXPECT_FALSE(ShmNameExists(name)) << "the reader removes the name once it has mapped the ring";
  EXPECT_EQ((*consumer)->capacity(), 8192u);

  // Empty, one byte, exactly one fragment (half the ring minus the frame header), one more than
  // that, many ring-fulls, and a small one after them.
  const std::vector<size_t> sizes = {0, 1, 4096 - 24, 4096 - 23, 100000, 13};
  std::thread writer([&] {
    for (size_t i = 0; i < sizes.size(); ++i) {
      absl::Status s =
          (*producer)->Write(1000 + i, Pattern(sizes[i], i), absl::Now() + absl::Seconds(20),
                             absl::Milliseconds(50), [] { return absl::OkStatus(); });
      ASSERT_TRUE(s.ok()) << s;
    }
  });
  std::vector<Received> got;
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (got.size() < sizes.size() && absl::Now() < give_up) {
    absl::Status s = (*consumer)->Drain(absl::Milliseconds(50), [&](uint64_t tag, std::string m) {
      got.push_back({tag, std::move(m)});
    });
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

TEST(ShmRingTest, AFullRingTimesOutOrStopsWhenToldAndAnAbandonedMessageIsSkipped) {
  const std::string name = UniqueName("full");
  auto producer = ShmRing::Create(name, 8192);
  ASSERT_TRUE(producer.ok()) << producer.status();
  auto consumer = ShmRing::OpenAndUnlink(name);
  ASSERT_TRUE(consumer.ok()) << consumer.status();
  const auto ok = [] { return absl::OkStatus(); };

  // No one drains: the first fragment fits, the rest of a 20000-byte message does not.
  const absl::Time start = absl::Now();
  absl::Status s = (*producer)->Write(1, Pattern(20000, 1), start + absl::Milliseconds(300),
                                      absl::Milliseconds(50), ok);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(), HasSubstr("stayed full"));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(300));

  int calls = 0;
  s = (*producer)->Write(
      2, Pattern(20000, 2), absl::Now() + absl::Seconds(20), absl::Milliseconds(20),
      [&] { return ++calls < 3 ? absl::OkStatus() : absl::AbortedError("told to stop"); });
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_EQ(calls, 3);

  // Only message 3 comes out: the fragments of the two abandoned ones are dropped.
  std::vector<Received> got;
  std::thread writer([&] {
    EXPECT_TRUE((*producer)
                    ->Write(3, Pattern(5000, 3), absl::Now() + absl::Seconds(20),
                            absl::Milliseconds(50), ok)
                    .ok());
  });
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (got.empty() && absl::Now() < give_up) {
    ASSERT_TRUE((*consumer)
                    ->Drain(absl::Milliseconds(50),
                            [&](uint64_t tag, std::string m) {
                              got.push_back({tag, std::move(m)});
                            })
                    .ok());
  }
  writer.join();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].tag, 3u);
  EXPECT_TRUE(got[0].data == Pattern(5000, 3));
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

TEST(ShmHostIdTest, IsStableAndNamesTheBootAndNamespaces) {
  const std::string id = ShmHostId();
  ASSERT_FALSE(id.empty());
  EXPECT_EQ(id, ShmHostId());
  EXPECT_THAT(id, HasSubstr("pid:["));
  EXPECT_THAT(id, HasSubstr("net:["));
}

std::vector<int> Iota(int n) {
  std::vector<int> v(n);
  for (int i = 0; i < n; ++i) v[i] = i;
  return v;
}

TEST(ShmTransportTest, AllReduceGoesThroughSharedMemoryOnly) {
  TransportSet ts(TransportKind::kShm, 4);
  CollectiveOptions opts;
  opts.chunk_bytes = 3000;  // 40000-byte segments: many chunks, rings of 8 KiB kept full
  std::vector<std::vector<float>> data(4, std::vector<float>(40000));
  std::vector<absl::Status> status(4);
  ts.RunRanks([&](int r) {
    for (size_t i = 0; i < data[r].size(); ++i) data[r][i] = static_cast<float>(r + i % 7);
    Communicator comm(ts.at(r), Iota(4), opts);
    status[r] = comm.AllReduce(data[r].data(), static_cast<int64_t>(data[r].size()), v1::DTYPE_F32,
                               ReduceOp::kSum);
  });
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(status[r].ok()) << status[r];
    for (size_t i = 0; i < data[r].size(); ++i)
      ASSERT_EQ(data[r][i], 6.0f + 4 * (i % 7)) << r << " " << i;
    auto* t = static_cast<ShmTransport*>(ts.at(r));
    EXPECT_GT(t->shm_messages_sent(), 0) << r;
    EXPECT_EQ(t->remote_messages_sent(), 0) << r;
  }
}

TEST(ShmTransportTest, PeersOnAnotherHostGoThroughGrpc) {
  TransportSetOptions o;
  o.host_ids = {"h", "h", "other"};
  TransportSet ts(TransportKind::kShm, 3, o);
  auto* t0 = static_cast<ShmTransport*>(ts.at(0));
  EXPECT_TRUE(t0->CoLocated(1));
  EXPECT_FALSE(t0->CoLocated(2));
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(t0->Send(1, 10 + i, Pattern(3000 * i, i), deadline).ok());
    ASSERT_TRUE(t0->Send(2, 10 + i, Pattern(3000 * i, i), deadline).ok());
  }
  EXPECT_TRUE(t0->SendsThroughShm(1));
  EXPECT_FALSE(t0->SendsThroughShm(2));
  EXPECT_EQ(t0->shm_messages_sent(), 5);
  EXPECT_EQ(t0->remote_messages_sent(), 5);
  for (int peer : {1, 2}) {
    for (int i = 0; i < 5; ++i) {
      absl::StatusOr<std::string> m = ts.at(peer)->Recv(0, 10 + i, deadline);
      ASSERT_TRUE(m.ok()) << "rank " << peer << " message " << i << ": " << m.status();
      EXPECT_TRUE(*m == Pattern(3000 * i, i));
    }
  }
}

TEST(ShmTransportTest, WhenNoRingFitsInDevShmTheLinkFallsBackToGrpc) {
  TransportSetOptions o;
  o.shm_ring_bytes = size_t{1} << 50;  // no /dev/shm holds a petabyte: posix_fallocate fails
  TransportSet ts(TransportKind::kShm, 2, o);
  auto* t0 = static_cast<ShmTransport*>(ts.at(0));
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  ASSERT_TRUE(t0->Send(1, 7, "over grpc", deadline).ok());
  ASSERT_TRUE(t0->Send(1, 8, "still grpc", deadline).ok());
  EXPECT_TRUE(t0->CoLocated(1));
  EXPECT_FALSE(t0->SendsThroughShm(1));
  EXPECT_EQ(t0->remote_messages_sent(), 2);
  EXPECT_EQ(t0->shm_messages_sent(), 0);
  EXPECT_EQ(*ts.at(1)->Recv(0, 7, deadline), "over grpc");
  EXPECT_EQ(*ts.at(1)->Recv(0, 8, deadline), "still grpc");
}

// Rank 1 never drains its ring (it has no shared-memory receiver), so rank 0's ring fills up.
TransportSetOptions UndrainedPeer(int64_t pid) {
  TransportSetOptions o;
  o.pids = {getpid(), pid};
  o.bare_ranks = {1};
  return o;
}

TEST(ShmTransportTest, SendToADeadPeerFailsNamingItsRank) {
  const pid_t child = fork();
  if (child == 0) _exit(0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);  // a pid that no longer runs
  TransportSet bare(TransportKind::kShm, 2, UndrainedPeer(child));
  const absl::Time start = absl::Now();
  absl::Status s = bare.at(0)->Send(1, 1, Pattern(100000, 1), start + absl::Seconds(20));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("rank 1 (pid ", child, ") exited")));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST(ShmTransportTest, AbortWakesASendWaitingForRingSpace) {
  TransportSet ts(TransportKind::kShm, 2, UndrainedPeer(getpid()));
  absl::Status s;
  const absl::Time start = absl::Now();
  std::thread sender(
      [&] { s = ts.at(0)->Send(1, 1, Pattern(100000, 1), start + absl::Seconds(20)); });
  absl::SleepFor(absl::Milliseconds(200));
  ts.at(0)->Abort(absl::AbortedError("job cancelled"));
  sender.join();
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_THAT(s.message(), HasSubstr("job cancelled"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));

  ts.at(0)->Reset();
  absl::Status late = ts.at(0)->Send(1, 2, "x", absl::Now() + absl::Milliseconds(300));
  EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded)
      << "the ring is still full after Reset: " << late;
  EXPECT_THAT(late.message(), HasSubstr("send to rank 1 timed out"));
}

}  // namespace
}  // namespace meshrun
