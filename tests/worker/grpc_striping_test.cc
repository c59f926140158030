// The gRPC transport with messages striped over several streams per peer (GrpcStripeOptions):
// messages arrive whole and in send order, and every collective gives the reference result, with
// pieces small enough that every message of a few words is striped.
#include <cstring>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "core/collectives/communicator.h"
#include "gtest/gtest.h"
#include "tests/testutil/transport_set.h"
#include "worker/grpc_transport.h"

namespace meshrun {
namespace {

testing::TransportSetOptions Striped(int max_stripes, size_t stripe_bytes) {
  testing::TransportSetOptions o;
  o.grpc_stripes.max_stripes = max_stripes;
  o.grpc_stripes.stripe_bytes = stripe_bytes;
  return o;
}

std::string Pattern(size_t size, int seed) {
  std::string s(size, '\0');
  for (size_t i = 0; i < size; ++i) s[i] = static_cast<char>(i * 131 + i / 1021 + seed * 7);
  return s;
}

// Sizes on both sides of each stripe count's edge (stripe_bytes 1024, up to 4 lanes), a few
// MiB, and empty: sent back to back, taken alternately as posted receives (in place or queued)
// and as copies.
TEST(GrpcStripingTest, StripedMessagesArriveWholeAndInSendOrder) {
  testing::TransportSet ring(testing::TransportKind::kGrpc, 2, Striped(4, 1024));
  const std::vector<size_t> sizes = {0,    7,    1023, 1024, 2047,  2048,          3072, 4095,
                                     4096, 4103, 5000, 1,    65536, (3 << 20) + 5, 12};
  std::vector<absl::Status> sent(2);
  std::thread sender([&] {
    for (int round = 0; round < 2; ++round) {
      for (size_t i = 0; i < sizes.size(); ++i) {
        absl::Status s = ring.at(0)->Send(1, round * 100 + i, Pattern(sizes[i], i),
                                          absl::Now() + absl::Seconds(20));
        if (!s.ok()) sent[round] = s;
      }
    }
  });
  absl::Cleanup join = [&sender] { sender.join(); };  // also when an assertion returns early
  for (int round = 0; round < 2; ++round) {
    for (size_t i = 0; i < sizes.size(); ++i) {
      const uint64_t tag = round * 100 + i;
      const std::string want = Pattern(sizes[i], i);
      if ((i + round) % 2 == 0) {
        absl::StatusOr<std::string> m = ring.at(1)->Recv(0, tag, absl::Now() + absl::Seconds(20));
        ASSERT_TRUE(m.ok()) << "message " << tag << ": " << m.status();
        EXPECT_TRUE(*m == want) << "message " << tag << " of " << sizes[i] << " bytes differs";
        continue;
      }
      std::string got(sizes[i], '\0');
      size_t next = 0;
      absl::Status s = ring.at(1)->RecvInto(
          0, tag, sizes[i], absl::Now() + absl::Seconds(20),
          [&](size_t offset, const char* data, size_t n) {
            ASSERT_EQ(offset, next);  // RecvSink's promise: in order, whole words but the last
            ASSERT_LE(offset + n, got.size());
            if (offset + n < got.size()) {
              ASSERT_EQ(n % 8, 0u);
            }
            std::memcpy(&got[offset], data, n);
            next += n;
          });
      ASSERT_TRUE(s.ok()) << "message " << tag << ": " << s;
      EXPECT_EQ(next, sizes[i]);
      EXPECT_TRUE(got == want) << "message " << tag << " of " << sizes[i] << " bytes differs";
    }
  }
  std::move(join).Invoke();
  EXPECT_TRUE(sent[0].ok()) << sent[0];
  EXPECT_TRUE(sent[1].ok()) << sent[1];
}

std::vector<int> Iota(int n) {
  std::vector<int> v(n);
  for (int i = 0; i < n; ++i) v[i] = i;
  return v;
}

// psum, all_gather and psum_scatter (f32) for world sizes 2, 3 and 5 and counts that do not
// divide evenly, with 1 KiB ring chunks striped over up to 3 lanes of 64 bytes and more.
TEST(GrpcStripingTest, CollectivesOverStripedLinksMatchTheReference) {
  for (const int world : {2, 3, 5}) {
    testing::TransportSet ring(testing::TransportKind::kGrpc, world, Striped(3, 64));
    CollectiveOptions opts;
    opts.chunk_bytes = 1024;
    opts.timeout = absl::Seconds(20);
    for (const int64_t count : {int64_t{0}, int64_t{1}, int64_t{13}, int64_t{5001}}) {
      auto value = [](int r, int64_t i) { return static_cast<float>(r * 3 + i % 11); };
      std::vector<std::vector<float>> sum(world), gathered(world), scattered(world);
      std::vector<absl::Status> status(world);
      ring.RunRanks([&](int r) {
        Communicator comm(ring.at(r), Iota(world), opts);
        std::vector<float> mine(count), blocks(world * count);
        for (int64_t i = 0; i < count; ++i) mine[i] = value(r, i);
        for (int64_t i = 0; i < world * count; ++i) blocks[i] = value(r, i);
        sum[r] = mine;
        gathered[r].resize(world * count);
        scattered[r].resize(count);
        status[r] = comm.AllReduce(sum[r].data(), count, v1::DTYPE_F32, ReduceOp::kSum);
        if (status[r].ok()) {
          status[r] = comm.AllGather(mine.data(), count, v1::DTYPE_F32, gathered[r].data());
        }
        if (status[r].ok()) {
          status[r] = comm.ReduceScatter(blocks.data(), count, v1::DTYPE_F32, ReduceOp::kSum,
                                         scattered[r].data());
        }
      });
      for (int r = 0; r < world; ++r) {
        const std::string at = absl::StrCat("world ", world, ", count ", count, ", rank ", r);
        ASSERT_TRUE(status[r].ok()) << at << ": " << status[r];
        for (int64_t i = 0; i < count; ++i) {
          float want_sum = 0, want_scattered = 0;
          for (int q = 0; q < world; ++q) {
            want_sum += value(q, i);
            want_scattered += value(q, r * count + i);
          }
          ASSERT_EQ(sum[r][i], want_sum) << at << ", psum element " << i;
          ASSERT_EQ(scattered[r][i], want_scattered) << at << ", psum_scatter element " << i;
          for (int q = 0; q < world; ++q) {
            ASSERT_EQ(gathered[r][q * count + i], value(q, i))
                << at << ", all_gather block " << q << " element " << i;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace meshrun
