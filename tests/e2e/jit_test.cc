// JitBuilder: global programs partitioned by sharding annotations alone (the seeds' DotReluDot
// under data parallel, tensor parallel, FSDP and 2-D layouts), run on a real 2x4 cluster of worker
// processes and compared with the unsharded result computed here.
#include "meshrun/jit.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_join.h"
#include "core/sharding/logical_axes.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "meshrun/client.h"
#include "meshrun/local_cluster.h"
#include "tests/testutil/cluster.h"

namespace meshrun {
namespace {

PartitionSpec P(std::vector<std::string> names) { return PartitionSpec::Of(std::move(names)); }

// Host reference: relu(x @ w1) @ w2, f64 accumulation.
Tensor HostDotReluDot(const Tensor& x, const Tensor& w1, const Tensor& w2) {
  const int64_t m = x.dims()[0], k = x.dims()[1], h = w1.dims()[1], n = w2.dims()[1];
  std::vector<double> y(m * h);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < h; ++j) {
      double s = 0;
      for (int64_t p = 0; p < k; ++p)
        s += double{x.data<float>()[i * k + p]} * w1.data<float>()[p * h + j];
      y[i * h + j] = std::max(s, 0.0);
    }
  }
  Tensor z(v1::DTYPE_F32, {m, n});
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t p = 0; p < h; ++p) s += y[i * h + p] * w2.data<float>()[p * n + j];
      z.data<float>()[i * n + j] = static_cast<float>(s);
    }
  }
  return z;
}

struct Layout {
  std::string name;
  PartitionSpec x, w1, w2, out;
  std::vector<std::string> expected;  // the collectives the partitioner must insert
};

std::vector<std::string> Describe(const std::vector<JitBuilder::Collective>& cs) {
  std::vector<std::string> out;
  for (const auto& c : cs) out.push_back(c.Short());
  return out;
}

constexpr int64_t kBatch = 8, kDepth = 64, kHidden = 256;

// Builds the seed's DotReluDot on global arrays; only the annotations differ between layouts.
JitBuilder DotReluDot(const Mesh& mesh, const Layout& l) {
  JitBuilder jit(mesh);
  auto x = jit.Input(v1::DTYPE_F32, {kBatch, kDepth}, l.x);
  auto w1 = jit.Input(v1::DTYPE_F32, {kDepth, kHidden}, l.w1);
  auto w2 = jit.Input(v1::DTYPE_F32, {kHidden, kDepth}, l.w2);
  jit.Output(jit.Dot(jit.Unary("relu", jit.Dot(x, w1)), w2), l.out);
  return jit;
}

std::vector<Layout> Layouts() {
  const Mesh mesh = *Mesh::Parse("data=2,model=4");
  // FSDP layouts come from the seed's rule, not written by hand.
  const PartitionSpec w1_fsdp =
      FsdpShard({kDepth, kHidden}, PartitionSpec(), mesh, "data", 16)->spec;
  const PartitionSpec w2_fsdp =
      FsdpShard({kHidden, kDepth}, PartitionSpec(), mesh, "data", 16)->spec;
  const PartitionSpec w1_2d =
      FsdpShard({kDepth, kHidden}, P({"", "model"}), mesh, "data", 16)->spec;
  const PartitionSpec w2_2d =
      FsdpShard({kHidden, kDepth}, P({"model", ""}), mesh, "data", 16)->spec;
  return {
      {"data_parallel", P({"data", ""}), PartitionSpec(), PartitionSpec(), P({"data", ""}), {}},
      {"tensor_parallel",
       P({"data", ""}),
       P({"", "model"}),
       P({"model", ""}),
       P({"data", ""}),
       {"psum(model)"}},
      {"tensor_parallel_scattered_output",
       P({"data", ""}),
       P({"", "model"}),
       P({"model", ""}),
       P({"data", "model"}),
       {"psum_scatter(model)@1"}},
      {"fsdp",
       P({"data", ""}),
       w1_fsdp,
       w2_fsdp,
       P({"data", ""}),
       {"all_gather(data)@1", "all_gather(data)@0"}},
      {"fsdp_and_tensor_parallel",
       P({"data", ""}),
       w1_2d,
       w2_2d,
       P({"data", ""}),
       {"all_gather(data)@0", "all_gather(data)@1", "psum(model)"}},
      {"replicated_everything",
       PartitionSpec(),
       PartitionSpec(),
       PartitionSpec(),
       PartitionSpec(),
       {}},
  };
}

TEST(JitPartitionTest, InsertsTheCollectivesEachLayoutNeeds) {
  const Mesh mesh = *Mesh::Parse("data=2,model=4");
  for (const Layout& l : Layouts()) {
    JitBuilder jit = DotReluDot(mesh, l);
    ASSERT_TRUE(jit.Build().ok()) << l.name << ": " << jit.Build().status();
    EXPECT_EQ(Describe(jit.collectives()), l.expected) << l.name;
  }
  // FSDP: W1 [64, 256] is sharded over 'data' along its largest dim.
  EXPECT_EQ(Layouts()[3].w1, P({"", "data"}));
  // Bytes: TP's psum of z [8/2, 64] f32 over 4 devices is 2 * 3/4 of 1 KiB.
  JitBuilder tp = DotReluDot(mesh, Layouts()[1]);
  EXPECT_EQ(tp.collectives()[0].bytes_per_device, 2 * 3 * (4 * 64 * 4 / 4));
}

class JitE2ETest : public testing::ClusterSuite<JitE2ETest> {
 public:
  static constexpr const char* kMesh = "data=2,model=4";
  static constexpr const char* kTag = "jit";

 protected:
  // Puts x, w1 and w2 laid out as `l` says; their array ids, in that order.
  absl::StatusOr<std::vector<std::string>> PutArguments(const Layout& l, const Tensor& x,
                                                        const Tensor& w1, const Tensor& w2) {
    std::vector<std::string> ids;
    for (auto [t, spec] : {std::pair{&x, l.x}, {&w1, l.w1}, {&w2, l.w2}}) {
      absl::StatusOr<v1::ArrayInfo> put = client_->Put(*t, spec);
      if (!put.ok()) return put.status();
      ids.push_back(put->id());
    }
    return ids;
  }
};

TEST_F(JitE2ETest, EveryLayoutComputesTheUnshardedResult) {
  const Mesh mesh = *Mesh::Parse("data=2,model=4");
  const Tensor x = testing::NormalTensor({kBatch, kDepth}, 0);
  const Tensor w1 = testing::NormalTensor({kDepth, kHidden}, 1);
  const Tensor w2 = testing::NormalTensor({kHidden, kDepth}, 2);
  const Tensor want = HostDotReluDot(x, w1, w2);
  for (const Layout& l : Layouts()) {
    Tensor got = Run(DotReluDot(mesh, l).Build(), {&x, &w1, &w2});
    ASSERT_EQ(got.dims(), want.dims()) << l.name;
    for (int64_t i = 0; i < want.num_elements(); ++i) {
      ASSERT_NEAR(got.data<float>()[i], want.data<float>()[i],
                  1e-3f * (1 + std::abs(want.data<float>()[i])))
          << l.name << " element " << i;
    }
  }
}

// The coordinator, not the client, partitions: the client sends the global program (no
// collectives, global shapes) and the coordinator inserts each layout's collectives, runs the
// per-shard program, and serves later calls from its cache.
TEST_F(JitE2ETest, TheCoordinatorPartitionsTheGlobalProgram) {
  const Mesh mesh = *Mesh::Parse("data=2,model=4");
  const Tensor x = testing::NormalTensor({kBatch, kDepth}, 0);
  const Tensor w1 = testing::NormalTensor({kDepth, kHidden}, 1);
  const Tensor w2 = testing::NormalTensor({kHidden, kDepth}, 2);
  const Tensor want = HostDotReluDot(x, w1, w2);
  for (const Layout& l : Layouts()) {
    const JitBuilder jit = DotReluDot(mesh, l);
    const v1::GlobalProgram& program = jit.global_program();
    ASSERT_EQ(program.ops_size(), 7) << l.name;  // 3 inputs, dot, relu, dot, output
    absl::StatusOr<std::vector<std::string>> put = PutArguments(l, x, w1, w2);
    ASSERT_TRUE(put.ok()) << put.status();
    const std::vector<std::string>& ids = *put;
    for (int call = 0; call < 2; ++call) {
      absl::StatusOr<Client::JitResult> r = client_->Jit(program, ids);
      ASSERT_TRUE(r.ok()) << l.name << ": " << r.status();
      EXPECT_EQ(r->collectives, l.expected) << l.name;
      EXPECT_EQ(r->cache_hit, call == 1) << l.name;
      ASSERT_EQ(r->outputs.size(), 1u);
      absl::StatusOr<Tensor> got = client_->Get(r->outputs[0].id());
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_EQ(got->dims(), want.dims());
      for (int64_t i = 0; i < want.num_elements(); ++i) {
        ASSERT_NEAR(got->data<float>()[i], want.data<float>()[i],
                    1e-3f * (1 + std::abs(want.data<float>()[i])))
            << l.name << " element " << i;
      }
      ASSERT_TRUE(client_->Delete(r->outputs[0].id()).ok());
    }
    for (const std::string& id : ids) ASSERT_TRUE(client_->Delete(id).ok());
  }

  // Malformed programs and programs that do not partition on the cluster's mesh are rejected
  // naming the op.
  v1::GlobalProgram bad = DotReluDot(mesh, Layouts()[1]).global_program();
  bad.mutable_ops(4)->set_operands(0, 99);
  absl::StatusOr<Client::JitResult> r = client_->Jit(bad, {});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()),
              ::testing::HasSubstr("global program op 4 (UNARY): operand 99 does not exist"));
  JitBuilder other(*Mesh::Parse("data=2,expert=4"));
  other.Output(other.Input(v1::DTYPE_F32, {8, 64}, P({"expert", ""})), PartitionSpec());
  r = client_->Jit(other.global_program(), {});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), ::testing::HasSubstr("expert"));
}

// Grad ops are derived by the coordinator: the data-parallel gradient's psum comes out of its
// partitioner, and the gradient equals the one partitioned in the client.
TEST_F(JitE2ETest, FetchedResultsComeBackInTheResponseAndStayOffTheCluster) {
  const Mesh mesh = *Mesh::Parse("data=2,model=4");
  const Tensor x = testing::NormalTensor({kBatch, kDepth}, 0);
  const Tensor w1 = testing::NormalTensor({kDepth, kHidden}, 1);
  const Tensor w2 = testing::NormalTensor({kHidden, kDepth}, 2);
  for (const Layout& l : Layouts()) {
    const v1::GlobalProgram program = DotReluDot(mesh, l).global_program();
    absl::StatusOr<std::vector<std::string>> put = PutArguments(l, x, w1, w2);
    ASSERT_TRUE(put.ok()) << put.status();
    const std::vector<std::string>& ids = *put;
    absl::StatusOr<Client::JitResult> kept = client_->Jit(program, ids);
    ASSERT_TRUE(kept.ok()) << l.name << ": " << kept.status();
    absl::StatusOr<Tensor> want = client_->Get(kept->outputs[0].id());
    ASSERT_TRUE(want.ok()) << want.status();
    const size_t arrays_before = client_->ListArrays()->size();

    absl::StatusOr<Client::JitResult> r =
        client_->Jit(program, ids, {"unused"}, absl::Seconds(30), {}, {0});
    ASSERT_TRUE(r.ok()) << l.name << ": " << r.status();
    EXPECT_TRUE(r->outputs.empty()) << l.name;
    ASSERT_EQ(r->fetched.size(), 1u) << l.name;
    ASSERT_EQ(r->fetched[0].dims(), want->dims()) << l.name;
    EXPECT_EQ(std::memcmp(r->fetched[0].raw(), want->raw(), want->size_bytes()), 0)
        << l.name << ": the fetched result differs from the stored one";
    EXPECT_EQ(client_->ListArrays()->size(), arrays_before)
        << l.name << ": a fetched result was kept";
    EXPECT_EQ(client_->Get("unused").status().code(), absl::StatusCode::kNotFound);

    r = client_->Jit(program, ids, {}, absl::Seconds(30), {}, {1});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(r.status().message()),
                ::testing::HasSubstr("fetch_outputs: 1 is not a result index (0..0)"));
    ASSERT_TRUE(client_->Delete(kept->outputs[0].id()).ok());
    for (const std::string& id : ids) ASSERT_TRUE(client_->Delete(id).ok());
  }
}

TEST_F(JitE2ETest, TheCoordinatorDerivesGradients) {
  const Mesh mesh = *Mesh::Parse("data=2,model=4");
  JitBuilder jit(mesh);
  auto x = jit.Input(v1::DTYPE_F32, {kBatch, kDepth}, P({"data", ""}));
  auto w1 = jit.Input(v1::DTYPE_F32, {kDepth, kHidden}, PartitionSpec());
  auto loss = jit.Reduce("sum", jit.Unary("relu", jit.Dot(x, w1)), {0, 1});
  jit.Output(jit.Grad(loss, {w1})[0], PartitionSpec());
  ASSERT_EQ(jit.global_program().ops(jit.global_program().ops_size() - 2).kind(),
            v1::GlobalOp::GRAD);
  const Tensor tx = testing::NormalTensor({kBatch, kDepth}, 5);
  const Tensor tw = testing::NormalTensor({kDepth, kHidden}, 6);
  const Tensor local = Run(jit.Build(), {&tx, &tw});
  ASSERT_EQ(local.dims(), (Dims{kDepth, kHidden}));
  absl::StatusOr<v1::ArrayInfo> px = client_->Put(tx, P({"data", ""}));
  absl::StatusOr<v1::ArrayInfo> pw = client_->Put(tw, PartitionSpec());
  ASSERT_TRUE(px.ok() && pw.ok());
  absl::StatusOr<Client::JitResult> r = client_->Jit(jit.global_program(), {px->id(), pw->id()});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->collectives, ::testing::Contains("psum(data)"));
  absl::StatusOr<Tensor> remote = client_->Get(r->outputs[0].id());
  ASSERT_TRUE(remote.ok()) << remote.status();
  ASSERT_EQ(remote->dims(), local.dims());
  EXPECT_EQ(std::memcmp(remote->raw(), local.raw(), local.size_bytes()), 0);
  // The host's gradient: d/dw1 sum(relu(x @ w1)) = x^T (x @ w1 > 0).
  for (int64_t p = 0; p < kDepth; p += 13) {
    for (int64_t j = 0; j < kHidden; j += 37) {
      double g = 0;
      for (int64_t i = 0; i < kBatch; ++i) {
        double h = 0;
        for (int64_t k = 0; k < kDepth; ++k)
          h += double{tx.data<float>()[i * kDepth + k]} * tw.data<float>()[k * kHidden + j];
        if (h > 0) g += tx.data<float>()[i * kDepth + p];
      }
      EXPECT_NEAR(remote->data<float>()[p * kHidden + j], g, 1e-3 * (1 + std::abs(g)));
    }
  }
}

TEST_F(JitE2ETest, SeedLossSumAndMeanOverShardedDims) {
  // seed 000's loss: y.sum() over a ('data', 'model') array -> psum over both axes.
  const Mesh mesh = *Mesh::Parse("data=2,model=4");
  const Tensor x = testing::NormalTensor({kBatch, kHidden}, 3);
  double sum = 0;
  for (int64_t i = 0; i < x.num_elements(); ++i) sum += x.data<float>()[i];
  for (const std::string fn : {"sum", "mean"}) {
    JitBuilder jit(mesh);
    jit.Output(
        jit.Reduce(fn, jit.Input(v1::DTYPE_F32, {kBatch, kHidden}, P({"data", "model"})), {0, 1}),
        PartitionSpec());
    ASSERT_EQ(jit.collectives().size(), 1u);
    EXPECT_EQ(jit.collectives()[0].op, fn == "sum" ? "psum" : "pmean");
    EXPECT_EQ(jit.collectives()[0].axes, (std::vector<std::string>{"data", "model"}));
    Tensor got = Run(jit.Build(), {&x});
    ASSERT_EQ(got.num_elements(), 1);
    const double want = fn == "sum" ? sum : sum / x.num_elements();
    EXPECT_NEAR(got.data<float>()[0], want, 1e-3 * (1 + std::abs(want))) << fn;
  }
}

// The workers flush denormals to zero, as JAX computes on CPU (core/port/denormal.h): 1e-30 *
// 1e-10 is 0, not the denormal 1e-40.
TEST_F(JitE2ETest, WorkersFlushDenormalsToZeroAsJaxOnCpu) {
  const Mesh mesh = *Mesh::Parse("data=2,model=4");
  Tensor a(v1::DTYPE_F32, {kBatch, kHidden}), b(v1::DTYPE_F32, {kBatch, kHidden});
  for (int64_t i = 0; i < a.num_elements(); ++i) {
    a.data<float>()[i] = i % 2 == 0 ? 1e-30f : 1e-20f;
    b.data<float>()[i] = 1e-10f;
  }
  JitBuilder jit(mesh);
  const PartitionSpec spec = P({"data", "model"});
  jit.Output(jit.Mul(jit.Input(v1::DTYPE_F32, {kBatch, kHidden}, spec),
                     jit.Input(v1::DTYPE_F32, {kBatch, kHidden}, spec)),
             spec);
  const Tensor got = Run(jit.Build(), {&a, &b});
  ASSERT_EQ(got.num_elements(), a.num_elements());
  for (int64_t i = 0; i < got.num_elements(); ++i) {
    if (i % 2 == 0) {
      ASSERT_EQ(got.data<float>()[i], 0.0f) << "element " << i << ": a denormal product is flushed";
    } else {
      ASSERT_NEAR(got.data<float>()[i], 1e-30f, 1e-36f)
          << "element " << i << ": a normal product is kept";
    }
  }
}

TEST_F(JitE2ETest, AGradientScaledAndSquaredIsAllReducedOnce) {
  // Adam's moments from a data-parallel gradient g = x^T dy (a partial sum over 'data'):
  // 0.1 * g stays partial, but g * g needs g itself; both take the one psum of g, as XLA
  // all-reduces a gradient before the optimizer reads it.
  const Mesh mesh = *Mesh::Parse("data=2,model=4");
  const Tensor x = testing::NormalTensor({kBatch, kDepth}, 5);
  const Tensor dy = testing::NormalTensor({kBatch, kHidden}, 6);
  JitBuilder jit(mesh);
  auto xs = jit.Input(v1::DTYPE_F32, {kBatch, kDepth}, P({"data", ""}));
  auto dys = jit.Input(v1::DTYPE_F32, {kBatch, kHidden}, P({"data", ""}));
  auto g = jit.DotGeneral(xs, dys, {0}, {0});
  auto mu = jit.Scale(g, 0.1f);
  auto nu = jit.Scale(jit.Mul(g, g), 0.001f);
  jit.Output(jit.Add(jit.Add(mu, nu), jit.Scale(g, 2.0f)), PartitionSpec());
  EXPECT_EQ(Describe(jit.collectives()), (std::vector<std::string>{"psum(data)"}));
  const Tensor got = Run(jit.Build(), {&x, &dy});
  ASSERT_EQ(got.dims(), (Dims{kDepth, kHidden}));
  for (int64_t i = 0; i < kDepth; ++i) {
    for (int64_t j = 0; j < kHidden; ++j) {
      double gij = 0;
      for (int64_t b = 0; b < kBatch; ++b)
        gij += double{x.data<float>()[b * kDepth + i]} * dy.data<float>()[b * kHidden + j];
      const double want = 0.1 * gij + 0.001 * gij * gij + 2 * gij;
      ASSERT_NEAR(got.data<float>()[i * kHidden + j], want, 1e-4 * (1 + std::abs(want)))
          << i << ", " << j;
    }
  }
}

TEST_F(JitE2ETest, ShardingConstraintReshardsAnIntermediate) {
  // x ('data', None) -> constraint (None, 'model'): all_gather over 'data', then a free slice.
  const Mesh mesh = *Mesh::Parse("data=2,model=4");
  const Tensor x = testing::NormalTensor({kBatch, kHidden}, 4);
  JitBuilder jit(mesh);
  auto v = jit.WithShardingConstraint(jit.Input(v1::DTYPE_F32, {kBatch, kHidden}, P({"data", ""})),
                                      P({"", "model"}));
  EXPECT_EQ(jit.sharding(v), P({"", "model"}));
  jit.Output(jit.Unary("tanh", v), P({"", "model"}));
  EXPECT_EQ(Describe(jit.collectives()), (std::vector<std::string>{"all_gather(data)@0"}));
  Tensor got = Run(jit.Build(), {&x});
  ASSERT_EQ(got.dims(), x.dims());
  for (int64_t i = 0; i < x.num_elements(); ++i)
    ASSERT_NEAR(got.data<float>()[i], std::tanh(x.data<float>()[i]), 1e-5);
}

}  // namespace
}  // namespace meshrun
