// Every collective through real clusters of worker processes: world sizes 1..8 and the groups of
// the 2x4 mesh, element counts 0, 1 and 13, f32 and bf16, each device's result compared with a
// reference computed here. Outputs use a spec that gives every device its own block, so the
// assembled array holds every device's local result.
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "core/array_ops.h"
#include "core/collectives/reduce_kernels.h"
#include "core/random/threefry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "meshrun/client.h"
#include "meshrun/local_cluster.h"
#include "meshrun/shard_map.h"
#include "tests/testutil/cluster.h"

namespace meshrun {
namespace {

float Value(int64_t i) { return static_cast<float>((i * 5) % 11 - 5); }

Tensor Make(DType dtype, int64_t n) {
  Tensor t(dtype, {n});
  for (int64_t i = 0; i < n; ++i) SetFromDouble(t, i, Value(i));
  return t;
}

std::unique_ptr<LocalCluster> Start(const std::string& mesh) { return testing::StartCluster(mesh, "coll"); }

// Fetches array `id` as doubles.
std::vector<double> Fetch(Client& client, const std::string& id) {
  auto t = client.Get(id);
  EXPECT_TRUE(t.ok()) << t.status();
  std::vector<double> out;
  if (t.ok()) {
    for (int64_t i = 0; i < t->num_elements(); ++i) out.push_back(GetAsDouble(*t, i));
  }
  return out;
}

class WorldSizeTest : public ::testing::TestWithParam<int> {};

TEST_P(WorldSizeTest, EveryCollectiveMatchesTheReference) {
  const int n = GetParam();
  auto cluster = Start(absl::StrCat("x=", n));
  ASSERT_NE(cluster, nullptr);
  auto client = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(client.ok());
  const Mesh mesh = *Mesh::Parse(absl::StrCat("x=", n));
  const PartitionSpec px = PartitionSpec::Of({"x"});
  int run = 0;
  for (DType dtype : {v1::DTYPE_F32, v1::DTYPE_BF16}) {
    for (int64_t count : {0, 1, 13}) {
      SCOPED_TRACE(absl::StrCat("world ", n, " ", DTypeName(dtype), " count ", count));
      const double tol = dtype == v1::DTYPE_BF16 ? 0.06 : 1e-5;
      ShardMapBuilder sm(mesh);
      auto x = sm.Input(dtype, {n * count}, px);       // local [count]
      auto y = sm.Input(dtype, {n * n * count}, px);   // local [n * count]
      std::vector<std::pair<int, int>> shift;
      for (int i = 0; i < n; ++i) shift.push_back({i, (i + 1) % n});
      sm.Output(sm.Psum(x, {"x"}), px);
      sm.Output(sm.Pmean(x, {"x"}), px);
      sm.Output(sm.Pmax(x, {"x"}), px);
      sm.Output(sm.AllGather(x, {"x"}, 0, true), px);
      sm.Output(sm.PsumScatter(y, {"x"}, 0, true), px);
      sm.Output(sm.Ppermute(x, {"x"}, shift), px);
      sm.Output(sm.AllToAll(y, {"x"}, 0, 0), px);
      auto program = sm.Build();
      ASSERT_TRUE(program.ok()) << program.status();
      const std::string xs = absl::StrCat("x", run), ys = absl::StrCat("y", run);
      ++run;
      ASSERT_TRUE((*client)->Put(Make(dtype, n * count), px, xs).ok());
      ASSERT_TRUE((*client)->Put(Make(dtype, n * n * count), px, ys).ok());
      auto outs = (*client)->ShardMap(*program, {xs, ys});
      ASSERT_TRUE(outs.ok()) << outs.status();
      std::vector<std::vector<double>> got;
      for (const auto& o : *outs) got.push_back(Fetch(**client, o.id()));
      auto xv = [&](int d, int64_t i) { return double{Value(d * count + i)}; };        // device d's x
      auto yv = [&](int d, int64_t i) { return double{Value(d * n * count + i)}; };    // device d's y
      for (int d = 0; d < n; ++d) {
        for (int64_t i = 0; i < count; ++i) {
          double sum = 0, max = -1e9;
          for (int e = 0; e < n; ++e) {
            sum += xv(e, i);
            max = std::max(max, xv(e, i));
          }
          EXPECT_NEAR(got[0][d * count + i], sum, tol) << "psum device " << d;
          EXPECT_NEAR(got[1][d * count + i], sum / n, tol) << "pmean device " << d;
          EXPECT_EQ(got[2][d * count + i], max) << "pmax device " << d;
          double scattered = 0;
          for (int e = 0; e < n; ++e) scattered += yv(e, d * count + i);
          EXPECT_NEAR(got[4][d * count + i], scattered, tol) << "psum_scatter device " << d;
          EXPECT_EQ(got[5][d * count + i], xv((d + n - 1) % n, i)) << "ppermute device " << d;
        }
        for (int e = 0; e < n; ++e) {
          for (int64_t i = 0; i < count; ++i) {
            EXPECT_EQ(got[3][(d * n + e) * count + i], xv(e, i)) << "all_gather device " << d;
            EXPECT_EQ(got[6][(d * n + e) * count + i], yv(e, d * count + i)) << "all_to_all device " << d;
          }
        }
      }
    }
  }
  ASSERT_TRUE(cluster->Stop().ok());
}

INSTANTIATE_TEST_SUITE_P(OneToEight, WorldSizeTest, ::testing::Range(1, 9));

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Over shared memory (the workers share this host) and over the gRPC ring only, as between hosts.
class SubAxisOverTransportTest : public ::testing::TestWithParam<bool> {};

TEST_P(SubAxisOverTransportTest, CollectivesOverEachAxisAndBothOfThe2x4Mesh) {
  const bool shm = GetParam();
  auto cluster = testing::StartCluster("data=2,model=4", "coll", shm);
  ASSERT_NE(cluster, nullptr);
  auto client = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(client.ok());
  const Mesh mesh = *Mesh::Parse("data=2,model=4");
  const PartitionSpec each(std::vector<PartitionSpec::Entry>{{"data", "model"}});  // device d: block d
  for (DType dtype : {v1::DTYPE_F32, v1::DTYPE_BF16}) {
    const int64_t count = 13;
    ShardMapBuilder sm(mesh);
    auto x = sm.Input(dtype, {8 * count}, each);
    sm.Output(sm.Psum(x, {"data"}), each);
    sm.Output(sm.Psum(x, {"model"}), each);
    sm.Output(sm.Psum(x, {"data", "model"}), each);
    sm.Output(sm.AllGather(x, {"model"}, 0, true), each);
    sm.Output(sm.Reshape(sm.AxisIndex({"model", "data"}), {1}), each);
    auto program = sm.Build();
    ASSERT_TRUE(program.ok()) << program.status();
    const std::string id = absl::StrCat("sub-", DTypeName(dtype));
    ASSERT_TRUE((*client)->Put(Make(dtype, 8 * count), each, id).ok());
    auto outs = (*client)->ShardMap(*program, {id});
    ASSERT_TRUE(outs.ok()) << outs.status().message();
    std::vector<std::vector<double>> got;
    for (const auto& o : *outs) got.push_back(Fetch(**client, o.id()));
    auto xv = [&](int d, int64_t i) { return double{Value(d * count + i)}; };
    for (int d = 0; d < 8; ++d) {
      const int r = d / 4, c = d % 4;
      for (int64_t i = 0; i < count; ++i) {
        double over_data = xv(c, i) + xv(4 + c, i), over_model = 0, over_both = 0;
        for (int k = 0; k < 4; ++k) over_model += xv(r * 4 + k, i);
        for (int k = 0; k < 8; ++k) over_both += xv(k, i);
        EXPECT_NEAR(got[0][d * count + i], over_data, 0.06) << "psum over data, device " << d;
        EXPECT_NEAR(got[1][d * count + i], over_model, 0.06) << "psum over model, device " << d;
        EXPECT_NEAR(got[2][d * count + i], over_both, 0.3) << "psum over both, device " << d;
        for (int k = 0; k < 4; ++k) {
          EXPECT_EQ(got[3][(d * 4 + k) * count + i], xv(r * 4 + k, i)) << "all_gather over model, device " << d;
        }
      }
      EXPECT_EQ(got[4][d], c * 2 + r) << "axis_index(('model', 'data')) of device " << d;
    }
  }
  ASSERT_TRUE(cluster->Stop().ok());
  // Each worker names its 7 peers as on this host, or none.
  for (int w = 0; w < 8; ++w) {
    EXPECT_THAT(ReadFile(absl::StrCat(cluster->log_dir(), "/worker", w, ".log")),
                ::testing::ContainsRegex(shm ? "on this host: \\[[0-7], [0-7], [0-7], [0-7], [0-7], [0-7], [0-7]\\]"
                                             : "on this host: \\[\\]"))
        << "worker " << w;
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, SubAxisOverTransportTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Shm" : "Grpc"; });

// The seed's FSDP shard_params pattern: each device keeps lax.dynamic_slice_in_dim(w,
// axis_index * size, size); plus iota and random bits.
TEST(SubAxisGroupsTest, DynamicSliceByAxisIndexIotaAndRandomBits) {
  auto cluster = Start("data=4");
  ASSERT_NE(cluster, nullptr);
  auto client = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(client.ok());
  const Mesh mesh = *Mesh::Parse("data=4");
  ShardMapBuilder sm(mesh);
  auto w = sm.Input(v1::DTYPE_F32, {8, 3}, PartitionSpec());        // replicated
  auto key = sm.Input(v1::DTYPE_U32, {2}, PartitionSpec());
  sm.Output(sm.DynamicSliceInDim(w, sm.AxisIndex({"data"}), 2, 0), PartitionSpec::Of({"data"}));
  sm.Output(sm.Iota(v1::DTYPE_I32, {2, 3}, 1), PartitionSpec());
  sm.Output(sm.RandomBits(key, {5}), PartitionSpec());
  auto program = sm.Build();
  ASSERT_TRUE(program.ok()) << program.status();
  Tensor wt(v1::DTYPE_F32, {8, 3});
  for (int i = 0; i < 24; ++i) wt.data<float>()[i] = static_cast<float>(i);
  Tensor kt(v1::DTYPE_U32, {2});
  kt.data<uint32_t>()[1] = 42;
  ASSERT_TRUE((*client)->Put(wt, PartitionSpec(), "w").ok());
  ASSERT_TRUE((*client)->Put(kt, PartitionSpec(), "key").ok());
  auto outs = (*client)->ShardMap(*program, {"w", "key"});
  ASSERT_TRUE(outs.ok()) << outs.status();
  EXPECT_EQ(Fetch(**client, (*outs)[0].id()), Fetch(**client, "w"));  // the slices reassemble w
  EXPECT_EQ(Fetch(**client, (*outs)[1].id()), (std::vector<double>{0, 1, 2, 0, 1, 2}));
  std::vector<double> bits = Fetch(**client, (*outs)[2].id());
  const std::vector<uint32_t> expected = RandomBits(PRNGKey{0, 42}, 5);
  ASSERT_EQ(bits.size(), 5u);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(bits[i], expected[i]);
  ASSERT_TRUE(cluster->Stop().ok());
}

}  // namespace
}  // namespace meshrun
