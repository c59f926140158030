// The shared-memory transport: wake-ups of sleeping and polling receives, dead and aborted peers,
// and the routing between shared memory and gRPC. Ranks are threads of this process, each with
// its own mapping of the rings (the e2e tests run them as separate processes).
#include "worker/shm_transport.h"

#include <dirent.h>
#include <sys/wait.h>
#include <unistd.h>

#include <thread>

#include "absl/strings/str_cat.h"
#include "core/collectives/communicator.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testutil/transport_set.h"

namespace meshrun {
namespace {

using ::testing::HasSubstr;
using testing::TransportKind;
using testing::TransportSet;
using testing::TransportSetOptions;

std::string Pattern(size_t n, int seed) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 131 + seed * 7) % 251);
  return s;
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

// Many small all-reduces (each message a few hundred bytes, as a barrier's or a loss's), with
// receives that sleep at once and with receives that poll first. A message whose wake-up went
// missing would wait for the drain thread's poll, which TransportSet makes an hour: the
// collectives' deadline fails first.
void SmallAllReduces(TransportSet& ts, int iterations) {
  const int n = ts.size();
  std::vector<absl::Status> status(n);
  ts.RunRanks([&](int r) {
    CollectiveOptions opts;
    opts.timeout = absl::Seconds(10);
    Communicator comm(ts.at(r), Iota(n), opts);
    std::vector<float> data(100);
    for (int it = 0; it < iterations && status[r].ok(); ++it) {
      for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<float>(r * it + i);
      status[r] = comm.AllReduce(data.data(), static_cast<int64_t>(data.size()), v1::DTYPE_F32,
                                 ReduceOp::kSum);
      for (size_t i = 0; i < data.size() && status[r].ok(); ++i) {
        const float want = static_cast<float>(n * (n - 1) / 2 * it + n * i);
        if (data[i] != want) {
          status[r] = absl::InternalError(
              absl::StrCat("iteration ", it, " element ", i, ": ", data[i], ", want ", want));
        }
      }
    }
  });
  for (int r = 0; r < n; ++r) EXPECT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
}

int64_t DrainWakes(TransportSet& ts) {
  int64_t wakes = 0;
  for (int r = 0; r < ts.size(); ++r)
    wakes += static_cast<ShmTransport*>(ts.at(r))->shm_drain_wakes();
  return wakes;
}

TEST(ShmTransportTest, AReceiveThatSleepsIsWokenByItsMessage) {
  TransportSet ts(TransportKind::kShm, 4);  // receives sleep at once
  SmallAllReduces(ts, 300);
}

TEST(ShmTransportTest, AReceiveThatPollsTakesItsMessageWithoutWakingTheDrainThread) {
  TransportSetOptions o;
  o.receive_spin = absl::Seconds(20);  // every receive polls until its message comes
  TransportSet ts(TransportKind::kShm, 3, o);
  SmallAllReduces(ts, 100);
  EXPECT_EQ(DrainWakes(ts), 0);

  TransportSetOptions briefly;
  briefly.receive_spin = absl::Microseconds(20);  // some poll, some sleep
  TransportSet mixed(TransportKind::kShm, 4, briefly);
  SmallAllReduces(mixed, 300);
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
  // The link is set up in an epoch that ends cleanly, so the Reset below keeps its ring. The
  // message is one whole fragment (half the 8 KiB ring, less a 32-byte frame header), as each of
  // the large message's are: the ring then fills up to its last byte.
  ASSERT_TRUE(
      ts.at(0)->Send(1, 1, Pattern(8192 / 2 - 32, 0), absl::Now() + absl::Seconds(20)).ok());
  ts.at(0)->Reset(ts.at(0)->epoch() + 1);
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

  ts.at(0)->Reset(ts.at(0)->epoch() + 1);
  absl::Status late = ts.at(0)->Send(1, 2, "x", absl::Now() + absl::Milliseconds(300));
  EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded)
      << "the ring is still full after Reset: " << late;
  EXPECT_THAT(late.message(), HasSubstr("send to rank 1 timed out"));
}

// Rank 1 has no shared-memory receiver: the announcements of rank 0's rings reach its Mailbox as
// plain messages (the ring names). A link set up in an epoch that was aborted is announced again
// in the next epoch, with a new ring, since the abort may have cut the first announcement off; a
// link set up in an epoch that ended cleanly is kept.
TEST(ShmTransportTest, ALinkSetUpInAnAbortedEpochIsAnnouncedAgain) {
  TransportSet ts(TransportKind::kShm, 2, UndrainedPeer(getpid()));
  Transport* sender = ts.at(0);
  Transport* peer = ts.at(1);
  auto next_epoch = [&] {
    const uint64_t e = sender->epoch() + 1;
    sender->Reset(e);
    peer->Reset(e);
  };
  auto announcement = [&](absl::Duration wait) {
    return peer->Recv(0, ShmTransport::kAnnounceTag, absl::Now() + wait);
  };
  next_epoch();
  ASSERT_TRUE(sender->Send(1, 1, "a", absl::Now() + absl::Seconds(20)).ok());
  absl::StatusOr<std::string> first = announcement(absl::Seconds(20));
  ASSERT_TRUE(first.ok()) << first.status();
  sender->Abort(absl::AbortedError("a rank failed"));
  next_epoch();
  ASSERT_TRUE(sender->Send(1, 1, "b", absl::Now() + absl::Seconds(20)).ok());
  absl::StatusOr<std::string> second = announcement(absl::Seconds(20));
  ASSERT_TRUE(second.ok()) << "no new announcement after the aborted epoch: " << second.status();
  EXPECT_NE(*second, *first);

  next_epoch();  // the last epoch ended cleanly: its link stays
  ASSERT_TRUE(sender->Send(1, 1, "c", absl::Now() + absl::Seconds(20)).ok());
  absl::StatusOr<std::string> third = announcement(absl::Milliseconds(300));
  EXPECT_EQ(third.status().code(), absl::StatusCode::kDeadlineExceeded) << third.status();
}

int ThreadsOfThisProcess() {
  int n = 0;
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return -1;
  while (const dirent* e = readdir(dir)) n += e->d_name[0] != '.';
  closedir(dir);
  return n;
}

// Every aborted epoch in which rank 0 first sends to rank 1 has it set the link up again in the
// next, and rank 1 replace its receiver of the old ring: the replaced receivers' drain threads
// stop at the next Reset instead of piling up, one per aborted epoch.
TEST(ShmTransportTest, RingsReplacedAfterAbortedEpochsDoNotPileUp) {
  TransportSet ts(TransportKind::kShm, 2);
  auto aborted_epoch = [&](int k) {
    const std::string m = Pattern(100, k);
    ASSERT_TRUE(ts.at(0)->Send(1, 1, m, absl::Now() + absl::Seconds(20)).ok());
    absl::StatusOr<std::string> got = ts.at(1)->Recv(0, 1, absl::Now() + absl::Seconds(20));
    ASSERT_TRUE(got.ok()) << "epoch " << k << ": " << got.status();
    ASSERT_EQ(*got, m) << "epoch " << k;
    ASSERT_TRUE(static_cast<ShmTransport*>(ts.at(0))->SendsThroughShm(1));
    for (int r = 0; r < 2; ++r) ts.at(r)->Abort(absl::AbortedError("a rank failed"));
    const uint64_t next = ts.at(0)->epoch() + 1;
    for (int r = 0; r < 2; ++r) ts.at(r)->Reset(next);
  };
  for (int k = 0; k < 3; ++k) aborted_epoch(k);
  const int threads = ThreadsOfThisProcess();
  for (int k = 3; k < 23; ++k) aborted_epoch(k);
  // At most one replaced receiver waits for the next Reset; a few threads of slack for gRPC's
  // pools, which grow on demand (20 piled-up drain threads would be far over).
  EXPECT_LE(ThreadsOfThisProcess(), threads + 5) << "threads after 3 aborted epochs: " << threads;
}

}  // namespace
}  // namespace meshrun
