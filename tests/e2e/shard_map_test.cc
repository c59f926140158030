// The seed's shard_map examples (001, first half), through real clusters of 8 worker processes.
#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"
#include "core/collectives/reduce_kernels.h"
#include "core/random/threefry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "meshrun/client.h"
#include "meshrun/local_cluster.h"
#include "tests/testutil/cluster.h"
#include "meshrun/shard_map.h"

namespace meshrun {
namespace {

using ::testing::HasSubstr;

PartitionSpec P(std::vector<std::string> names) { return PartitionSpec::Of(std::move(names)); }

class ShardMapE2ETest : public testing::ClusterSuite<ShardMapE2ETest> {
 public:
  static constexpr const char* kMesh = "i=4,j=2";
  static constexpr const char* kTag = "shardmap";

 protected:
  static Tensor Normal(Dims dims, uint32_t seed) { return testing::NormalTensor(std::move(dims), seed); }
  static Tensor HostMatmul(const Tensor& x, const Tensor& w, const Tensor* b) {
    const int64_t m = x.dims()[0], k = x.dims()[1], n = w.dims()[1];
    Tensor out(v1::DTYPE_F32, {m, n});
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double s = b ? b->data<float>()[j] : 0.0;
        for (int64_t p = 0; p < k; ++p) s += double{x.data<float>()[i * k + p]} * w.data<float>()[p * n + j];
        out.data<float>()[i * n + j] = static_cast<float>(s);
      }
    }
    return out;
  }
  static void ExpectNear(const Tensor& a, const Tensor& b, float tol) {
    ASSERT_EQ(a.dims(), b.dims());
    for (int64_t i = 0; i < a.num_elements(); ++i) ASSERT_NEAR(a.data<float>()[i], b.data<float>()[i], tol) << i;
  }
};

TEST_F(ShardMapE2ETest, ShardedMatmulPlusBiasEqualsUnsharded) {
  const Tensor x = Normal({192, 64}, 0), w = Normal({64, 128}, 1), b = Normal({128}, 2);
  ShardMapBuilder sm(*mesh_);
  auto xv = sm.Input(v1::DTYPE_F32, {192, 64}, P({"i", ""}));
  auto wv = sm.Input(v1::DTYPE_F32, {64, 128}, P({"", "j"}));
  auto bv = sm.Input(v1::DTYPE_F32, {128}, P({"j"}));
  EXPECT_EQ(sm.shape(xv), (Dims{48, 64}));  // "Local x shape (48, 64)"
  EXPECT_EQ(sm.shape(wv), (Dims{64, 64}));
  EXPECT_EQ(sm.shape(bv), (Dims{64}));
  sm.Output(sm.Add(sm.Dot(xv, wv), bv), P({"i", "j"}));
  Tensor y = Run(sm.Build(), {&x, &w, &b});
  EXPECT_EQ(y.dims(), (Dims{192, 128}));
  ExpectNear(y, HostMatmul(x, w, &b), 1e-3f);
}

TEST_F(ShardMapE2ETest, ParallelNormalizeHasMeanZeroAndStdOne) {
  const Tensor x = Normal({192, 64}, 0);
  ShardMapBuilder sm(*mesh_);
  auto xv = sm.Input(v1::DTYPE_F32, {192, 64}, P({"i", "j"}));
  auto mean = sm.Pmean(xv, {"j"});
  auto centered = sm.Sub(xv, mean);
  auto std = sm.Pow(sm.Pmean(sm.Mul(centered, centered), {"j"}), 0.5f);
  sm.Output(sm.Div(centered, std), P({"i", "j"}));
  Tensor y = Run(sm.Build(), {&x});
  double sum = 0, sq = 0;
  for (int64_t i = 0; i < y.num_elements(); ++i) sum += y.data<float>()[i];
  const double m = sum / y.num_elements();
  for (int64_t i = 0; i < y.num_elements(); ++i) sq += (y.data<float>()[i] - m) * (y.data<float>()[i] - m);
  EXPECT_NEAR(m, 0.0, 1e-5);
  EXPECT_NEAR(std::sqrt(sq / y.num_elements()), 1.0, 1e-4);
}

TEST_F(ShardMapE2ETest, MatmulWithWeightGatherEqualsXAtW) {
  const Tensor x = Normal({192, 64}, 0), w = Normal({64, 128}, 1);
  ShardMapBuilder sm(*mesh_);
  auto xv = sm.Input(v1::DTYPE_F32, {192, 64}, P({"i", ""}));
  auto wv = sm.Input(v1::DTYPE_F32, {64, 128}, P({"i", ""}));
  EXPECT_EQ(sm.shape(wv), (Dims{16, 128}));  // "Original w shape (16, 128)"
  auto gathered = sm.AllGather(wv, {"i"}, 0, /*tiled=*/true);
  EXPECT_EQ(sm.shape(gathered), (Dims{64, 128}));  // "Gathered w shape (64, 128)"
  sm.Output(sm.Dot(xv, gathered), P({"i", ""}));
  ExpectNear(Run(sm.Build(), {&x, &w}), HostMatmul(x, w, nullptr), 1e-3f);
}

TEST_F(ShardMapE2ETest, PsumScatterPrints22_20_12_17) {
  Tensor x(v1::DTYPE_F32, {4, 4});
  const float v[16] = {3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 1, 2};
  std::memcpy(x.raw(), v, sizeof(v));
  ShardMapBuilder sm(*mesh_);
  auto xv = sm.Input(v1::DTYPE_F32, {4, 4}, P({"i", ""}));
  auto scattered = sm.PsumScatter(xv, {"i"}, 1, /*tiled=*/false);  // local [1, 4] -> [1]
  sm.Output(scattered, P({"i"}));
  Tensor y = Run(sm.Build(), {&x});
  ASSERT_EQ(y.dims(), (Dims{4}));
  EXPECT_EQ(std::vector<float>(y.data<float>(), y.data<float>() + 4), (std::vector<float>{22, 20, 12, 17}));
}

TEST_F(ShardMapE2ETest, PpermutePrints3_0_1_2) {
  Tensor x(v1::DTYPE_F32, {4});
  for (int i = 0; i < 4; ++i) x.data<float>()[i] = static_cast<float>(i);
  ShardMapBuilder sm(*mesh_);
  auto xv = sm.Input(v1::DTYPE_F32, {4}, P({"i"}));
  sm.Output(sm.Ppermute(xv, {"i"}, {{0, 1}, {1, 2}, {2, 3}, {3, 0}}), P({"i"}));
  Tensor y = Run(sm.Build(), {&x});
  EXPECT_EQ(std::vector<float>(y.data<float>(), y.data<float>() + 4), (std::vector<float>{3, 0, 1, 2}));
}

TEST_F(ShardMapE2ETest, AxisIndexTableForAllEightDevices) {
  ShardMapBuilder sm(*mesh_);
  auto row = sm.Stack({sm.AxisIndex({"i"}), sm.AxisIndex({"j"})}, 0);  // [2]
  sm.Output(sm.Reshape(row, {1, 2}), PartitionSpec(std::vector<PartitionSpec::Entry>{{"i", "j"}}));
  auto program = sm.Build();
  ASSERT_TRUE(program.ok()) << program.status();
  auto outs = client_->ShardMap(*program, {});
  ASSERT_TRUE(outs.ok()) << outs.status();
  auto y = client_->Get((*outs)[0].id());
  ASSERT_TRUE(y.ok());
  ASSERT_EQ(y->dims(), (Dims{8, 2}));
  for (int d = 0; d < 8; ++d) {
    EXPECT_EQ(y->data<int32_t>()[2 * d], d / 2) << "Device " << d << ": i-axis";
    EXPECT_EQ(y->data<int32_t>()[2 * d + 1], d % 2) << "Device " << d << ": j-axis";
  }
}

TEST_F(ShardMapE2ETest, FoldRngOverAxisMatchesJax) {
  Tensor key(v1::DTYPE_U32, {2});
  key.data<uint32_t>()[0] = 0;  // jax.random.PRNGKey(0)
  key.data<uint32_t>()[1] = 0;
  ShardMapBuilder sm(*mesh_);
  auto kv = sm.Input(v1::DTYPE_U32, {2}, PartitionSpec());
  sm.Output(sm.FoldIn(kv, sm.AxisIndex({"i"})), PartitionSpec(std::vector<PartitionSpec::Entry>{{"i", "j"}}));
  auto program = sm.Build();
  Tensor y = Run(program, {&key});
  ASSERT_EQ(y.dims(), (Dims{16}));
  // The seed prints [1797259609 2579123966] for i = 0, [928981903 3453687069] for i = 1, ...
  const uint32_t expected[4][2] = {
      {1797259609u, 2579123966u}, {928981903u, 3453687069u}, {4146024105u, 2718843009u}, {2467461003u, 3840466878u}};
  for (int d = 0; d < 8; ++d) {
    EXPECT_EQ(y.data<uint32_t>()[2 * d], expected[d / 2][0]) << "device " << d;
    EXPECT_EQ(y.data<uint32_t>()[2 * d + 1], expected[d / 2][1]) << "device " << d;
  }
}

TEST_F(ShardMapE2ETest, AllToAllMovesBlocksLikeJax) {
  // x [4, 8] sharded P(None, 'i'): local [4, 2]; all_to_all(split_axis=0, concat_axis=1) over 'i'
  // gives local [1, 8] laid out P('i', None): the transpose of the blocks.
  Tensor x(v1::DTYPE_F32, {4, 8});
  for (int64_t i = 0; i < 32; ++i) x.data<float>()[i] = static_cast<float>(i);
  ShardMapBuilder sm(*mesh_);
  auto xv = sm.Input(v1::DTYPE_F32, {4, 8}, P({"", "i"}));
  auto y = sm.AllToAll(xv, {"i"}, 0, 1);
  EXPECT_EQ(sm.shape(y), (Dims{1, 8}));
  sm.Output(y, P({"i", ""}));
  Tensor out = Run(sm.Build(), {&x});
  // Resharding P(None, 'i') -> P('i', None) keeps the global array.
  for (int64_t i = 0; i < 32; ++i) EXPECT_EQ(out.data<float>()[i], i);
}

TEST_F(ShardMapE2ETest, DotGeneralWithBatchAndContractingDims) {
  // Batched: a [4, 3, 5] and b [4, 5, 2] sharded on the batch dim; contract a's dim 2 with b's 1.
  const Tensor a = Normal({4, 3, 5}, 7), b = Normal({4, 5, 2}, 8), c = Normal({5, 3}, 9), d = Normal({5, 2}, 10);
  ShardMapBuilder sm(*mesh_);
  auto av = sm.Input(v1::DTYPE_F32, {4, 3, 5}, P({"i"}));
  auto bv = sm.Input(v1::DTYPE_F32, {4, 5, 2}, P({"i"}));
  auto cv = sm.Input(v1::DTYPE_F32, {5, 3}, PartitionSpec());
  auto dv = sm.Input(v1::DTYPE_F32, {5, 2}, PartitionSpec());
  auto batched = sm.DotGeneral(av, bv, {2}, {1}, {0}, {0});
  EXPECT_EQ(sm.shape(batched), (Dims{1, 3, 2}));
  sm.Output(batched, P({"i"}));
  sm.Output(sm.DotGeneral(cv, dv, {0}, {0}), PartitionSpec());  // c^T d
  auto program = sm.Build();
  ASSERT_TRUE(program.ok()) << program.status();
  std::vector<std::string> ids;
  for (const auto& [t, spec] : std::vector<std::pair<const Tensor*, PartitionSpec>>{
           {&a, P({"i"})}, {&b, P({"i"})}, {&c, PartitionSpec()}, {&d, PartitionSpec()}}) {
    auto info = client_->Put(*t, spec);
    ASSERT_TRUE(info.ok());
    ids.push_back(info->id());
  }
  auto outs = client_->ShardMap(*program, ids);
  ASSERT_TRUE(outs.ok()) << outs.status();
  auto y = client_->Get((*outs)[0].id());
  auto z = client_->Get((*outs)[1].id());
  ASSERT_TRUE(y.ok() && z.ok());
  ASSERT_EQ(y->dims(), (Dims{4, 3, 2}));
  for (int bt = 0; bt < 4; ++bt) {
    for (int i = 0; i < 3; ++i) {
      for (int j = 0; j < 2; ++j) {
        double s = 0;
        for (int k = 0; k < 5; ++k) s += a.data<float>()[bt * 15 + i * 5 + k] * b.data<float>()[bt * 10 + k * 2 + j];
        EXPECT_NEAR(y->data<float>()[bt * 6 + i * 2 + j], s, 1e-4);
      }
    }
  }
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 2; ++j) {
      double s = 0;
      for (int k = 0; k < 5; ++k) s += c.data<float>()[k * 3 + i] * d.data<float>()[k * 2 + j];
      EXPECT_NEAR(z->data<float>()[i * 2 + j], s, 1e-4);
    }
  }
}

TEST_F(ShardMapE2ETest, Bf16MathRunsInF32AndReturnsBf16) {
  Tensor x(v1::DTYPE_BF16, {8});
  for (int i = 0; i < 8; ++i) x.data<uint16_t>()[i] = F32ToBf16(0.25f * i);
  ShardMapBuilder sm(*mesh_);
  auto xv = sm.Input(v1::DTYPE_BF16, {8}, P({"i"}));
  auto y = sm.Add(sm.Tanh(xv), sm.Psum(xv, {"j"}));  // psum over j doubles the (replicated) block
  EXPECT_EQ(sm.dtype(y), v1::DTYPE_BF16);
  sm.Output(y, P({"i"}));
  Tensor out = Run(sm.Build(), {&x});
  ASSERT_EQ(out.dtype(), v1::DTYPE_BF16);
  for (int i = 0; i < 8; ++i) {
    EXPECT_NEAR(Bf16ToF32(out.data<uint16_t>()[i]), std::tanh(0.25f * i) + 0.5f * i, 0.02) << i;
  }
}

// A dot of two bf16 arrays is one bf16 GEMM on each worker (no conversion to f32 first), its
// products accumulated in f32 and its result bf16, as jnp.dot of bf16 arrays.
TEST_F(ShardMapE2ETest, Bf16DotIsABf16Gemm) {
  const Tensor xf = Normal({8, 48}, 3), wf = Normal({48, 6}, 4);
  Tensor x = Tensor::Uninitialized(v1::DTYPE_BF16, xf.dims());
  Tensor w = Tensor::Uninitialized(v1::DTYPE_BF16, wf.dims());
  for (int64_t i = 0; i < x.num_elements(); ++i)
    x.data<uint16_t>()[i] = F32ToBf16(xf.data<float>()[i]);
  for (int64_t i = 0; i < w.num_elements(); ++i)
    w.data<uint16_t>()[i] = F32ToBf16(wf.data<float>()[i]);
  ShardMapBuilder sm(*mesh_);
  auto xv = sm.Input(v1::DTYPE_BF16, {8, 48}, P({"i", ""}));
  auto wv = sm.Input(v1::DTYPE_BF16, {48, 6}, P({"", ""}));
  auto y = sm.Dot(xv, wv);
  EXPECT_EQ(sm.dtype(y), v1::DTYPE_BF16);
  sm.Output(y, P({"i", ""}));
  absl::StatusOr<v1::ShardMapProgram> program = sm.Build();
  ASSERT_TRUE(program.ok()) << program.status();
  int matmuls = 0;
  for (const v1::Op& op : program->program().functions(0).ops()) {
    EXPECT_NE(op.kind(), v1::OP_CONVERT) << op.ShortDebugString();
    matmuls += op.kind() == v1::OP_MATMUL;
  }
  EXPECT_EQ(matmuls, 1);
  Tensor out = Run(program, {&x, &w});
  ASSERT_EQ(out.dtype(), v1::DTYPE_BF16);
  for (int64_t r = 0; r < 8; ++r) {
    for (int64_t c = 0; c < 6; ++c) {
      double want = 0;
      for (int64_t k = 0; k < 48; ++k)
        want += double{Bf16ToF32(x.data<uint16_t>()[r * 48 + k])} *
                Bf16ToF32(w.data<uint16_t>()[k * 6 + c]);
      // The f32 sum rounded once to bf16 (8 significant bits).
      EXPECT_NEAR(Bf16ToF32(out.data<uint16_t>()[r * 6 + c]), want, std::abs(want) / 128 + 1e-4)
          << r << "," << c;
    }
  }
}

TEST_F(ShardMapE2ETest, BadProgramsAreRejectedAndTheClusterKeepsServing) {
  const Tensor x = Normal({192, 64}, 0);
  auto xi = client_->Put(x, P({"i", ""}), "bad-x");
  ASSERT_TRUE(xi.ok());
  ShardMapBuilder sm(*mesh_);
  auto xv = sm.Input(v1::DTYPE_F32, {192, 64}, P({"", "j"}));
  sm.Output(sm.Tanh(xv), P({"", "j"}));
  auto r = client_->ShardMap(*sm.Build(), {"bad-x"});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(),
              HasSubstr("argument 0 (array 'bad-x') is laid out as PartitionSpec('i', None) but in_specs[0] is "
                        "PartitionSpec(None, 'j')"));
  ShardMapBuilder bad(*mesh_);
  auto v = bad.Input(v1::DTYPE_F32, {192, 64}, P({"i", ""}));
  bad.Ppermute(v, {"i"}, {{0, 1}, {0, 2}});
  bad.Output(v, P({"i", ""}));
  auto built = bad.Build();
  ASSERT_TRUE(built.ok());  // the perm is checked where it runs
  r = client_->ShardMap(*built, {"bad-x"});
  EXPECT_THAT(r.status().message(), HasSubstr("is not a permutation: source 0 appears twice"));
  ShardMapBuilder wrong_axis(*mesh_);
  wrong_axis.Output(wrong_axis.Psum(wrong_axis.Input(v1::DTYPE_F32, {8}, P({"i"})), {"model"}), P({"i"}));
  EXPECT_THAT(wrong_axis.Build().status().message(), HasSubstr("mesh axis 'model' is not in"));
  // Still serving.
  ShardMapBuilder ok(*mesh_);
  ok.Output(ok.Tanh(ok.Input(v1::DTYPE_F32, {192, 64}, P({"i", ""}))), P({"i", ""}));
  auto outs = client_->ShardMap(*ok.Build(), {"bad-x"});
  ASSERT_TRUE(outs.ok()) << outs.status();
  auto y = client_->Get((*outs)[0].id());
  ASSERT_TRUE(y.ok());
  for (int64_t i = 0; i < x.num_elements(); ++i) ASSERT_NEAR(y->data<float>()[i], std::tanh(x.data<float>()[i]), 1e-5);
}

}  // namespace
}  // namespace meshrun

namespace meshrun {
namespace {

// The seed's first example: a = arange(8) sharded P('i') over Mesh('i': 8); tanh per shard.
TEST(ShardMapEightWayTest, ShardedTanhOnTheEightWorkerMesh) {
  auto cluster = testing::StartCluster("i=8", "tanh");
  ASSERT_NE(cluster, nullptr);
  auto client = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(client.ok());
  Tensor a(v1::DTYPE_F32, {8});
  for (int i = 0; i < 8; ++i) a.data<float>()[i] = static_cast<float>(i);
  ASSERT_TRUE((*client)->Put(a, PartitionSpec::Of({"i"}), "a").ok());
  auto grid = (*client)->VisualizeSharding("a");
  ASSERT_TRUE(grid.ok());
  EXPECT_THAT(*grid, ::testing::HasSubstr("| CPU 0 | CPU 1 | CPU 2 | CPU 3 | CPU 4 | CPU 5 | CPU 6 | CPU 7 |"));
  ShardMapBuilder sm(*Mesh::Parse("i=8"));
  sm.Output(sm.Tanh(sm.Input(v1::DTYPE_F32, {8}, PartitionSpec::Of({"i"}))), PartitionSpec::Of({"i"}));
  auto outs = (*client)->ShardMap(*sm.Build(), {"a"}, {"out"});
  ASSERT_TRUE(outs.ok()) << outs.status();
  auto out = (*client)->Get("out");
  ASSERT_TRUE(out.ok());
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(out->data<float>()[i], std::tanh(static_cast<float>(i)), 1e-6);
  grid = (*client)->VisualizeSharding("out");
  EXPECT_THAT(*grid, ::testing::HasSubstr("| CPU 0 | CPU 1 |"));
  ASSERT_TRUE(cluster->Stop().ok());
}

}  // namespace
}  // namespace meshrun

namespace meshrun {
namespace {

// Ranks 2 and 3 fail before the psum (their dynamic_slice start is out of range); ranks 0 and 1
// would wait in it. The error names the ranks that did not arrive, comes back in seconds, and
// the cluster serves the next program.
TEST(ShardMapFailureTest, RanksThatNeverReachTheCollectiveAreNamed) {
  auto cluster = testing::StartCluster("i=4", "partial");
  ASSERT_NE(cluster, nullptr);
  auto client = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(client.ok());
  Tensor x(v1::DTYPE_F32, {4});
  ASSERT_TRUE((*client)->Put(x, PartitionSpec(), "x").ok());
  const Mesh mesh = *Mesh::Parse("i=4");
  ShardMapBuilder sm(mesh);
  auto xv = sm.Input(v1::DTYPE_F32, {4}, PartitionSpec());
  auto mine = sm.DynamicSliceInDim(xv, sm.AxisIndex({"i"}), 2, 0);  // blocks 2 and 3 do not exist
  sm.Output(sm.Psum(mine, {"i"}), PartitionSpec());
  const absl::Time start = absl::Now();
  auto r = (*client)->ShardMap(*sm.Build(), {"x"}, {}, absl::Seconds(20));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  ASSERT_FALSE(r.ok());
  const std::string message(r.status().message());
  EXPECT_THAT(message, ::testing::HasSubstr("shard_map failed on ranks 2, 3"));
  EXPECT_THAT(message, ::testing::HasSubstr("dynamic_slice start block 2"));
  ShardMapBuilder ok(mesh);
  ok.Output(ok.Psum(ok.Input(v1::DTYPE_F32, {4}, PartitionSpec()), {"i"}), PartitionSpec());
  auto outs = (*client)->ShardMap(*ok.Build(), {"x"});
  EXPECT_TRUE(outs.ok()) << outs.status();
  ASSERT_TRUE(cluster->Stop().ok());
}

}  // namespace
}  // namespace meshrun
