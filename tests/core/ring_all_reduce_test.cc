#include "core/collectives/ring_all_reduce.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/collectives/in_process_transport.h"
#include "core/collectives/reduce_kernels.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace meshrun {
namespace {

using ::testing::HasSubstr;

// Runs fn(rank) on one thread per rank.
void RunRanks(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

std::vector<int> Iota(int n) {
  std::vector<int> v(n);
  for (int i = 0; i < n; ++i) v[i] = i;
  return v;
}

class RingAllReduceTest : public ::testing::TestWithParam<std::tuple<int, int64_t>> {};

TEST_P(RingAllReduceTest, MatchesPlainSumAndMean) {
  const auto [world, count] = GetParam();
  auto transports = CreateInProcessTransports(world);
  CollectiveOptions opts;
  opts.chunk_bytes = 64;  // many chunks per segment, to exercise the pipeline
  opts.timeout = absl::Seconds(10);
  std::vector<std::vector<float>> sum_data(world), mean_data(world);
  std::vector<std::vector<int32_t>> int_data(world);
  std::vector<absl::Status> status(world);
  for (int r = 0; r < world; ++r) {
    for (int64_t i = 0; i < count; ++i) {
      sum_data[r].push_back(static_cast<float>((r + 1) * 0.5 + i % 7));
      int_data[r].push_back(static_cast<int32_t>(r * 1000 + i));
    }
    mean_data[r] = sum_data[r];
  }
  RunRanks(world, [&](int r) {
    Communicator comm(transports[r].get(), Iota(world), opts);
    absl::Status s = comm.AllReduce(sum_data[r].data(), count, v1::DTYPE_F32, ReduceOp::kSum);
    if (s.ok()) s = comm.AllReduce(mean_data[r].data(), count, v1::DTYPE_F32, ReduceOp::kMean);
    if (s.ok()) s = comm.AllReduce(int_data[r].data(), count, v1::DTYPE_I32, ReduceOp::kSum);
    status[r] = s;
  });
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
    for (int64_t i = 0; i < count; ++i) {
      double expected = 0;
      int64_t expected_int = 0;
      for (int q = 0; q < world; ++q) {
        expected += (q + 1) * 0.5 + i % 7;
        expected_int += q * 1000 + i;
      }
      ASSERT_NEAR(sum_data[r][i], expected, 1e-4) << "rank " << r << " element " << i;
      ASSERT_NEAR(mean_data[r][i], expected / world, 1e-5) << "rank " << r << " element " << i;
      ASSERT_EQ(int_data[r][i], expected_int);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizesAndCounts, RingAllReduceTest,
                         ::testing::Combine(::testing::Range(1, 9),
                                            ::testing::Values<int64_t>(0, 1, 13, 1001)));

TEST(RingAllReduceBf16Test, SumsInBf16) {
  const int world = 4;
  auto transports = CreateInProcessTransports(world);
  std::vector<std::vector<uint16_t>> data(world, std::vector<uint16_t>(10));
  for (int r = 0; r < world; ++r) {
    for (int i = 0; i < 10; ++i) data[r][i] = F32ToBf16(0.25f * (r + i));
  }
  RunRanks(world, [&](int r) {
    Communicator comm(transports[r].get(), Iota(world));
    ASSERT_TRUE(comm.AllReduce(data[r].data(), 10, v1::DTYPE_BF16, ReduceOp::kSum).ok());
  });
  for (int i = 0; i < 10; ++i) EXPECT_FLOAT_EQ(Bf16ToF32(data[2][i]), 0.25f * (6 + 4 * i));
}

TEST(RingAllReduceTest, SubgroupOfTheMesh) {
  // Ranks {1, 3} reduce among themselves while {0, 2} do the same: groups do not interfere.
  auto transports = CreateInProcessTransports(4);
  std::vector<std::vector<float>> data = {{1}, {10}, {100}, {1000}};
  RunRanks(4, [&](int r) {
    Communicator comm(transports[r].get(), r % 2 ? std::vector<int>{1, 3} : std::vector<int>{0, 2});
    ASSERT_TRUE(comm.AllReduce(data[r].data(), 1, v1::DTYPE_F32, ReduceOp::kSum).ok());
  });
  EXPECT_EQ(data[0][0], 101);
  EXPECT_EQ(data[1][0], 1010);
  EXPECT_EQ(data[2][0], 101);
  EXPECT_EQ(data[3][0], 1010);
}

TEST(RingAllReduceTest, MissingPeerTimesOutNamingTheRank) {
  auto transports = CreateInProcessTransports(3);
  CollectiveOptions opts;
  opts.timeout = absl::Milliseconds(200);
  opts.small_message_bytes = 0;  // the ring, not the butterfly
  // Rank 2 never joins: ranks 0 and 1 must fail with a deadline naming the rank they waited on.
  std::vector<absl::Status> status(2);
  RunRanks(2, [&](int r) {
    Communicator comm(transports[r].get(), {0, 1, 2}, opts);
    std::vector<float> v(30, 1.0f);
    status[r] = comm.AllReduce(v.data(), v.size(), v1::DTYPE_F32, ReduceOp::kSum);
  });
  EXPECT_EQ(status[0].code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(status[0].message(), HasSubstr("rank 2"));
  EXPECT_EQ(status[1].code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(RingAllReduceTest, AbortUnblocksWithTheReason) {
  auto transports = CreateInProcessTransports(2);
  std::thread aborter([&] {
    absl::SleepFor(absl::Milliseconds(50));
    transports[0]->Abort(absl::AbortedError("job aborted: worker rank 1 died"));
  });
  Communicator comm(transports[0].get(), {0, 1});
  std::vector<float> v(8, 1.0f);
  absl::Status s = comm.AllReduce(v.data(), v.size(), v1::DTYPE_F32, ReduceOp::kSum);
  aborter.join();
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(s.message(), HasSubstr("worker rank 1 died"));
}

TEST(RingAllReduceTest, PmeanOfIntegersIsRejected) {
  auto transports = CreateInProcessTransports(1);
  Communicator comm(transports[0].get(), {0});
  int32_t x = 1;
  EXPECT_EQ(comm.AllReduce(&x, 1, v1::DTYPE_I32, ReduceOp::kMean).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace meshrun

namespace meshrun {
namespace {

// The small-message algorithms: the butterfly and one-shot.
using AllReduceFn = absl::Status (*)(Communicator&, void*, int64_t, DType, ReduceOp);
class SmallMessageAllReduceTest : public ::testing::TestWithParam<AllReduceFn> {};

// Every rank ends with the same bits (f32 sums in another order than the ring's), equal to the
// plain sum, on 2 to 8 ranks (for the butterfly, 3, 5, 6 and 7 fold pairs first); max, mean and
// integer sums exactly; one element as well as many.
TEST_P(SmallMessageAllReduceTest, EveryRankGetsTheSameSum) {
  const AllReduceFn all_reduce = GetParam();
  for (int world = 2; world <= 8; ++world) {
    for (const int64_t count : {int64_t{1}, int64_t{1000}}) {
      auto transports = CreateInProcessTransports(world);
      CollectiveOptions opts;
      opts.timeout = absl::Seconds(10);
      std::vector<std::vector<float>> f(world), m(world);
      std::vector<std::vector<float>> mean(world);
      std::vector<std::vector<int32_t>> ints(world);
      for (int r = 0; r < world; ++r) {
        for (int64_t i = 0; i < count; ++i) {
          f[r].push_back(0.1f * static_cast<float>(r + 1) + 1e-3f * static_cast<float>(i));
          ints[r].push_back(static_cast<int32_t>(r * 7 + i));
          mean[r].push_back(static_cast<float>(world * (r + 1)));  // mean (world + 1) * world / 2
        }
        m[r] = f[r];
      }
      std::vector<absl::Status> status(world);
      RunRanks(world, [&](int r) {
        Communicator comm(transports[r].get(), Iota(world), opts);
        absl::Status s = all_reduce(comm, f[r].data(), count, v1::DTYPE_F32, ReduceOp::kSum);
        if (s.ok()) s = all_reduce(comm, m[r].data(), count, v1::DTYPE_F32, ReduceOp::kMax);
        if (s.ok()) s = all_reduce(comm, ints[r].data(), count, v1::DTYPE_I32, ReduceOp::kSum);
        if (s.ok()) s = all_reduce(comm, mean[r].data(), count, v1::DTYPE_F32, ReduceOp::kMean);
        status[r] = s;
      });
      for (int r = 0; r < world; ++r) {
        ASSERT_TRUE(status[r].ok()) << "world " << world << " rank " << r << ": " << status[r];
        EXPECT_EQ(f[r], f[0]) << "world " << world << " rank " << r << " differs from rank 0";
        for (int64_t i = 0; i < count; ++i) {
          double want = 0;
          int64_t want_int = 0;
          for (int q = 0; q < world; ++q) {
            want += 0.1 * (q + 1) + 1e-3 * static_cast<double>(i);
            want_int += q * 7 + i;
          }
          ASSERT_NEAR(f[r][i], want, 1e-4 * want) << "world " << world << " element " << i;
          ASSERT_EQ(m[r][i], 0.1f * static_cast<float>(world) + 1e-3f * static_cast<float>(i));
          ASSERT_EQ(ints[r][i], want_int);
          ASSERT_FLOAT_EQ(mean[r][i], static_cast<float>((world + 1) * world / 2));
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(RecursiveDoubling, SmallMessageAllReduceTest,
                         ::testing::Values(&RecursiveDoublingAllReduce));
INSTANTIATE_TEST_SUITE_P(OneShot, SmallMessageAllReduceTest, ::testing::Values(&OneShotAllReduce));

// StreamCopy copies exactly the bytes asked, whatever the alignment of either end (a head up to
// the first 16-byte aligned destination, non-temporal stores, a tail), and nothing past them.
TEST(StreamCopyTest, CopiesEveryByteAtAnyAlignmentAndNoMore) {
  std::vector<unsigned char> src(300), dst(320);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 7 + 1);
  for (size_t dst_off : {0, 1, 3, 8, 15, 16, 17}) {
    for (size_t src_off : {0, 5}) {
      for (size_t bytes : {0, 1, 15, 16, 17, 33, 64, 255}) {
        std::fill(dst.begin(), dst.end(), 0xEE);
        StreamCopy(dst.data() + dst_off, src.data() + src_off, bytes);
        for (size_t i = 0; i < dst.size(); ++i) {
          const bool inside = i >= dst_off && i < dst_off + bytes;
          ASSERT_EQ(dst[i], inside ? src[src_off + i - dst_off] : 0xEE)
              << "byte " << i << " (dst +" << dst_off << ", src +" << src_off << ", " << bytes
              << " bytes)";
        }
      }
    }
  }
}

// Add(dst, a, b) gives the bits of a[i] + b[i] in f32 (its vector loop: counts on and off the
// vector widths, signed zeros, infinities, NaN, subnormals) and of a copy of a with b added in
// (AddInto) in bf16, into another buffer and in place (dst == a), touching nothing past `count`.
TEST(AddTest, GivesTheBitsOfCopyThenAddIntoAndNothingPast) {
  const float specials[] = {0.0f, -0.0f, 1e-40f, -3.5f, 1e30f, INFINITY, -INFINITY, NAN, 0.1f};
  for (const DType dtype : {v1::DTYPE_F32, v1::DTYPE_BF16}) {
    const size_t elem = DTypeSize(dtype);
    for (int64_t count : {0, 1, 7, 15, 16, 17, 33, 100}) {
      std::vector<float> fa(count + 4), fb(count + 4);
      for (int64_t i = 0; i < count + 4; ++i) {
        fa[i] = i % 3 == 0 ? specials[i % 9] : 0.37f * static_cast<float>(i) - 11.0f;
        fb[i] = i % 4 == 1 ? specials[(i * 5) % 9] : -0.61f * static_cast<float>(i) + 2.5f;
      }
      std::vector<char> a(fa.size() * elem), b(fb.size() * elem);
      if (dtype == v1::DTYPE_F32) {
        std::memcpy(a.data(), fa.data(), a.size());
        std::memcpy(b.data(), fb.data(), b.size());
      } else {
        F32ToBf16(fa.data(), reinterpret_cast<uint16_t*>(a.data()), fa.size());
        F32ToBf16(fb.data(), reinterpret_cast<uint16_t*>(b.data()), fb.size());
      }
      std::vector<char> want(a.size(), 0x5A), got(a.size(), 0x5A);
      if (dtype == v1::DTYPE_F32) {
        for (int64_t i = 0; i < count; ++i) {
          const float sum = fa[i] + fb[i];
          std::memcpy(want.data() + i * elem, &sum, elem);
        }
      } else {
        std::memcpy(want.data(), a.data(), count * elem);
        AddInto(dtype, want.data(), b.data(), count);
      }
      Add(dtype, got.data(), a.data(), b.data(), count);
      EXPECT_EQ(got, want) << DTypeName(dtype) << ", " << count << " elements";
      std::vector<char> in_place = a;
      Add(dtype, in_place.data(), in_place.data(), b.data(), count);
      std::memcpy(want.data() + count * elem, a.data() + count * elem, (a.size() - count * elem));
      EXPECT_EQ(in_place, want) << DTypeName(dtype) << ", " << count << " elements in place";
    }
  }
}

// ReduceTo(dst, a, b) gives the bits of copying a into dst and then Reduce(dst, b), for sums
// and max in every reducible dtype (NaN and signed zeros among the values), into another buffer
// and in place, touching nothing past `count`.
TEST(ReduceToTest, GivesTheBitsOfCopyThenReduce) {
  const float specials[] = {0.0f, -0.0f, NAN, -3.5f, 1e30f, INFINITY, 7.0f};
  for (const DType dtype : {v1::DTYPE_F32, v1::DTYPE_BF16, v1::DTYPE_I32, v1::DTYPE_U32}) {
    const size_t elem = DTypeSize(dtype);
    for (const ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
      for (int64_t count : {0, 1, 17, 100}) {
        std::vector<char> a((count + 3) * elem), b(a.size());
        for (int64_t i = 0; i < count + 3; ++i) {
          const float fa = i % 3 == 0 ? specials[i % 7] : 0.5f * static_cast<float>(i) - 9.0f;
          const float fb = i % 4 == 1 ? specials[(i * 3) % 7] : 20.0f - static_cast<float>(i);
          if (dtype == v1::DTYPE_F32) {
            std::memcpy(&a[i * elem], &fa, elem);
            std::memcpy(&b[i * elem], &fb, elem);
          } else if (dtype == v1::DTYPE_BF16) {
            const uint16_t ba = F32ToBf16(fa), bb = F32ToBf16(fb);
            std::memcpy(&a[i * elem], &ba, elem);
            std::memcpy(&b[i * elem], &bb, elem);
          } else {
            const int32_t ia = static_cast<int32_t>(i * 37 - 400),
                          ib = static_cast<int32_t>(i * -53 + 9);
            std::memcpy(&a[i * elem], &ia, elem);
            std::memcpy(&b[i * elem], &ib, elem);
          }
        }
        std::vector<char> want(a.size(), 0x5A), got(a.size(), 0x5A);
        std::memcpy(want.data(), a.data(), count * elem);
        Reduce(dtype, op, want.data(), b.data(), count);
        ReduceTo(dtype, op, got.data(), a.data(), b.data(), count);
        const std::string what = absl::StrCat(
            DTypeName(dtype), op == ReduceOp::kMax ? " max" : " sum", ", ", count, " elements");
        EXPECT_EQ(got, want) << what;
        std::vector<char> in_place = a;
        ReduceTo(dtype, op, in_place.data(), in_place.data(), b.data(), count);
        std::memcpy(want.data() + count * elem, a.data() + count * elem, a.size() - count * elem);
        EXPECT_EQ(in_place, want) << what << " in place";
      }
    }
  }
}

}  // namespace
}  // namespace meshrun
