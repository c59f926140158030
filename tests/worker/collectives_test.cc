// Every collective against a reference computed on the test thread: every transport, world sizes
// 1..8, element counts 0, 1 and 13 (not divisible by any world size > 1), f32 and bf16; and
// Transport::SendFilled and Transport::Forward, which the ring's steps send through, on each
// transport.
#include <cmath>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/collectives/communicator.h"
#include "core/collectives/permute.h"
#include "core/collectives/reduce_kernels.h"
#include "core/sharding/mesh.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testutil/transport_set.h"

namespace meshrun {
namespace {

using ::meshrun::testing::KindName;
using ::meshrun::testing::TransportKind;
using ::meshrun::testing::TransportSet;
using ::testing::HasSubstr;

// Small integers: exact in bf16 and in every sum a test forms.
float Value(int rank, int64_t i) { return static_cast<float>((rank * 7 + i * 3) % 17 - 8); }

// Rank-major storage of `values` in `dtype`.
std::vector<char> Encode(const std::vector<float>& values, DType dtype) {
  std::vector<char> out(values.size() * DTypeSize(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == v1::DTYPE_F32) {
      std::memcpy(out.data() + 4 * i, &values[i], 4);
    } else {
      uint16_t b = F32ToBf16(values[i]);
      std::memcpy(out.data() + 2 * i, &b, 2);
    }
  }
  return out;
}

std::vector<float> Decode(const std::vector<char>& bytes, DType dtype) {
  std::vector<float> out(bytes.size() / DTypeSize(dtype));
  for (size_t i = 0; i < out.size(); ++i) {
    if (dtype == v1::DTYPE_F32) {
      std::memcpy(&out[i], bytes.data() + 4 * i, 4);
    } else {
      uint16_t b;
      std::memcpy(&b, bytes.data() + 2 * i, 2);
      out[i] = Bf16ToF32(b);
    }
  }
  return out;
}

std::vector<int> Iota(int n) {
  std::vector<int> v(n);
  for (int i = 0; i < n; ++i) v[i] = i;
  return v;
}

// For the suites parameterised by the transport alone.
auto EveryTransport() {
  return ::testing::Values(TransportKind::kInProcess, TransportKind::kGrpc,
                           TransportKind::kGrpcStriped, TransportKind::kShm);
}
std::string TransportName(const ::testing::TestParamInfo<TransportKind>& info) {
  return KindName(info.param);
}

// Message sizes for the point-to-point tests: empty, a few bytes, and sizes that every transport
// cuts into pieces or fragments; and their contents.
const size_t kMessageSizes[] = {0, 5, 4096, (1 << 20) + 3};
std::string Pattern(size_t size, int seed) {
  std::string s(size, '\0');
  for (size_t i = 0; i < size; ++i) s[i] = static_cast<char>(i * 29 + i / 977 + seed);
  return s;
}

using Param = std::tuple<TransportKind, int, int64_t, DType>;

class CollectivesTest : public ::testing::TestWithParam<Param> {
 protected:
  TransportKind kind() const { return std::get<0>(GetParam()); }
  int world() const { return std::get<1>(GetParam()); }
  int64_t count() const { return std::get<2>(GetParam()); }
  DType dtype() const { return std::get<3>(GetParam()); }
  CollectiveOptions Options() const {
    CollectiveOptions o;
    // Several chunks per block, to exercise the pipelines; with striping, chunks of a few words,
    // so that each is cut into pieces over the lanes.
    o.chunk_bytes = kind() == TransportKind::kGrpcStriped ? 40 : 8;
    o.timeout = absl::Seconds(20);
    return o;
  }
  float Tolerance() const { return dtype() == v1::DTYPE_BF16 ? 0.05f : 1e-5f; }
};

TEST_P(CollectivesTest, PsumPmeanPmax) {
  TransportSet ts(kind(), world());
  const int n = world();
  std::vector<std::vector<char>> sum(n), mean(n), max(n);
  std::vector<absl::Status> status(n);
  for (int r = 0; r < n; ++r) {
    std::vector<float> v(count());
    for (int64_t i = 0; i < count(); ++i) v[i] = Value(r, i);
    sum[r] = mean[r] = max[r] = Encode(v, dtype());
  }
  ts.RunRanks([&](int r) {
    Communicator comm(ts.at(r), Iota(n), Options());
    status[r] = comm.AllReduce(sum[r].data(), count(), dtype(), ReduceOp::kSum);
    if (status[r].ok())
      status[r] = comm.AllReduce(mean[r].data(), count(), dtype(), ReduceOp::kMean);
    if (status[r].ok()) status[r] = comm.AllReduce(max[r].data(), count(), dtype(), ReduceOp::kMax);
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
    std::vector<float> s = Decode(sum[r], dtype()), m = Decode(mean[r], dtype()),
                       x = Decode(max[r], dtype());
    for (int64_t i = 0; i < count(); ++i) {
      float ref_sum = 0, ref_max = -1e9f;
      for (int q = 0; q < n; ++q) {
        ref_sum += Value(q, i);
        ref_max = std::max(ref_max, Value(q, i));
      }
      ASSERT_NEAR(s[i], ref_sum, Tolerance()) << "psum rank " << r << " element " << i;
      ASSERT_NEAR(m[i], ref_sum / n, Tolerance() * 4) << "pmean rank " << r << " element " << i;
      ASSERT_EQ(x[i], ref_max) << "pmax rank " << r << " element " << i;
    }
  }
}

TEST_P(CollectivesTest, AllGatherAndPsumScatter) {
  TransportSet ts(kind(), world());
  const int n = world();
  const size_t elem = DTypeSize(dtype());
  std::vector<std::vector<char>> in(n), gathered(n, std::vector<char>(n * count() * elem)),
      scattered(n, std::vector<char>(count() * elem)), scatter_in(n);
  std::vector<absl::Status> status(n);
  for (int r = 0; r < n; ++r) {
    std::vector<float> v(count()), w(n * count());
    for (int64_t i = 0; i < count(); ++i) v[i] = Value(r, i);
    for (int64_t i = 0; i < n * count(); ++i) w[i] = Value(r, i);
    in[r] = Encode(v, dtype());
    scatter_in[r] = Encode(w, dtype());
  }
  ts.RunRanks([&](int r) {
    Communicator comm(ts.at(r), Iota(n), Options());
    status[r] = comm.AllGather(in[r].data(), count(), dtype(), gathered[r].data());
    if (status[r].ok()) {
      status[r] = comm.ReduceScatter(scatter_in[r].data(), count(), dtype(), ReduceOp::kSum,
                                     scattered[r].data());
    }
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
    std::vector<float> g = Decode(gathered[r], dtype()), s = Decode(scattered[r], dtype());
    for (int q = 0; q < n; ++q) {
      for (int64_t i = 0; i < count(); ++i)
        ASSERT_EQ(g[q * count() + i], Value(q, i)) << "all_gather rank " << r;
    }
    for (int64_t i = 0; i < count(); ++i) {
      float ref = 0;
      for (int q = 0; q < n; ++q) ref += Value(q, r * count() + i);
      ASSERT_NEAR(s[i], ref, Tolerance()) << "psum_scatter rank " << r << " element " << i;
    }
  }
}

TEST_P(CollectivesTest, PpermuteAndAllToAll) {
  TransportSet ts(kind(), world());
  const int n = world();
  const size_t elem = DTypeSize(dtype());
  // The seed's cyclic shift, and a partial permutation that leaves position 0 with zeros.
  std::vector<std::pair<int, int>> shift, partial;
  for (int i = 0; i < n; ++i) shift.push_back({i, (i + 1) % n});
  for (int i = 0; i + 1 < n; ++i) partial.push_back({i, i + 1});
  std::vector<std::vector<char>> in(n), shifted(n, std::vector<char>(count() * elem)),
      part(n, std::vector<char>(count() * elem, 1)), a2a_in(n),
      a2a_out(n, std::vector<char>(n * count() * elem));
  std::vector<absl::Status> status(n);
  for (int r = 0; r < n; ++r) {
    std::vector<float> v(count()), w(n * count());
    for (int64_t i = 0; i < count(); ++i) v[i] = Value(r, i);
    for (int64_t i = 0; i < n * count(); ++i) w[i] = Value(r, i);
    in[r] = Encode(v, dtype());
    a2a_in[r] = Encode(w, dtype());
  }
  ts.RunRanks([&](int r) {
    Communicator comm(ts.at(r), Iota(n), Options());
    status[r] = comm.Permute(in[r].data(), count(), dtype(), shift, shifted[r].data());
    if (status[r].ok())
      status[r] = comm.Permute(in[r].data(), count(), dtype(), partial, part[r].data());
    if (status[r].ok())
      status[r] = comm.AllToAll(a2a_in[r].data(), count(), dtype(), a2a_out[r].data());
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
    std::vector<float> s = Decode(shifted[r], dtype()), p = Decode(part[r], dtype()),
                       a = Decode(a2a_out[r], dtype());
    const int from = (r + n - 1) % n;
    for (int64_t i = 0; i < count(); ++i) {
      ASSERT_EQ(s[i], Value(from, i)) << "ppermute rank " << r;
      ASSERT_EQ(p[i], r == 0 ? 0.0f : Value(r - 1, i)) << "partial ppermute rank " << r;
    }
    for (int q = 0; q < n; ++q) {
      for (int64_t i = 0; i < count(); ++i) {
        ASSERT_EQ(a[q * count() + i], Value(q, r * count() + i))
            << "all_to_all rank " << r << " block " << q;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    TransportsWorldsCountsDtypes, CollectivesTest,
    ::testing::Combine(::testing::Values(TransportKind::kInProcess, TransportKind::kGrpc,
                                         TransportKind::kGrpcStriped, TransportKind::kShm),
                       ::testing::Range(1, 9), ::testing::Values<int64_t>(0, 1, 13),
                       ::testing::Values(v1::DTYPE_F32, v1::DTYPE_BF16)),
    [](const ::testing::TestParamInfo<Param>& info) {
      return KindName(std::get<0>(info.param)) + "_world" +
             std::to_string(std::get<1>(info.param)) + "_count" +
             std::to_string(std::get<2>(info.param)) + "_" + DTypeName(std::get<3>(info.param));
    });

// Collectives over one axis, or both, of the 2x4 ('data', 'model') mesh run in their own groups
// at the same time without interfering.
class SubAxisTest : public ::testing::TestWithParam<TransportKind> {};

TEST_P(SubAxisTest, GroupsOfThe2x4Mesh) {
  Mesh mesh = *Mesh::Parse("data=2,model=4");
  TransportSet ts(GetParam(), 8);
  std::vector<float> over_model(8), over_data(8), over_both(8);
  std::vector<std::vector<float>> gathered(8, std::vector<float>(4));
  std::vector<absl::Status> status(8);
  ts.RunRanks([&](int r) {
    Communicator model(ts.at(r), mesh.AxisGroup(r, 1));
    Communicator data(ts.at(r), mesh.AxisGroup(r, 0));
    Communicator both(ts.at(r), mesh.AxesGroup(r, {0, 1}));
    over_model[r] = over_data[r] = over_both[r] = static_cast<float>(r);
    const float mine = static_cast<float>(r);
    status[r] = model.AllReduce(&over_model[r], 1, v1::DTYPE_F32, ReduceOp::kSum);
    if (status[r].ok()) status[r] = data.AllReduce(&over_data[r], 1, v1::DTYPE_F32, ReduceOp::kSum);
    if (status[r].ok()) status[r] = both.AllReduce(&over_both[r], 1, v1::DTYPE_F32, ReduceOp::kSum);
    if (status[r].ok()) status[r] = model.AllGather(&mine, 1, v1::DTYPE_F32, gathered[r].data());
  });
  for (int r = 0; r < 8; ++r) {
    ASSERT_TRUE(status[r].ok()) << status[r];
    const int row = r / 4, col = r % 4;
    EXPECT_EQ(over_model[r], row * 16 + 6) << r;  // sum of the row's ranks
    EXPECT_EQ(over_data[r], 2 * col + 4) << r;    // col + (col + 4)
    EXPECT_EQ(over_both[r], 28) << r;
    EXPECT_EQ(gathered[r],
              (std::vector<float>{row * 4.0f, row * 4.0f + 1, row * 4.0f + 2, row * 4.0f + 3}));
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, SubAxisTest, EveryTransport(), TransportName);

class SendFilledTest : public ::testing::TestWithParam<TransportKind> {};

// SendFilled sends exactly what its fill wrote (empty, a few bytes, and sizes that are cut into
// pieces or fragments on every transport), in order with plain Sends; a fill that fails sends
// nothing and its error comes back as it is; a peer outside the world is refused before the fill
// runs (it may consume a receive).
TEST_P(SendFilledTest, SendsWhatTheFillWroteAndNothingWhenItFails) {
  TransportSet ts(GetParam(), 2);
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  const std::vector<size_t> sizes(std::begin(kMessageSizes), std::end(kMessageSizes));
  absl::Status sent;
  bool filled_for_bad_peer = false;
  absl::Status bad_peer;
  std::vector<absl::StatusOr<std::string>> got(sizes.size()), after(sizes.size());
  // Received while they are sent: a shared-memory ring far smaller than a message is drained
  // only by a receive.
  ts.RunRanks([&](int r) {
    Transport* t = ts.at(r);
    if (r == 1) {
      for (size_t i = 0; i < sizes.size(); ++i) {
        got[i] = t->Recv(0, i, deadline);
        after[i] = t->Recv(0, 1000 + i, deadline);
        if (!got[i].ok() || !after[i].ok()) return;
      }
      return;
    }
    for (size_t i = 0; i < sizes.size() && sent.ok(); ++i) {
      const std::string want = Pattern(sizes[i], static_cast<int>(i));
      absl::Status failed = t->SendFilled(1, 100 + i, sizes[i], deadline, [&](char* dst) {
        std::memset(dst, 0x11, sizes[i]);
        return absl::DataLossError("fill failed");
      });
      if (failed.code() != absl::StatusCode::kDataLoss || failed.message() != "fill failed") {
        sent = absl::InternalError(absl::StrCat("failed fill returned ", failed.ToString()));
        break;
      }
      sent = t->SendFilled(1, i, sizes[i], deadline, [&](char* dst) {
        std::memcpy(dst, want.data(), want.size());
        return absl::OkStatus();
      });
      if (sent.ok()) sent = t->Send(1, 1000 + i, "after", deadline);
    }
    bad_peer = t->SendFilled(2, 7, 8, deadline, [&](char*) {
      filled_for_bad_peer = true;
      return absl::OkStatus();
    });
  });
  ASSERT_TRUE(sent.ok()) << sent;
  EXPECT_EQ(bad_peer.code(), absl::StatusCode::kInvalidArgument) << bad_peer;
  EXPECT_THAT(bad_peer.message(), HasSubstr("rank 2"));
  EXPECT_FALSE(filled_for_bad_peer);
  for (size_t i = 0; i < sizes.size(); ++i) {
    // A message the failed fill had sent would carry another tag, so this receive fails.
    ASSERT_TRUE(got[i].ok()) << "message " << i << ": " << got[i].status();
    EXPECT_TRUE(*got[i] == Pattern(sizes[i], static_cast<int>(i)))
        << "message " << i << " of " << sizes[i] << " bytes differs";
    ASSERT_TRUE(after[i].ok()) << "the Send after message " << i << ": " << after[i].status();
    EXPECT_EQ(*after[i], "after");
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, SendFilledTest, EveryTransport(), TransportName);

class ForwardTest : public ::testing::TestWithParam<TransportKind> {};

// Forward copies each message into dst and sends it on unchanged (empty, a few bytes, and sizes
// cut into pieces or fragments on every transport); a message of the wrong size is reported and
// not sent on; a next peer outside the world is refused before the message is taken.
TEST_P(ForwardTest, CopiesIntoDstAndSendsOnUnchanged) {
  TransportSet ts(GetParam(), 3);
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  const std::vector<size_t> sizes(std::begin(kMessageSizes), std::end(kMessageSizes));
  std::vector<std::string> copied(sizes.size());
  std::vector<absl::StatusOr<std::string>> got(sizes.size());
  absl::Status sent, forwarded, wrong_size, bad_next, after_bad_next;
  absl::StatusOr<std::string> after_wrong_size;
  ts.RunRanks([&](int r) {
    Transport* t = ts.at(r);
    if (r == 0) {
      for (size_t i = 0; i < sizes.size() && sent.ok(); ++i) {
        sent = t->Send(1, i, Pattern(sizes[i], static_cast<int>(i)), deadline);
      }
      if (sent.ok()) sent = t->Send(1, 50, std::string(16, 'w'), deadline);
      if (sent.ok()) sent = t->Send(1, 60, "x", deadline);
      if (sent.ok()) sent = t->Send(1, 70, "kept", deadline);
    } else if (r == 1) {
      for (size_t i = 0; i < sizes.size() && forwarded.ok(); ++i) {
        copied[i].assign(sizes[i], '\0');
        forwarded = t->Forward(0, i, copied[i].data(), sizes[i], 2, 100 + i, deadline);
      }
      wrong_size = t->Forward(0, 50, copied[0].data(), 8, 2, 150, deadline);
      char x = 0;
      if (forwarded.ok()) forwarded = t->Forward(0, 60, &x, 1, 2, 160, deadline);
      char kept[4];
      bad_next = t->Forward(0, 70, kept, 4, 3, 170, deadline);
      absl::StatusOr<std::string> m = t->Recv(0, 70, deadline);
      after_bad_next = m.ok() && *m == "kept" ? absl::OkStatus() : absl::InternalError("lost");
    } else {
      for (size_t i = 0; i < sizes.size(); ++i) {
        got[i] = t->Recv(1, 100 + i, deadline);
        if (!got[i].ok()) return;
      }
      // Tagged 160: had the wrong-sized message been sent on (150), this would fail.
      after_wrong_size = t->Recv(1, 160, deadline);
    }
  });
  ASSERT_TRUE(sent.ok()) << sent;
  ASSERT_TRUE(forwarded.ok()) << forwarded;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const std::string want = Pattern(sizes[i], static_cast<int>(i));
    EXPECT_TRUE(copied[i] == want) << "dst of message " << i << " (" << sizes[i] << " bytes)";
    ASSERT_TRUE(got[i].ok()) << "message " << i << ": " << got[i].status();
    EXPECT_TRUE(*got[i] == want) << "message " << i << " sent on (" << sizes[i] << " bytes)";
  }
  EXPECT_EQ(wrong_size.code(), absl::StatusCode::kInternal) << wrong_size;
  EXPECT_THAT(wrong_size.message(), HasSubstr("expected 8"));
  ASSERT_TRUE(after_wrong_size.ok()) << after_wrong_size.status();
  EXPECT_EQ(*after_wrong_size, "x");
  EXPECT_EQ(bad_next.code(), absl::StatusCode::kInvalidArgument) << bad_next;
  EXPECT_THAT(bad_next.message(), HasSubstr("rank 3"));
  EXPECT_TRUE(after_bad_next.ok()) << "the message a refused Forward was to take";
}

// Ranks on three hosts of their own: ShmTransport's Forward between two remote peers is its
// gRPC transport's (sent on from gRPC's received slices), inside a ring all-reduce and
// all-gather.
TEST(ForwardBetweenHostsTest, RingCollectivesOverShmTransportsOnThreeHosts) {
  testing::TransportSetOptions options;
  options.host_ids = {"host-a", "host-b", "host-c"};
  TransportSet ts(TransportKind::kShm, 3, options);
  const int64_t count = 1000;
  std::vector<std::vector<float>> sum(3, std::vector<float>(count)), gathered(3);
  std::vector<absl::Status> status(3);
  ts.RunRanks([&](int r) {
    for (int64_t i = 0; i < count; ++i) sum[r][i] = Value(r, i);
    CollectiveOptions o;
    o.chunk_bytes = 256;        // 16 chunks per ring step
    o.small_message_bytes = 0;  // the ring, whatever the size
    o.timeout = absl::Seconds(20);
    Communicator comm(ts.at(r), Iota(3), o);
    status[r] = comm.AllReduce(sum[r].data(), count, v1::DTYPE_F32, ReduceOp::kSum);
    gathered[r].resize(3 * count);
    const std::vector<float> mine(sum[r]);
    if (status[r].ok()) {
      status[r] = comm.AllGather(mine.data(), count, v1::DTYPE_F32, gathered[r].data());
    }
  });
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
    for (int64_t i = 0; i < count; ++i) {
      const float want = Value(0, i) + Value(1, i) + Value(2, i);
      ASSERT_EQ(sum[r][i], want) << "rank " << r << " element " << i;
      for (int q = 0; q < 3; ++q) {
        ASSERT_EQ(gathered[r][q * count + i], want) << "rank " << r << " block " << q;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, ForwardTest, EveryTransport(), TransportName);

// The seed's examples at the collective level, on a 4-way axis.
TEST(SeedExamplesTest, PsumScatterGives22_20_12_17AndPpermuteGives3_0_1_2) {
  TransportSet ts(TransportKind::kInProcess, 4);
  // x_exmp sharded P('i', None): device i holds row i; psum_scatter over dim 1 leaves device i
  // with column sum i.
  const float x[4][4] = {{3, 1, 4, 1}, {5, 9, 2, 6}, {5, 3, 5, 8}, {9, 7, 1, 2}};
  std::vector<float> scattered(4), permuted(4);
  ts.RunRanks([&](int r) {
    Communicator comm(ts.at(r), Iota(4));
    ASSERT_TRUE(comm.ReduceScatter(x[r], 1, v1::DTYPE_F32, ReduceOp::kSum, &scattered[r]).ok());
    const float mine = static_cast<float>(r);  // np.arange(4) sharded P('i')
    ASSERT_TRUE(
        comm.Permute(&mine, 1, v1::DTYPE_F32, {{0, 1}, {1, 2}, {2, 3}, {3, 0}}, &permuted[r]).ok());
  });
  EXPECT_EQ(scattered, (std::vector<float>{22, 20, 12, 17}));
  EXPECT_EQ(permuted, (std::vector<float>{3, 0, 1, 2}));
}

TEST(PermutationTest, RejectsNonPermutationsNamingThePair) {
  EXPECT_EQ(ValidatePermutation({{0, 1}, {0, 2}}, 4).message(),
            "perm [(0, 1), (0, 2)] is not a permutation: source 0 appears twice");
  EXPECT_THAT(ValidatePermutation({{0, 1}, {2, 1}}, 4).message(),
              HasSubstr("destination 1 appears twice"));
  EXPECT_THAT(ValidatePermutation({{0, 4}}, 4).message(), HasSubstr("outside the axis of size 4"));
}

}  // namespace
}  // namespace meshrun
