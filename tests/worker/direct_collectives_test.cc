// Single-copy all-reduce (core/collectives/direct_collectives.h): ranks as threads over the
// in-process transport (handles are addresses) and over ShmTransport, whose handles name memfd
// segments of a ShmArena mapped again through /proc/<pid>/fd, as co-located workers map each
// other's. Odd group sizes and counts that no group size divides; several chunks per segment.
#include "core/collectives/direct_collectives.h"

#include <cmath>
#include <cstring>
#include <random>

#include "core/collectives/communicator.h"
#include "core/collectives/reduce_kernels.h"
#include "gtest/gtest.h"
#include "tests/testutil/transport_set.h"
#include "worker/shm_arena.h"
#include "worker/shm_transport.h"

namespace meshrun {
namespace {

using ::meshrun::testing::KindName;
using ::meshrun::testing::TransportKind;
using ::meshrun::testing::TransportSet;
using ::meshrun::testing::TransportSetOptions;

std::vector<int> Iota(int n) {
  std::vector<int> v(n);
  for (int i = 0; i < n; ++i) v[i] = i;
  return v;
}

CollectiveOptions SmallChunks() {
  CollectiveOptions o;
  o.chunk_bytes = 64;  // many chunks per segment
  o.direct_min_bytes = 1;
  o.timeout = absl::Seconds(20);
  return o;
}

using Param = std::tuple<TransportKind, int, int64_t>;

class DirectCollectivesTest : public ::testing::TestWithParam<Param> {
 protected:
  DirectCollectivesTest() : arena_(ShmArena::Options()) {}
  TransportKind kind() const { return std::get<0>(GetParam()); }
  int world() const { return std::get<1>(GetParam()); }
  int64_t count() const { return std::get<2>(GetParam()); }
  TransportSetOptions SetOptions() {
    TransportSetOptions o;
    o.arena = &arena_;
    return o;
  }
  // `n` floats of shareable memory (an arena segment; any memory in process).
  std::shared_ptr<void> Buffer(int64_t n) { return arena_.Allocate(std::max<int64_t>(n, 1) * 4); }

  ShmArena arena_;
};

TEST_P(DirectCollectivesTest, PsumPmeanPmaxGiveEveryRankTheSameBitsAsAReference) {
  TransportSet ts(kind(), world(), SetOptions());
  const int n = world();
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<std::vector<float>> inputs(n, std::vector<float>(count()));
  for (auto& v : inputs)
    for (float& x : v) x = dist(gen);
  const ReduceOp ops[] = {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMax};
  std::vector<std::vector<std::shared_ptr<void>>> buffers(n);
  for (int r = 0; r < n; ++r) {
    for (int o = 0; o < 3; ++o) {
      buffers[r].push_back(Buffer(count()));
      std::memcpy(buffers[r][o].get(), inputs[r].data(), count() * 4);
    }
  }
  std::vector<absl::Status> status(n);
  std::vector<int> done(n, 0);
  ts.RunRanks([&](int r) {
    Communicator comm(ts.at(r), Iota(n), SmallChunks());
    for (int o = 0; o < 3 && status[r].ok(); ++o) {
      absl::StatusOr<DirectResult> d =
          DirectAllReduce(comm, buffers[r][o].get(), count(), v1::DTYPE_F32, ops[o]);
      status[r] = d.status();
      if (d.ok() && *d == DirectResult::kDone) ++done[r];
    }
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
    EXPECT_EQ(done[r], 3) << "rank " << r << " fell back";
  }
  for (int64_t i = 0; i < count(); ++i) {
    // The owner of element i's segment sums in group order.
    float sum = inputs[0][i], max = inputs[0][i];
    for (int q = 1; q < n; ++q) {
      sum += inputs[q][i];
      max = std::max(max, inputs[q][i]);
    }
    const float mean = sum * (1.0f / n);
    for (int r = 0; r < n; ++r) {
      ASSERT_EQ(static_cast<float*>(buffers[r][0].get())[i], sum)
          << "psum rank " << r << " element " << i;
      ASSERT_EQ(static_cast<float*>(buffers[r][1].get())[i], mean)
          << "pmean rank " << r << " element " << i;
      ASSERT_EQ(static_cast<float*>(buffers[r][2].get())[i], max)
          << "pmax rank " << r << " element " << i;
    }
  }
}

TEST_P(DirectCollectivesTest, PsumScatterAndAllGatherReadPeersBlocksInPlace) {
  TransportSet ts(kind(), world(), SetOptions());
  const int n = world();
  std::vector<std::shared_ptr<void>> inputs(n), blocks(n);
  std::vector<std::vector<float>> scattered(n, std::vector<float>(count())),
      gathered(n, std::vector<float>(n * count()));
  for (int r = 0; r < n; ++r) {
    inputs[r] = Buffer(n * count());  // psum_scatter's input: n blocks
    blocks[r] = Buffer(count());      // all_gather's input: one block
    for (int64_t i = 0; i < n * count(); ++i)
      static_cast<float*>(inputs[r].get())[i] = static_cast<float>(r * 1000 + i);
    for (int64_t i = 0; i < count(); ++i)
      static_cast<float*>(blocks[r].get())[i] = static_cast<float>(r * 100 + i);
  }
  std::vector<absl::Status> status(n);
  std::vector<int> done(n, 0);
  ts.RunRanks([&](int r) {
    Communicator comm(ts.at(r), Iota(n), SmallChunks());
    absl::StatusOr<DirectResult> d = DirectReduceScatter(
        comm, inputs[r].get(), count(), v1::DTYPE_F32, ReduceOp::kSum, scattered[r].data());
    if (d.ok() && *d == DirectResult::kDone) ++done[r];
    if (d.ok())
      d = DirectAllGather(comm, blocks[r].get(), count(), v1::DTYPE_F32, gathered[r].data());
    if (d.ok() && *d == DirectResult::kDone) ++done[r];
    status[r] = d.status();
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
    EXPECT_EQ(done[r], 2) << "rank " << r << " fell back";
    for (int64_t i = 0; i < count(); ++i) {
      float sum = 0;
      for (int q = 0; q < n; ++q) sum += static_cast<float>(q * 1000 + r * count() + i);
      ASSERT_EQ(scattered[r][i], sum) << "psum_scatter rank " << r << " element " << i;
      for (int q = 0; q < n; ++q) {
        ASSERT_EQ(gathered[r][q * count() + i], static_cast<float>(q * 100 + i))
            << "all_gather rank " << r << " block " << q;
      }
    }
  }
}

// An all-reduce fused with a replicated elementwise update (an optimizer step): every rank's
// outputs get every element, each computed once, by the owner of its segment, from the same
// reduced bits DirectAllReduce gives; the partial buffers are only read. The second output has
// 2-byte elements (a master weight's bf16 copy beside the f32 update).
TEST_P(DirectCollectivesTest, AllReduceUpdateStoresEachOwnersSegmentIntoEveryMembersOutputs) {
  TransportSet ts(kind(), world(), SetOptions());
  const int n = world();
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<std::vector<float>> inputs(n, std::vector<float>(count()));
  for (auto& v : inputs)
    for (float& x : v) x = dist(gen);
  std::vector<float> w(count());  // the replicated operand (a parameter)
  for (float& x : w) x = dist(gen);
  const ReduceOp ops[] = {ReduceOp::kSum, ReduceOp::kMean};
  for (ReduceOp op : ops) {
    std::vector<std::shared_ptr<void>> partial(n), out_a(n), out_b(n);
    for (int r = 0; r < n; ++r) {
      partial[r] = Buffer(count());
      std::memcpy(partial[r].get(), inputs[r].data(), count() * 4);
      out_a[r] = Buffer(count());
      out_b[r] = Buffer(count());
      std::fill_n(static_cast<float*>(out_a[r].get()), count(), -1000.0f - r);
      std::fill_n(static_cast<uint16_t*>(out_b[r].get()), count(), static_cast<uint16_t>(r + 1));
    }
    std::vector<absl::Status> status(n);
    std::vector<int> done(n, 0);
    std::vector<int64_t> updated(n, 0);  // elements each rank computed
    ts.RunRanks([&](int r) {
      Communicator comm(ts.at(r), Iota(n), SmallChunks());
      float* a = static_cast<float*>(out_a[r].get());
      uint16_t* b = static_cast<uint16_t*>(out_b[r].get());
      absl::StatusOr<DirectResult> d = DirectAllReduceUpdate(
          comm, partial[r].get(), count(), v1::DTYPE_F32, op, {a, b},
          {sizeof(float), sizeof(uint16_t)}, [&](int64_t begin, int64_t len, const void* reduced) {
            const float* g = static_cast<const float*>(reduced);
            for (int64_t i = 0; i < len; ++i) {
              a[begin + i] = w[begin + i] - 0.5f * g[i];
              b[begin + i] = F32ToBf16(g[i] * g[i]);
            }
            updated[r] += len;
          });
      status[r] = d.status();
      if (d.ok() && *d == DirectResult::kDone) ++done[r];
    });
    int64_t total = 0;
    for (int r = 0; r < n; ++r) {
      ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
      EXPECT_EQ(done[r], 1) << "rank " << r << " fell back";
      EXPECT_LE(updated[r], (count() + n - 1) / n)
          << "rank " << r << " updated more than its segment";
      total += updated[r];
    }
    EXPECT_EQ(total, count()) << "every element is updated exactly once";
    for (int64_t i = 0; i < count(); ++i) {
      float g = inputs[0][i];
      for (int q = 1; q < n; ++q) g += inputs[q][i];
      if (op == ReduceOp::kMean) g *= 1.0f / n;
      for (int r = 0; r < n; ++r) {
        ASSERT_EQ(static_cast<float*>(out_a[r].get())[i], w[i] - 0.5f * g)
            << "rank " << r << " element " << i;
        ASSERT_EQ(static_cast<uint16_t*>(out_b[r].get())[i], F32ToBf16(g * g))
            << "rank " << r << " element " << i;
        ASSERT_EQ(static_cast<float*>(partial[r].get())[i], inputs[r][i])
            << "partial of rank " << r << " changed";
      }
    }
  }
}

// In process every address is shareable: this one runs over ShmTransport only.
using DirectFallbackTest = DirectCollectivesTest;

TEST_P(DirectFallbackTest, OneUnshareableOutputMakesEveryRankFallBackFromTheFusedUpdateUntouched) {
  TransportSet ts(kind(), world(), SetOptions());
  const int n = world();
  std::vector<std::shared_ptr<void>> partial(n), outs(n);
  std::vector<float> heap(count(), 7.0f);  // the last rank's output: plain heap memory
  for (int r = 0; r < n; ++r) {
    partial[r] = Buffer(count());
    std::fill_n(static_cast<float*>(partial[r].get()), count(), 1.0f);
    if (r < n - 1)
      std::fill_n(static_cast<float*>((outs[r] = Buffer(count())).get()), count(), 7.0f);
  }
  auto out = [&](int r) { return r == n - 1 ? heap.data() : static_cast<float*>(outs[r].get()); };
  std::vector<absl::StatusOr<DirectResult>> direct(n, absl::UnknownError("not run"));
  std::vector<int> calls(n, 0);
  ts.RunRanks([&](int r) {
    Communicator comm(ts.at(r), Iota(n), SmallChunks());
    direct[r] = DirectAllReduceUpdate(comm, partial[r].get(), count(), v1::DTYPE_F32,
                                      ReduceOp::kSum, {out(r)}, {sizeof(float)},
                                      [&](int64_t, int64_t, const void*) { ++calls[r]; });
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(direct[r].ok()) << direct[r].status();
    EXPECT_EQ(*direct[r], DirectResult::kFellBack) << "rank " << r;
    EXPECT_EQ(calls[r], 0) << "rank " << r << " updated after falling back";
    for (int64_t i = 0; i < count(); ++i) {
      ASSERT_EQ(out(r)[i], 7.0f) << "rank " << r << " element " << i;
      ASSERT_EQ(static_cast<float*>(partial[r].get())[i], 1.0f) << "rank " << r << " element " << i;
    }
  }
}

TEST_P(DirectFallbackTest, OneUnshareableBufferMakesEveryRankFallBackUntouchedAndTheRingStillSums) {
  TransportSet ts(kind(), world(), SetOptions());
  const int n = world();
  std::vector<std::shared_ptr<void>> buffers(n);
  std::vector<float> heap(count());  // the last rank's buffer: plain heap memory
  for (int r = 0; r < n; ++r) {
    float* b = r == n - 1 ? heap.data() : static_cast<float*>((buffers[r] = Buffer(count())).get());
    for (int64_t i = 0; i < count(); ++i) b[i] = static_cast<float>(r + 1);
  }
  auto data = [&](int r) {
    return r == n - 1 ? heap.data() : static_cast<float*>(buffers[r].get());
  };
  std::vector<absl::StatusOr<DirectResult>> direct(n, absl::UnknownError("not run"));
  std::vector<absl::Status> ring(n);
  ts.RunRanks([&](int r) {
    Communicator comm(ts.at(r), Iota(n), SmallChunks());
    direct[r] = DirectAllReduce(comm, data(r), count(), v1::DTYPE_F32, ReduceOp::kSum);
    for (int64_t i = 0; i < count(); ++i) {
      if (data(r)[i] != static_cast<float>(r + 1)) {
        ring[r] = absl::InternalError("touched by the fallen-back direct all-reduce");
        return;
      }
    }
    ring[r] = comm.AllReduce(data(r), count(), v1::DTYPE_F32, ReduceOp::kSum);
  });
  const float expected = n * (n + 1) / 2.0f;
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(direct[r].ok()) << direct[r].status();
    EXPECT_EQ(*direct[r], DirectResult::kFellBack) << "rank " << r;
    ASSERT_TRUE(ring[r].ok()) << "rank " << r << ": " << ring[r];
    for (int64_t i = 0; i < count(); ++i)
      ASSERT_EQ(data(r)[i], expected) << "rank " << r << " element " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(
    TransportsWorldsCounts, DirectCollectivesTest,
    ::testing::Combine(::testing::Values(TransportKind::kInProcess, TransportKind::kShm),
                       ::testing::Values(2, 3, 4, 5, 8), ::testing::Values<int64_t>(1, 13, 4099)),
    [](const ::testing::TestParamInfo<Param>& info) {
      return KindName(std::get<0>(info.param)) + "_world" +
             std::to_string(std::get<1>(info.param)) + "_count" +
             std::to_string(std::get<2>(info.param));
    });

INSTANTIATE_TEST_SUITE_P(ShmWorldsCounts, DirectFallbackTest,
                         ::testing::Combine(::testing::Values(TransportKind::kShm),
                                            ::testing::Values(2, 3, 8),
                                            ::testing::Values<int64_t>(1, 4099)),
                         [](const ::testing::TestParamInfo<Param>& info) {
                           return "world" + std::to_string(std::get<1>(info.param)) + "_count" +
                                  std::to_string(std::get<2>(info.param));
                         });

// Communicator picks the direct path for large collectives among co-located ranks: over
// ShmTransport only the handle and done messages travel (2 (P - 1) per collective, whatever the
// size), where the ring would send at least 2 (P - 1) messages per 512 KiB chunk.
TEST(DirectChoiceTest, LargeCollectivesAmongCoLocatedRanksSendOnlyHandlesAndDones) {
  ShmArena arena{ShmArena::Options()};
  TransportSetOptions so;
  so.arena = &arena;
  constexpr int kRanks = 4;
  constexpr int64_t kCount = 1 << 18;  // 1 MiB of f32: above direct_min_bytes
  TransportSet ts(TransportKind::kShm, kRanks, so);
  std::vector<std::shared_ptr<void>> buffers, outs;
  for (int r = 0; r < kRanks; ++r) {
    buffers.push_back(arena.Allocate(kCount * 4));
    outs.push_back(arena.Allocate(kCount * 4));
    std::fill_n(static_cast<float*>(buffers[r].get()), kCount, 1.0f);
  }
  std::vector<absl::Status> status(kRanks);
  std::vector<int64_t> sent(kRanks);
  ts.RunRanks([&](int r) {
    auto* shm = dynamic_cast<ShmTransport*>(ts.at(r));
    auto messages = [shm] { return shm->shm_messages_sent() + shm->remote_messages_sent(); };
    Communicator comm(ts.at(r), Iota(kRanks));  // default options
    status[r] = comm.AllReduce(buffers[r].get(), kCount, v1::DTYPE_F32, ReduceOp::kSum);
    if (status[r].ok()) {
      status[r] = comm.ReduceScatter(buffers[r].get(), kCount / kRanks, v1::DTYPE_F32,
                                     ReduceOp::kSum, outs[r].get());
    }
    if (status[r].ok())
      status[r] = comm.AllGather(outs[r].get(), kCount / kRanks, v1::DTYPE_F32, buffers[r].get());
    sent[r] = messages();
  });
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(status[r].ok()) << status[r];
    EXPECT_EQ(sent[r], 3 * 2 * (kRanks - 1)) << "rank " << r;
    // psum: 4 everywhere; psum_scatter of that: 16 in each block; all_gather: 16 everywhere.
    const float* b = static_cast<const float*>(buffers[r].get());
    EXPECT_EQ(b[0], 16.0f);
    EXPECT_EQ(b[kCount - 1], 16.0f);
  }
}

}  // namespace
}  // namespace meshrun
