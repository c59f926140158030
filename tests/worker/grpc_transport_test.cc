// Collectives over the real gRPC ring transport: one gRPC server per rank on loopback, threads
// as ranks (the e2e tests cover separate processes).
#include "worker/grpc_transport.h"

#include <atomic>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/collectives/communicator.h"
#include "core/collectives/mailbox.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "net/credentials.h"
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

TEST(GrpcTransportTest, OneShotAllReduceGivesEveryRankTheSameSum) {
  constexpr int kWorld = 5;
  GrpcRing ring(kWorld);
  CollectiveOptions opts;
  opts.one_shot_max_bytes = opts.chunk_bytes;  // chosen by size, as a worker's flag makes it
  opts.timeout = absl::Seconds(20);
  std::vector<std::vector<float>> data(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    for (int i = 0; i < 333; ++i) data[r].push_back(0.1f * static_cast<float>(r + 1) + 1e-3f * i);
  }
  std::vector<absl::Status> status(kWorld);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      Communicator comm(ring.transport(r), Iota(kWorld), opts);
      status[r] = comm.AllReduce(data[r].data(), 333, v1::DTYPE_F32, ReduceOp::kSum);
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
    EXPECT_EQ(data[r], data[0]) << "rank " << r << " has other bits than rank 0";
  }
  for (int i = 0; i < 333; ++i) {
    EXPECT_NEAR(data[0][i], 1.5 + 5e-3 * i, 1e-4) << "element " << i;
  }
}

// Counts on each side of the algorithm thresholds (one-shot up to 32 bytes, recursive doubling
// up to 64, the ring above): the sum is right and every rank holds the same bits.
TEST(GrpcTransportTest, EachAlgorithmAtItsThresholdEdgesGivesTheSum) {
  for (const int world : {3, 4}) {
    GrpcRing ring(world);
    CollectiveOptions opts;
    opts.one_shot_max_bytes = 32;
    opts.small_message_bytes = 64;
    opts.chunk_bytes = 1024;
    opts.timeout = absl::Seconds(20);
    for (const int count : {8, 9, 16, 17}) {
      std::vector<std::vector<float>> data(world);
      for (int r = 0; r < world; ++r) {
        for (int i = 0; i < count; ++i) data[r].push_back(0.25f * static_cast<float>(r + i));
      }
      std::vector<absl::Status> status(world);
      std::vector<std::thread> threads;
      for (int r = 0; r < world; ++r) {
        threads.emplace_back([&, r] {
          Communicator comm(ring.transport(r), Iota(world), opts);
          status[r] = comm.AllReduce(data[r].data(), count, v1::DTYPE_F32, ReduceOp::kSum);
        });
      }
      for (auto& t : threads) t.join();
      for (int r = 0; r < world; ++r) {
        ASSERT_TRUE(status[r].ok()) << "world " << world << " count " << count << ": " << status[r];
        EXPECT_EQ(data[r], data[0]) << "world " << world << " count " << count << " rank " << r;
      }
      for (int i = 0; i < count; ++i) {
        double want = 0;
        for (int q = 0; q < world; ++q) want += 0.25 * (q + i);
        EXPECT_FLOAT_EQ(data[0][i], static_cast<float>(want)) << "count " << count << " at " << i;
      }
    }
  }
}

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

TEST(GrpcTransportTest, LargeMessagesArriveWholeWhetherTheReceiveIsPostedOrNot) {
  // 3 MiB spans many of gRPC's received slices: a posted RecvInto takes them piece by piece
  // where they lie; a message that comes first is queued as one copy.
  GrpcRing ring(2);
  std::string message((3 << 20) + 5, '\0');
  for (size_t i = 0; i < message.size(); ++i) message[i] = static_cast<char>(i * 131 + i / 4099);
  std::string posted(message.size(), '\0');
  std::atomic<int64_t> pieces{0};
  size_t next = 0;
  absl::Status recv;
  std::thread receiver([&] {
    recv = ring.transport(1)->RecvInto(0, 1, message.size(), absl::Now() + absl::Seconds(20),
                                       [&](size_t offset, const char* data, size_t n) {
                                         // RecvSink's promise: in order, whole 8-byte
                                         // words but for the last piece.
                                         ASSERT_EQ(offset, next);
                                         ASSERT_LE(offset + n, posted.size());
                                         if (offset + n < posted.size()) {
                                           ASSERT_EQ(n % 8, 0u);
                                         }
                                         std::memcpy(&posted[offset], data, n);
                                         next += n;
                                         ++pieces;
                                       });
  });
  absl::SleepFor(absl::Milliseconds(100));  // posted first, usually
  ASSERT_TRUE(ring.transport(0)->Send(1, 1, message, absl::Now() + absl::Seconds(20)).ok());
  receiver.join();
  ASSERT_TRUE(recv.ok()) << recv;
  EXPECT_TRUE(posted == message);
  EXPECT_GE(pieces.load(), 1);

  ASSERT_TRUE(ring.transport(0)->Send(1, 2, message, absl::Now() + absl::Seconds(20)).ok());
  absl::SleepFor(absl::Milliseconds(100));  // queued first
  absl::StatusOr<std::string> queued =
      ring.transport(1)->Recv(0, 2, absl::Now() + absl::Seconds(20));
  ASSERT_TRUE(queued.ok()) << queued.status();
  EXPECT_TRUE(*queued == message);
}

// One rank's RingService on loopback, for streams written by hand.
class RawRing {
 public:
  RawRing() : mailbox_(2) {
    SetProcessCredentials(Credentials::Insecure());
    grpc::ServerBuilder b;
    ConfigureServerBuilder(b);
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(&ring_);
    server_ = b.BuildAndStart();
    address_ = absl::StrCat("127.0.0.1:", port);
    ring_.Attach(&mailbox_, 2, "c");
  }
  ~RawRing() { server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1))); }
  const std::string& address() const { return address_; }
  Mailbox& mailbox() { return mailbox_; }

  // Writes `frames` as Ring.Transfer's raw messages on one stream and returns how it ended.
  grpc::Status WriteFrames(const std::vector<std::string>& frames) {
    auto channel = CreateChannel(address_);
    grpc::internal::RpcMethod method("/meshrun.v1.Ring/Transfer",
                                     grpc::internal::RpcMethod::CLIENT_STREAMING, channel);
    grpc::ClientContext ctx;
    SetTimeout(ctx, absl::Seconds(10));
    grpc::ByteBuffer response;
    std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer(
        grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(channel.get(), method, &ctx,
                                                                      &response));
    for (const std::string& f : frames) {
      grpc::Slice slice(f);
      if (!writer->Write(grpc::ByteBuffer(&slice, 1))) break;
    }
    writer->WritesDone();
    return writer->Finish();
  }

 private:
  Mailbox mailbox_;
  RingService ring_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

// A frame as ring.proto's Chunk comment lays it out.
std::string Frame(uint32_t rank, uint16_t flags, const std::string& cluster, uint64_t epoch,
                  uint64_t tag, const std::string& payload) {
  std::string f;
  auto put = [&f](uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) f.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  };
  put(rank, 4);
  put(flags, 2);
  put(cluster.size(), 2);
  put(epoch, 8);
  put(tag, 8);
  return f + cluster + payload;
}

TEST(GrpcTransportTest, MalformedFramesEndTheirStreamWithAnErrorAndTheServiceGoesOn) {
  RawRing ring;
  grpc::Status s = ring.WriteFrames({"short"});
  EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("shorter than its 24-byte header"));
  s = ring.WriteFrames({Frame(1, 0, "c", 0, 1, "").substr(0, 24)});  // cluster id cut off
  EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("1-byte cluster id"));
  s = ring.WriteFrames({Frame(7, 0, "c", 0, 1, "x")});
  EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("rank 7; world size is 2"));
  s = ring.WriteFrames({Frame(1, 0, "other", 0, 1, "x")});
  EXPECT_EQ(s.error_code(), grpc::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("cluster 'other'"));
  s = ring.WriteFrames({Frame(1, 0, "c", 0, 1, "x"), Frame(0, 0, "", 0, 2, "y")});
  EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("from rank 0 on lane 0 in rank 1's stream"));

  // None of those left a message behind but the first valid frame; a well-formed stream
  // (with its goodbye) is delivered.
  absl::StatusOr<std::string> first = ring.mailbox().Take(1, 1, absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(*first, "x");
  s = ring.WriteFrames(
      {Frame(1, 0, "c", 0, 3, "hello"), Frame(1, 0, "", 0, 4, ""), Frame(1, 1, "", 0, 0, "")});
  EXPECT_TRUE(s.ok()) << s.error_message();
  absl::StatusOr<std::string> m = ring.mailbox().Take(1, 3, absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(*m, "hello");
  m = ring.mailbox().Take(1, 4, absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(*m, "");
}

}  // namespace
}  // namespace meshrun
