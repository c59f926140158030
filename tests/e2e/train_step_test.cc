// Train steps derived by autodiff and partitioned from annotations alone: gradients against the
// host's on real clusters of worker processes, and the plans' checks and collectives.
#include "meshrun/train_step.h"

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/random/threefry.h"
#include "core/sharding/logical_axes.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "meshrun/client.h"
#include "meshrun/jit.h"
#include "meshrun/local_cluster.h"
#include "meshrun/nn.h"
#include "meshrun/workloads.h"
#include "tests/testutil/cluster.h"

namespace meshrun {
namespace {

PartitionSpec P(std::vector<std::string> names) { return PartitionSpec::Of(std::move(names)); }

std::vector<std::string> Ops(const std::vector<JitBuilder::Collective>& cs) {
  std::vector<std::string> out;
  for (const auto& c : cs) out.push_back(c.Short());
  return out;
}

// ---------------------------------------------------------------------------------------------
// Gradients: loss = mean((relu(x @ w1) @ w2 - t)^2), against the host's analytic gradients.

constexpr int64_t kB = 8, kD = 32, kH = 64;

struct HostGrads {
  double loss = 0;
  std::vector<double> dw1, dw2;
};

HostGrads HostDotReluDotMse(const Tensor& x, const Tensor& w1, const Tensor& w2, const Tensor& t) {
  const float *X = x.data<float>(), *W1 = w1.data<float>(), *W2 = w2.data<float>(),
              *T = t.data<float>();
  std::vector<double> pre(kB * kH), h(kB * kH), dy(kB * kD), dh(kB * kH);
  for (int64_t i = 0; i < kB; ++i)
    for (int64_t j = 0; j < kH; ++j) {
      double s = 0;
      for (int64_t p = 0; p < kD; ++p) s += double{X[i * kD + p]} * W1[p * kH + j];
      pre[i * kH + j] = s;
      h[i * kH + j] = std::max(s, 0.0);
    }
  HostGrads g;
  const double n = kB * kD;
  for (int64_t i = 0; i < kB; ++i)
    for (int64_t j = 0; j < kD; ++j) {
      double y = 0;
      for (int64_t p = 0; p < kH; ++p) y += h[i * kH + p] * W2[p * kD + j];
      const double d = y - T[i * kD + j];
      g.loss += d * d / n;
      dy[i * kD + j] = 2 * d / n;
    }
  g.dw2.assign(kH * kD, 0);
  for (int64_t p = 0; p < kH; ++p)
    for (int64_t j = 0; j < kD; ++j)
      for (int64_t i = 0; i < kB; ++i) g.dw2[p * kD + j] += h[i * kH + p] * dy[i * kD + j];
  for (int64_t i = 0; i < kB; ++i)
    for (int64_t p = 0; p < kH; ++p) {
      double s = 0;
      for (int64_t j = 0; j < kD; ++j) s += dy[i * kD + j] * W2[p * kD + j];
      dh[i * kH + p] = pre[i * kH + p] > 0 ? s : 0;
    }
  g.dw1.assign(kD * kH, 0);
  for (int64_t q = 0; q < kD; ++q)
    for (int64_t p = 0; p < kH; ++p)
      for (int64_t i = 0; i < kB; ++i) g.dw1[q * kH + p] += double{X[i * kD + q]} * dh[i * kH + p];
  return g;
}

struct GradLayout {
  std::string name;
  PartitionSpec x, w1, w2;
  std::vector<std::string> expected;  // the collectives the partitioner must insert
};

std::vector<GradLayout> GradLayouts() {
  return {
      // Data parallel: each weight gradient is summed over 'data' (the psum of DP's pmean).
      {"data_parallel",
       P({"data", ""}),
       PartitionSpec(),
       PartitionSpec(),
       {"pmean(data)", "psum(data)", "psum(data)"}},
      // Tensor parallel: the forward psum over 'model', then each gradient's psum over 'data'.
      {"tensor_parallel",
       P({"data", ""}),
       P({"", "model"}),
       P({"model", ""}),
       {"psum(model)", "pmean(data)", "psum(data)", "psum(data)"}},
      // FSDP: weights all_gathered for use, gradients reduce-scattered into the weights' layout.
      {"fsdp",
       P({"data", ""}),
       P({"", "data"}),
       P({"data", ""}),
       {"all_gather(data)@1", "all_gather(data)@0", "all_gather(data)@0", "pmean(data)",
        "psum_scatter(data)@1", "psum_scatter(data)@0"}},
  };
}

JitBuilder GradProgram(const Mesh& mesh, const GradLayout& l) {
  JitBuilder jit(mesh);
  auto x = jit.Input(v1::DTYPE_F32, {kB, kD}, l.x);
  auto w1 = jit.Input(v1::DTYPE_F32, {kD, kH}, l.w1);
  auto w2 = jit.Input(v1::DTYPE_F32, {kH, kD}, l.w2);
  auto t = jit.Input(v1::DTYPE_F32, {kB, kD}, l.x);
  auto loss = nn::MseLoss(jit, jit.Dot(jit.Unary("relu", jit.Dot(x, w1)), w2), t);
  std::vector<JitBuilder::Value> g = jit.Grad(loss, {w1, w2});
  jit.Output(loss, PartitionSpec());
  jit.Output(jit.WithShardingConstraint(g[0], l.w1), l.w1);
  jit.Output(jit.WithShardingConstraint(g[1], l.w2), l.w2);
  return jit;
}

TEST(AutodiffTest, GradientCollectivesFollowFromTheLayouts) {
  const Mesh mesh = *Mesh::Parse("data=2,model=4");
  for (const GradLayout& l : GradLayouts()) {
    JitBuilder jit = GradProgram(mesh, l);
    ASSERT_TRUE(jit.Build().ok()) << l.name << ": " << jit.Build().status();
    EXPECT_EQ(Ops(jit.collectives()), l.expected) << l.name;
  }
}

TEST(AutodiffTest, RejectsNonScalarLossesAndNonDifferentiableOps) {
  JitBuilder jit(*Mesh::Parse("data=2,model=4"));
  auto x = jit.Input(v1::DTYPE_F32, {8, 4}, PartitionSpec());
  jit.Grad(x, {x});
  EXPECT_THAT(std::string(jit.Build().status().message()), ::testing::HasSubstr("f32 scalar"));
  JitBuilder jit2(*Mesh::Parse("data=2,model=4"));
  auto y = jit2.Input(v1::DTYPE_F32, {8, 4}, PartitionSpec());
  jit2.Grad(jit2.Reduce("max", y, {0, 1}), {y});
  jit2.Output(y, PartitionSpec());
  EXPECT_THAT(std::string(jit2.Build().status().message()), ::testing::HasSubstr("reduce max"));
}

class AutodiffE2ETest : public testing::ClusterSuite<AutodiffE2ETest> {
 public:
  static constexpr const char* kMesh = "data=2,model=4";
  static constexpr const char* kTag = "autodiff";
};

TEST_F(AutodiffE2ETest, GradientsEqualTheHostsUnderEveryLayout) {
  const Tensor x = testing::NormalTensor({kB, kD}, 10);
  const Tensor w1 = testing::NormalTensor({kD, kH}, 11);
  const Tensor w2 = testing::NormalTensor({kH, kD}, 12);
  const Tensor t = testing::NormalTensor({kB, kD}, 13);
  const HostGrads want = HostDotReluDotMse(x, w1, w2, t);
  for (const GradLayout& l : GradLayouts()) {
    std::vector<Tensor> got =
        testing::RunShardMapAll(*client_, GradProgram(*mesh_, l).Build(), {&x, &w1, &w2, &t});
    ASSERT_EQ(got.size(), 3u) << l.name;
    EXPECT_NEAR(got[0].data<float>()[0], want.loss, 1e-4 * want.loss) << l.name;
    for (int64_t i = 0; i < kD * kH; ++i)
      ASSERT_NEAR(got[1].data<float>()[i], want.dw1[i], 1e-4 * (1 + std::abs(want.dw1[i])))
          << l.name << " dw1 " << i;
    for (int64_t i = 0; i < kH * kD; ++i)
      ASSERT_NEAR(got[2].data<float>()[i], want.dw2[i], 1e-4 * (1 + std::abs(want.dw2[i])))
          << l.name << " dw2 " << i;
  }
}

// The fused softmax cross-entropy with integer labels: the mean loss and its gradient equal the
// host's logsumexp(z) - z[label] and (softmax(z) - one_hot) / b, with the batch over 'data' and
// the class dim sharded over 'model' (gathered whole for the fused op) or replicated; a label out
// of range fails the step naming it, and the cluster serves the next one.
TEST_F(AutodiffE2ETest, SoftmaxCrossEntropyAndItsGradientEqualTheHosts) {
  constexpr int64_t kRows = 6, kClasses = 12;
  const Tensor z = testing::NormalTensor({kRows, kClasses}, 21);
  Tensor labels(v1::DTYPE_I32, {kRows});
  for (int64_t r = 0; r < kRows; ++r) labels.data<int32_t>()[r] = static_cast<int32_t>(r * 5 % 12);
  double want_loss = 0;
  std::vector<double> want_grad(kRows * kClasses);
  for (int64_t r = 0; r < kRows; ++r) {
    double m = -1e30, sum = 0;
    for (int64_t c = 0; c < kClasses; ++c)
      m = std::max<double>(m, z.data<float>()[r * kClasses + c]);
    for (int64_t c = 0; c < kClasses; ++c) sum += std::exp(z.data<float>()[r * kClasses + c] - m);
    const int32_t y = labels.data<int32_t>()[r];
    want_loss += (std::log(sum) + m - z.data<float>()[r * kClasses + y]) / kRows;
    for (int64_t c = 0; c < kClasses; ++c) {
      want_grad[r * kClasses + c] =
          (std::exp(z.data<float>()[r * kClasses + c] - m) / sum - (c == y ? 1 : 0)) / kRows;
    }
  }
  for (const PartitionSpec& spec : {P({"data", "model"}), P({"data", ""}), PartitionSpec()}) {
    JitBuilder jit(*mesh_);
    auto logits = jit.Input(v1::DTYPE_F32, {kRows, kClasses}, spec);
    auto y = jit.Input(v1::DTYPE_I32, {kRows}, PartitionSpec(spec.Padded(1)));
    auto loss = jit.Reduce("mean", jit.SoftmaxCrossEntropyWithIntegerLabels(logits, y), {0});
    auto g = jit.Grad(loss, {logits});
    jit.Output(loss, PartitionSpec());
    jit.Output(jit.WithShardingConstraint(g[0], spec), spec);
    std::vector<Tensor> got = testing::RunShardMapAll(*client_, jit.Build(), {&z, &labels});
    ASSERT_EQ(got.size(), 2u) << spec.ToString();
    EXPECT_NEAR(got[0].data<float>()[0], want_loss, 1e-5 * want_loss) << spec.ToString();
    for (int64_t i = 0; i < kRows * kClasses; ++i)
      ASSERT_NEAR(got[1].data<float>()[i], want_grad[i], 1e-6) << spec.ToString() << " " << i;
  }
  JitBuilder jit(*mesh_);
  auto logits = jit.Input(v1::DTYPE_F32, {kRows, kClasses}, P({"data", ""}));
  auto y = jit.Input(v1::DTYPE_I32, {kRows}, P({"data"}));
  jit.Output(jit.SoftmaxCrossEntropyWithIntegerLabels(logits, y), P({"data"}));
  Tensor bad = labels;
  bad.data<int32_t>()[4] = 12;
  absl::StatusOr<v1::ShardMapProgram> program = jit.Build();
  ASSERT_TRUE(program.ok()) << program.status();
  std::vector<std::string> ids;
  for (const Tensor* t : std::vector<const Tensor*>{&z, &bad}) {
    absl::StatusOr<v1::ArrayInfo> a = client_->Put(*t, t == &z ? P({"data", ""}) : P({"data"}));
    ASSERT_TRUE(a.ok()) << a.status();
    ids.push_back(a->id());
  }
  auto r = client_->ShardMap(*program, ids);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_THAT(std::string(r.status().message()), ::testing::HasSubstr("label 12 of row"));
  for (const std::string& id : ids) client_->Delete(id).IgnoreError();
  EXPECT_EQ(testing::RunShardMapAll(*client_, program, {&z, &labels}).size(), 1u);
}

// jax.lax.select_n as JitBuilder::Select: takes either operand exactly (a -inf not taken does not
// poison the result, as an arithmetic blend would), follows the sharded operand's layout, and its
// gradient flows to the operand each element took: d/dx sum(where(x > 0, x * x, c * x)) is 2x
// where x > 0 and c = 3 elsewhere, and d/dc is the sum of the x not above 0.
TEST_F(AutodiffE2ETest, SelectTakesOneOperandAndRoutesItsGradient) {
  constexpr int64_t kRows = 8, kCols = 12;
  const Tensor xt = testing::NormalTensor({kRows, kCols}, 31);
  JitBuilder jit(*mesh_);
  auto x = jit.Input(v1::DTYPE_F32, {kRows, kCols}, P({"data", "model"}));
  auto c = jit.Input(v1::DTYPE_F32, {}, PartitionSpec());
  auto pos = jit.Binary("gt", x, jit.Constant(0.0f, {}));
  auto masked = jit.Select(pos, jit.Constant(-std::numeric_limits<float>::infinity(), {}), x);
  EXPECT_EQ(jit.sharding(masked), P({"data", "model"}));
  auto y = jit.Select(pos, jit.Mul(c, x), jit.Mul(x, x));
  auto loss = jit.Reduce("sum", y, {0, 1});
  std::vector<JitBuilder::Value> g = jit.Grad(loss, {x, c});
  jit.Output(masked, PartitionSpec());
  jit.Output(jit.WithShardingConstraint(g[0], PartitionSpec()), PartitionSpec());
  jit.Output(g[1], PartitionSpec());
  Tensor ct(v1::DTYPE_F32, {});
  ct.data<float>()[0] = 3.0f;
  std::vector<Tensor> got = testing::RunShardMapAll(*client_, jit.Build(), {&xt, &ct});
  ASSERT_EQ(got.size(), 3u);
  double dc = 0;
  for (int64_t i = 0; i < kRows * kCols; ++i) {
    const float v = xt.data<float>()[i];
    if (v > 0) {
      EXPECT_EQ(got[0].data<float>()[i], v) << i;
      EXPECT_NEAR(got[1].data<float>()[i], 2 * v, 1e-6) << i;
    } else {
      EXPECT_TRUE(std::isinf(got[0].data<float>()[i])) << i;
      EXPECT_EQ(got[1].data<float>()[i], 3.0f) << i;
      dc += v;
    }
  }
  EXPECT_NEAR(got[2].data<float>()[0], dc, 1e-4);
}

// jnp.concatenate as JitBuilder::Concatenate, with a sharded operand resharded for it, and its
// gradient (each operand's slice of the cotangent): d/da sum(concat(a, 3b)^2) = 2a, d/db = 18b.
TEST_F(AutodiffE2ETest, ConcatenateAndItsGradientEqualTheHosts) {
  const Tensor at = testing::NormalTensor({8, 4}, 41), bt = testing::NormalTensor({8, 8}, 42);
  JitBuilder jit(*mesh_);
  auto a = jit.Input(v1::DTYPE_F32, {8, 4}, P({"data", "model"}));
  auto b = jit.Input(v1::DTYPE_F32, {8, 8}, P({"", "model"}));
  auto c = jit.Concatenate({a, jit.Scale(b, 3.0f)}, 1);
  EXPECT_EQ(jit.sharding(c), P({"data"}));
  auto loss = jit.Reduce("sum", jit.Mul(c, c), {0, 1});
  std::vector<JitBuilder::Value> g = jit.Grad(loss, {a, b});
  jit.Output(c, PartitionSpec());
  jit.Output(jit.WithShardingConstraint(g[0], PartitionSpec()), PartitionSpec());
  jit.Output(jit.WithShardingConstraint(g[1], PartitionSpec()), PartitionSpec());
  std::vector<Tensor> got = testing::RunShardMapAll(*client_, jit.Build(), {&at, &bt});
  ASSERT_EQ(got.size(), 3u);
  for (int r = 0; r < 8; ++r) {
    for (int k = 0; k < 12; ++k) {
      const float want = k < 4 ? at.data<float>()[r * 4 + k] : 3 * bt.data<float>()[r * 8 + k - 4];
      EXPECT_EQ(got[0].data<float>()[r * 12 + k], want) << r << "," << k;
    }
    for (int k = 0; k < 4; ++k)
      EXPECT_NEAR(got[1].data<float>()[r * 4 + k], 2 * at.data<float>()[r * 4 + k], 1e-5);
    for (int k = 0; k < 8; ++k)
      EXPECT_NEAR(got[2].data<float>()[r * 8 + k], 18 * bt.data<float>()[r * 8 + k], 1e-4);
  }
}

// flax's Dropout inside a sharded program: each 'data' shard draws its mask from
// fold_in(key, axis_index('data')) (the seed's fold_rng_over_axis), the 'model' replicas agree,
// and the gradient is the mask.
TEST_F(AutodiffE2ETest, DropoutFoldsTheKeyOverTheDataAxis) {
  constexpr int64_t kRows = 4, kCols = 1000;
  JitBuilder jit(*mesh_);
  auto x = jit.Input(v1::DTYPE_F32, {kRows, kCols}, P({"data", ""}));
  auto key = jit.Input(v1::DTYPE_U32, {2}, PartitionSpec());
  auto y = jit.Dropout(x, key, 0.25f, {"data"});
  auto g = jit.Grad(jit.Reduce("sum", y, {0, 1}), {x});
  jit.Output(y, P({"data", ""}));
  jit.Output(g[0], P({"data", ""}));
  Tensor ones(v1::DTYPE_F32, {kRows, kCols});
  for (int64_t i = 0; i < ones.num_elements(); ++i) ones.data<float>()[i] = 1.0f;
  Tensor k(v1::DTYPE_U32, {2});
  k.data<uint32_t>()[0] = 0;
  k.data<uint32_t>()[1] = 42;  // PRNGKey(42)
  std::vector<Tensor> got = testing::RunShardMapAll(*client_, jit.Build(), {&ones, &k});
  ASSERT_EQ(got.size(), 2u);
  int64_t dropped = 0;
  for (int shard = 0; shard < 2; ++shard) {
    const std::vector<uint32_t> bits =
        RandomBits(FoldIn(MakePRNGKey(42), shard), kRows / 2 * kCols);
    for (int64_t i = 0; i < kRows / 2 * kCols; ++i) {
      const float want = BitsToUnitFloat(bits[i]) < 0.75f ? 1.0f / 0.75f : 0.0f;
      const int64_t at = shard * kRows / 2 * kCols + i;
      ASSERT_EQ(got[0].data<float>()[at], want) << "shard " << shard << " element " << i;
      ASSERT_EQ(got[1].data<float>()[at], want) << "gradient, shard " << shard << " element " << i;
      dropped += want == 0.0f;
    }
  }
  EXPECT_NEAR(static_cast<double>(dropped) / (kRows * kCols), 0.25, 0.03);
  // The two data shards' masks differ.
  EXPECT_NE(std::memcmp(got[0].data<float>(), got[0].data<float>() + kRows / 2 * kCols,
                        kRows / 2 * kCols * 4),
            0);
}

// ---------------------------------------------------------------------------------------------
// Planning a train step (the seeds' workloads under every layout, against one worker, are in
// seed_workloads_test.cc).

nn::ShardingConfig Sharding(const std::string& rules, const std::string& fsdp_axis,
                            int64_t min_weight_size = int64_t{1} << 18) {
  nn::ShardingConfig s;
  s.rules = *ParseLogicalAxisRules(rules);
  s.fsdp_axis = fsdp_axis;
  s.min_weight_size = min_weight_size;
  return s;
}

TEST(TrainStepPlanTest, RejectsBadAnnotationsBeforeAllocating) {
  const Mesh mesh = *Mesh::Parse("data=2,model=4");
  const LossFn loss = [](nn::Scope& s, const std::vector<nn::Value>& b) {
    return s.jit().Reduce("sum", nn::DotReluDot(s.Child("block"), b[0], 6), {0, 1});
  };
  const std::vector<BatchSpec> batch = {{"x", {8, 16}, {"batch", ""}}};
  // A rule naming a mesh axis that does not exist.
  auto a = BuildTrainStep(mesh, Sharding("batch=rows", ""), OptimizerConfig{}, batch, loss, 0);
  EXPECT_THAT(std::string(a.status().message()), ::testing::HasSubstr("rows"));
  // hidden (6) does not divide over model (4): names the parameter.
  auto b = BuildTrainStep(mesh, Sharding("hidden=model", ""), OptimizerConfig{}, batch, loss, 0);
  EXPECT_THAT(std::string(b.status().message()), ::testing::HasSubstr("params/block/W1"));
  // A batch that does not divide over data.
  auto c = BuildTrainStep(mesh, Sharding("batch=data", ""), OptimizerConfig{},
                          {{"x", {7, 16}, {"batch", ""}}}, loss, 0);
  EXPECT_THAT(std::string(c.status().message()), ::testing::HasSubstr("batch input x"));
  // A batch of 8 that divides over data (2) but whose 8 minibatches of 1 do not: the error says
  // the shape is a minibatch's.
  auto m = BuildTrainStep(mesh, Sharding("batch=data", ""), OptimizerConfig{},
                          {{"x", {1, 16}, {"batch", ""}}}, loss, 0, /*num_minibatches=*/8);
  EXPECT_THAT(std::string(m.status().message()), ::testing::HasSubstr("one of 8 minibatches"));
  // The plan of a good one lists every state array with its spec, and the step's collectives.
  auto d =
      BuildTrainStep(mesh, Sharding("batch=data", "data", 16), OptimizerConfig{}, batch, loss, 0);
  ASSERT_TRUE(d.ok()) << d.status();
  const std::string plan = d->Plan();
  EXPECT_THAT(plan, ::testing::HasSubstr("opt_state/mu/params/block/W1"));
  EXPECT_THAT(plan, ::testing::HasSubstr("psum_scatter"));
}

// An op of the step that fails is the error BuildTrainStep reports, even when a layer of a later
// minibatch then declares a parameter with an invalid value's empty shape: the cause, not the
// parameter whose shape no longer matches. Here the first minibatch's backward pass fails (a max
// has no gradient here), and the second minibatch's Dense sees an invalid input.
TEST(TrainStepPlanTest, ReportsTheFailingOpNotTheLaterParameterItInvalidates) {
  const Mesh mesh = *Mesh::Parse("data=2");
  const LossFn loss = [](nn::Scope& s, const std::vector<nn::Value>& b) {
    return s.jit().Reduce("max", nn::Dense(s.Child("dense"), b[0], 4), {0, 1});
  };
  auto step = BuildTrainStep(mesh, Sharding("batch=data", ""), OptimizerConfig{},
                             {{"x", {8, 16}, {"batch", ""}}}, loss, 0, /*num_minibatches=*/2);
  ASSERT_FALSE(step.ok());
  EXPECT_THAT(std::string(step.status().message()),
              ::testing::HasSubstr("grad: reduce max is not differentiable"));
}

// A gradient left as a per-device partial sum in its parameter's layout is all-reduced inside
// the Adam update (fused on the workers); one the parameter is sharded over (FSDP) is
// psum_scattered before it; SGD's gradients are reduced by the sharding constraint.
TEST(TrainStepPlanTest, ReplicatedParametersTakeTheirGradientPsumInsideTheAdamUpdate) {
  auto w = SeedWorkload("dot_relu_dot");
  ASSERT_TRUE(w.ok()) << w.status();
  const Mesh mesh = *Mesh::Parse("data=2,model=4");
  auto adam_ops = [](const TrainStep& step) {
    std::vector<const v1::Op*> ops;
    for (const v1::Op& op : step.step.program().functions(0).ops()) {
      if (op.kind() == v1::OP_ADAM_UPDATE) ops.push_back(&op);
    }
    return ops;
  };
  auto reasons = [](const TrainStep& step) {
    std::vector<std::string> r;
    for (const JitBuilder::Collective& c : step.collectives) {
      r.push_back(absl::StrCat(c.Short(), " for ", c.reason));
    }
    return r;
  };
  for (const std::string layout : {"2d", "dp"}) {
    auto step = BuildTrainStep(mesh, *LayoutSharding(layout), w->optimizer, w->batch, w->loss, 0);
    ASSERT_TRUE(step.ok()) << layout << ": " << step.status();
    ASSERT_EQ(adam_ops(*step).size(), 2u) << layout;
    for (const v1::Op* op : adam_ops(*step)) {
      EXPECT_THAT(op->axis_names(), ::testing::ElementsAre("data")) << layout;
      EXPECT_EQ(op->fn(), "sum") << layout;
    }
    const std::vector<std::string> r = reasons(*step);
    EXPECT_EQ(std::count(r.begin(), r.end(), "psum(data) for adam update (fused)"), 2)
        << absl::StrJoin(r, "; ");
    for (const v1::Op& op : step->step.program().functions(0).ops()) {
      if (op.kind() == v1::OP_PSUM && op.axis_names_size() == 1 && op.axis_names(0) == "data") {
        ADD_FAILURE() << layout << ": a separate psum over data remains: " << op.ShortDebugString();
      }
    }
  }
  auto fsdp = BuildTrainStep(mesh, *LayoutSharding("fsdp"), w->optimizer, w->batch, w->loss, 0);
  ASSERT_TRUE(fsdp.ok()) << fsdp.status();
  ASSERT_EQ(adam_ops(*fsdp).size(), 2u);
  for (const v1::Op* op : adam_ops(*fsdp)) EXPECT_EQ(op->axis_names_size(), 0);
  const std::vector<std::string> r = reasons(*fsdp);
  EXPECT_EQ(std::count(r.begin(), r.end(), "psum_scatter(data)@1 for adam update"), 2)
      << absl::StrJoin(r, "; ");
  OptimizerConfig sgd = w->optimizer;
  sgd.kind = OptimizerConfig::kSgd;
  auto plain = BuildTrainStep(mesh, *LayoutSharding("2d"), sgd, w->batch, w->loss, 0);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_TRUE(adam_ops(*plain).empty());
  const std::vector<std::string> rs = reasons(*plain);
  EXPECT_EQ(std::count_if(rs.begin(), rs.end(),
                          [](const std::string& x) {
                            return absl::StartsWith(x, "psum(data) for with_sharding_constraint");
                          }),
            2)
      << absl::StrJoin(rs, "; ");
}

}  // namespace
}  // namespace meshrun
