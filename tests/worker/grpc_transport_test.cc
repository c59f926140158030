// Collectives over the real gRPC ring transport: one gRPC server per rank on loopback, threads
// as ranks (the e2e tests cover separate processes).
#include "worker/grpc_transport.h"

#include <thread>

#include "absl/strings/str_cat.h"
#include "core/collectives/communicator.h"
#include "core/collectives/mailbox.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "net/grpc_util.h"
#include "tests/testutil/transport_set.h"

namespace meshrun {
namespace {

using ::testing::HasSubstr;

// `n` ranks over the real gRPC transport (one server per rank on loopback).
class GrpcRing : public testing::TransportSet {
 public:
  explicit GrpcRing(int n, bool tls = false)
      : TransportSet(testing::TransportKind::kGrpc, n, Options(tls)) {}
  Transport* transport(int r) { return at(r); }

 private:
  static testing::TransportSetOptions Options(bool tls) {
    testing::TransportSetOptions o;
    o.tls = tls;
    return o;
  }
};

std::vector<int> Iota(int n) {
  std::vector<int> v(n);
  for (int i = 0; i < n; ++i) v[i] = i;
  return v;
}

// (world size, count, over mutual TLS as workers run by default).
class GrpcAllReduceTest : public ::testing::TestWithParam<std::tuple<int, int64_t, bool>> {};

TEST_P(GrpcAllReduceTest, MatchesPlainSum) {
  const auto [world, count, tls] = GetParam();
  GrpcRing ring(world, tls);
  CollectiveOptions opts;
  opts.chunk_bytes = 1024;
  opts.timeout = absl::Seconds(20);
  std::vector<std::vector<float>> data(world);
  std::vector<absl::Status> status(world);
  for (int r = 0; r < world; ++r) {
    for (int64_t i = 0; i < count; ++i) data[r].push_back(static_cast<float>(r * 3 + i % 11));
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      Communicator comm(ring.transport(r), Iota(world), opts);
      status[r] = comm.AllReduce(data[r].data(), count, v1::DTYPE_F32, ReduceOp::kSum);
      if (status[r].ok())
        status[r] = comm.AllReduce(data[r].data(), count, v1::DTYPE_F32, ReduceOp::kMean);
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
    for (int64_t i = 0; i < count; ++i) {
      double sum = 0;
      for (int q = 0; q < world; ++q) sum += q * 3 + i % 11;
      // psum then pmean of identical values gives the psum back.
      ASSERT_NEAR(data[r][i], sum, 1e-3) << "rank " << r << " element " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizesAndCounts, GrpcAllReduceTest,
                         ::testing::Combine(::testing::Range(1, 9),
                                            ::testing::Values<int64_t>(0, 1, 13, 5000),
                                            ::testing::Values(false)));
INSTANTIATE_TEST_SUITE_P(OverMutualTls, GrpcAllReduceTest,
                         ::testing::Combine(::testing::Values(2, 4),
                                            ::testing::Values<int64_t>(13, 5000),
                                            ::testing::Values(true)));

TEST(GrpcTransportTest, SilentPeerTimesOutNamingIt) {
  GrpcRing ring(2);
  absl::StatusOr<std::string> m =
      ring.transport(0)->Recv(1, 7, absl::Now() + absl::Milliseconds(200));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(m.status().message(), HasSubstr("rank 1"));
}

TEST(GrpcTransportTest, SendToAnUnreachablePeerFailsAtItsDeadline) {
  // Rank 1's address has no server: opening the stream waits for a connection that never comes;
  // the send must fail at its deadline instead of hanging.
  Mailbox mailbox(2);
  GrpcTransport t(0, {"127.0.0.1:0", "127.0.0.1:1"}, "c", &mailbox);
  const absl::Time start = absl::Now();
  absl::Status s = t.Send(1, 1, "hello", absl::Now() + absl::Milliseconds(300));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(), HasSubstr("rank 1"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
}

TEST(GrpcTransportTest, MessagesArriveInOrderWithTags) {
  GrpcRing ring(2);
  for (int i = 0; i < 50; ++i) {
    ASSERT_TRUE(
        ring.transport(0)->Send(1, i, absl::StrCat("m", i), absl::Now() + absl::Seconds(5)).ok());
  }
  for (int i = 0; i < 50; ++i) {
    absl::StatusOr<std::string> m = ring.transport(1)->Recv(0, i, absl::Now() + absl::Seconds(5));
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(*m, absl::StrCat("m", i));
  }
  // A tag mismatch is reported, not silently accepted.
  ASSERT_TRUE(ring.transport(0)->Send(1, 99, "x", absl::Now() + absl::Seconds(5)).ok());
  absl::StatusOr<std::string> m = ring.transport(1)->Recv(0, 98, absl::Now() + absl::Seconds(5));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInternal);
}

TEST(GrpcTransportTest, AbortFailsPendingRecv) {
  GrpcRing ring(2);
  std::thread t([&] {
    absl::SleepFor(absl::Milliseconds(100));
    ring.transport(1)->Abort(absl::AbortedError("job aborted: worker rank 0 died"));
  });
  absl::StatusOr<std::string> m = ring.transport(1)->Recv(0, 1, absl::Now() + absl::Seconds(10));
  t.join();
  EXPECT_EQ(m.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(m.status().message(), HasSubstr("rank 0"));
}

}  // namespace
}  // namespace meshrun
