// Sharded arrays through the real cluster: 8 worker processes on the seed's 4x2 ('i', 'j') mesh.
#include <fstream>
#include <random>

#include "absl/strings/str_cat.h"
#include "core/collectives/reduce_kernels.h"
#include "core/port/process.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "meshrun/client.h"
#include "meshrun/local_cluster.h"
#include "tests/testutil/cluster.h"
#include "tests/testutil/process_util.h"

namespace meshrun {
namespace {

using ::meshrun::testing::RunCommand;
using ::testing::HasSubstr;

class ArraysE2ETest : public testing::ClusterSuite<ArraysE2ETest> {
 public:
  static constexpr const char* kMesh = "i=4,j=2";
  static constexpr const char* kTag = "arrays";

 protected:
  static Tensor Normal(Dims dims, uint32_t seed) {
    return testing::NormalTensor(std::move(dims), seed);
  }
  static void ExpectEqual(const Tensor& a, const Tensor& b) {
    ASSERT_EQ(a.dims(), b.dims());
    ASSERT_EQ(a.dtype(), b.dtype());
    ASSERT_EQ(std::memcmp(a.raw(), b.raw(), a.size_bytes()), 0);
  }
};

TEST_F(ArraysE2ETest, PutAndGetRoundTripTheSeedsArrays) {
  // The seed's x (192x64) P('i', None), w (64x128) P(None, 'j'), b (128) P('j').
  const Tensor x = Normal({192, 64}, 0), w = Normal({64, 128}, 1), b = Normal({128}, 2);
  auto xi = client_->Put(x, PartitionSpec::Of({"i", ""}), "x");
  auto wi = client_->Put(w, PartitionSpec::Of({"", "j"}), "w");
  auto bi = client_->Put(b, PartitionSpec::Of({"j"}), "b");
  ASSERT_TRUE(xi.ok() && wi.ok() && bi.ok()) << xi.status() << wi.status() << bi.status();
  EXPECT_EQ(xi->bytes_per_worker(), 48 * 64 * 4);  // each worker holds only its block
  EXPECT_EQ(wi->bytes_per_worker(), 64 * 64 * 4);
  for (const auto& [id, ref] :
       {std::pair<std::string, const Tensor*>{"x", &x}, {"w", &w}, {"b", &b}}) {
    auto got = client_->Get(id);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectEqual(*got, *ref);
  }
  auto grid = client_->VisualizeSharding("b");
  ASSERT_TRUE(grid.ok());
  EXPECT_THAT(*grid, HasSubstr("| CPU 0,2,4,6 | CPU 1,3,5,7 |"));
  grid = client_->VisualizeSharding("x");
  ASSERT_TRUE(grid.ok());
  EXPECT_THAT(*grid, HasSubstr("| CPU 6,7 |"));

  // The CLI shows the same.
  const std::string cli = ExecutableDir() + "/meshrun";
  auto r = RunCommand({cli, "show", "w", "--coordinator", cluster_->coordinator_address()}, 30);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("| CPU 0,2,4,6 | CPU 1,3,5,7 |"));
  r = RunCommand({cli, "arrays", "--coordinator", cluster_->coordinator_address()}, 30);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("PartitionSpec('i', None)"));
  EXPECT_THAT(r.output, HasSubstr("12288"));
  for (const char* id : {"x", "w", "b"}) EXPECT_TRUE(client_->Delete(id).ok());
}

TEST_F(ArraysE2ETest, EveryDtypeAndMultiAxisSpecsRoundTrip) {
  for (DType dtype : {v1::DTYPE_F32, v1::DTYPE_BF16, v1::DTYPE_I32, v1::DTYPE_U32}) {
    Tensor t(dtype, {16, 6});
    for (size_t i = 0; i < t.size_bytes(); ++i)
      static_cast<uint8_t*>(t.raw())[i] = static_cast<uint8_t>(i * 7 + 1);
    auto info = client_->Put(t, PartitionSpec(std::vector<PartitionSpec::Entry>{{"i", "j"}}));
    ASSERT_TRUE(info.ok()) << info.status();
    auto got = client_->Get(info->id());
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectEqual(*got, t);
    EXPECT_TRUE(client_->Delete(info->id()).ok());
  }
  // Arrays without data: zero-size (its Tensor has no data field on the wire) and 0-d.
  for (const auto& [dims, spec] :
       std::vector<std::pair<Dims, PartitionSpec>>{{{0, 6}, PartitionSpec::Of({"i", ""})},
                                                   {{}, PartitionSpec()},
                                                   {{4, 0}, PartitionSpec()}}) {
    Tensor t(v1::DTYPE_F32, dims);
    if (t.num_elements() == 1) t.data<float>()[0] = 2.5f;
    auto info = client_->Put(t, spec);
    ASSERT_TRUE(info.ok()) << DimsToString(dims) << ": " << info.status();
    auto got = client_->Get(info->id());
    ASSERT_TRUE(got.ok()) << DimsToString(dims) << ": " << got.status();
    ExpectEqual(*got, t);
  }
}

TEST_F(ArraysE2ETest, BadInputGetsAClearErrorAndTheClusterKeepsServing) {
  Tensor t(v1::DTYPE_F32, {6, 4});
  auto r = client_->Put(t, PartitionSpec::Of({"i", ""}));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(),
            "PartitionSpec('i', None) does not fit shape [6, 4]: dim 0 (6) is not divisible by 4 "
            "(the product of its mesh axes)");
  r = client_->Put(Tensor(v1::DTYPE_F32, {8}), PartitionSpec::Of({"model"}));
  EXPECT_THAT(r.status().message(),
              HasSubstr("names axis 'model' which is not in Mesh('i': 4, 'j': 2)"));
  r = client_->Put(Tensor(v1::DTYPE_F32, {8, 8}), PartitionSpec::Of({"i", "i"}));
  EXPECT_THAT(r.status().message(), HasSubstr("uses mesh axis 'i' more than once"));
  auto g = client_->Get("no-such-array");
  EXPECT_EQ(g.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(g.status().message(), HasSubstr("no array 'no-such-array'"));
  ASSERT_TRUE(client_->Put(Tensor(v1::DTYPE_F32, {8}), PartitionSpec::Of({"i"}), "dup").ok());
  EXPECT_THAT(client_->Put(Tensor(v1::DTYPE_F32, {8}), PartitionSpec(), "dup").status().message(),
              HasSubstr("array id 'dup' is in use"));
  EXPECT_TRUE(client_->Delete("dup").ok());
  auto ok = client_->Put(Normal({8, 8}, 3), PartitionSpec::Of({"i", "j"}));
  EXPECT_TRUE(ok.ok()) << ok.status();
}

// DeleteArray with several ids (the Python SDK frees garbage-collected arrays in batches): the
// known ones are freed on every worker even when one is unknown, and the error names it.
TEST_F(ArraysE2ETest, ADeleteOfSeveralIdsFreesEveryKnownOneAndNamesTheUnknown) {
  for (const char* id : {"d0", "d1", "keep"}) {
    ASSERT_TRUE(client_->Put(Normal({8, 4}, 4), PartitionSpec::Of({"i", ""}), id).ok()) << id;
  }
  const std::vector<std::string> ids = {"d0", "nope", "d1", "d0"};
  absl::Status s = client_->Delete(ids);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(s.message(), HasSubstr("no array 'nope'"));
  auto listed = client_->ListArrays();
  ASSERT_TRUE(listed.ok()) << listed.status();
  std::vector<std::string> left;
  for (const v1::ArrayInfo& a : *listed) left.push_back(a.id());
  EXPECT_THAT(left, ::testing::Contains("keep"));
  EXPECT_THAT(left, ::testing::Not(::testing::Contains("d0")));
  EXPECT_THAT(left, ::testing::Not(::testing::Contains("d1")));
  // Freed on the workers too: the ids can be put again, laid out otherwise.
  EXPECT_TRUE(client_->Put(Normal({8}, 5), PartitionSpec(), "d0").ok());
  const std::vector<std::string> two_unknown = {"d0", "x1", "x2"};
  s = client_->Delete(two_unknown);
  EXPECT_THAT(s.message(), HasSubstr("no arrays 'x1', 'x2' on this cluster"));
  EXPECT_EQ(client_->Get("d0").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->Delete(std::vector<std::string>{}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(client_->Delete("keep").ok());
}

// A replicated array's shard is the whole array. The coordinator used to build each worker's
// request apart and send them all at once, each call holding the block about three times (the
// block, the request, gRPC's serialization) until it returned: its peak grew by 27x the array on
// 8 workers, and a 1 GiB replicated put on 4 workers had it killed for memory. Now a block is
// serialised once and its holders' calls send those bytes (4.4-4.6x measured). A block that
// its holders can split among them is now sent in pieces and gathered by them (PutGathered):
// both paths are measured, the shared block by a length no dim of which 8 divides.
TEST_F(ArraysE2ETest, AReplicatedPutHoldsTheArrayOnTheCoordinatorAFewTimesNotOncePerWorker) {
  for (const int64_t n : {(int64_t{40} << 20) + 1, int64_t{40} << 20}) {  // 160 MiB, one block
    Tensor big(v1::DTYPE_F32, {n});
    float* v = static_cast<float*>(big.raw());
    for (int64_t i = 0; i < big.num_elements(); ++i) v[i] = static_cast<float>(i % 100003);
    const pid_t coordinator = cluster_->coordinator_pid();
    // Resets the peak to the current resident set (proc(5), clear_refs).
    std::ofstream(absl::StrCat("/proc/", coordinator, "/clear_refs")) << "5";
    const int64_t before = ProcessStatusBytes(coordinator, "VmRSS");
    ASSERT_GT(before, 0);
    auto info = client_->Put(big, PartitionSpec(), "big");
    ASSERT_TRUE(info.ok()) << info.status();
    const int64_t grew = ProcessStatusBytes(coordinator, "VmHWM") - before;
    const int64_t size = static_cast<int64_t>(big.size_bytes());
    // The shared block: 6.7-8.3x (the request, the array, the shared block, a call's
    // serialization and its TLS records, and the allocator's slack); before, 27x.
    EXPECT_LT(grew, 16 * size) << "the coordinator's peak grew by " << grew << " bytes for a "
                               << size << "-byte array on 8 workers";
    auto got = client_->Get("big");
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectEqual(*got, big);
    EXPECT_TRUE(client_->Delete("big").ok());
  }
}

}  // namespace
}  // namespace meshrun
