// The seeds' workloads (000's scan-stacked MLP, 003's DotReluDot with MSE, the seed classifier)
// as train steps derived by autodiff, on real clusters of worker processes: their first 20 losses
// under every layout agree with a single worker's, sharded initialisation draws the unsharded
// values, and bf16 compute (mixed precision) tracks the f32 run with f32 masters, as does a
// gradient all-reduced in bf16 (FSDP2's reduce_dtype).
#include <array>
#include <cmath>
#include <cstring>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "meshrun/client.h"
#include "meshrun/local_cluster.h"
#include "meshrun/train_step.h"
#include "meshrun/workloads.h"
#include "tests/testutil/cluster.h"

namespace meshrun {
namespace {

PartitionSpec P(std::vector<std::string> names) { return PartitionSpec::Of(std::move(names)); }

// Puts each host batch with its planned layout; returns the ids.
std::vector<std::string> PutBatch(Client& client, const TrainStep& step,
                                  const std::vector<const Tensor*>& batch) {
  std::vector<std::string> ids;
  for (size_t i = 0; i < batch.size(); ++i) {
    auto info = client.Put(*batch[i], step.batch[i].spec);
    EXPECT_TRUE(info.ok()) << info.status();
    if (info.ok()) ids.push_back(info->id());
  }
  return ids;
}

struct RunResult {
  std::vector<float> losses;
  std::map<std::string, Tensor> init;  // parameters right after initialisation
  int64_t state_bytes_per_worker = 0;  // as the cluster reports its arrays
};

// Initialises a TrainState, runs `steps` steps on one batch (the seeds train on one batch), and
// deletes everything it put on the cluster.
RunResult Train(Client& client, const TrainStep& step, const std::vector<const Tensor*>& batch,
                int steps) {
  RunResult r;
  auto state = TrainState::Init(&client, &step);
  EXPECT_TRUE(state.ok()) << state.status();
  if (!state.ok()) return r;
  for (const nn::ParamInfo& p : step.params) {
    auto t = state->Get(p.name);
    EXPECT_TRUE(t.ok()) << t.status();
    if (t.ok()) r.init[p.name] = *std::move(t);
  }
  auto arrays = client.ListArrays();
  EXPECT_TRUE(arrays.ok()) << arrays.status();
  for (const auto& a : *arrays) {
    if (absl::StartsWith(a.id(), "train_state/params/") ||
        absl::StartsWith(a.id(), "train_state/opt_state/"))
      r.state_bytes_per_worker += a.bytes_per_worker();
  }
  std::vector<std::string> ids = PutBatch(client, step, batch);
  for (int i = 0; i < steps && ids.size() == batch.size(); ++i) {
    auto loss = state->Step(ids);
    EXPECT_TRUE(loss.ok()) << "step " << i << ": " << loss.status();
    if (!loss.ok()) break;
    r.losses.push_back(*loss);
  }
  EXPECT_EQ(state->steps(), steps);
  EXPECT_TRUE(state->Delete().ok());
  for (const auto& id : ids) EXPECT_TRUE(client.Delete(id).ok());
  return r;
}

void ExpectAgree(const RunResult& got, const RunResult& want, const std::string& name) {
  ASSERT_EQ(got.losses.size(), want.losses.size()) << name;
  for (size_t i = 0; i < want.losses.size(); ++i) {
    EXPECT_LE(std::abs(got.losses[i] - want.losses[i]), 1e-4 * std::abs(want.losses[i]))
        << name << " step " << i << ": " << got.losses[i] << " vs one worker's " << want.losses[i];
  }
  // Sharded initialisation draws exactly the unsharded values.
  ASSERT_EQ(got.init.size(), want.init.size()) << name;
  for (const auto& [param, t] : want.init) {
    const Tensor& g = got.init.at(param);
    ASSERT_EQ(g.dims(), t.dims()) << name << " " << param;
    EXPECT_EQ(std::memcmp(g.raw(), t.raw(), t.size_bytes()), 0)
        << name << ": " << param << " initialised differently";
  }
}

class SeedWorkloadsE2ETest : public testing::MultiClusterSuite<SeedWorkloadsE2ETest> {
 public:
  static constexpr std::array<const char*, 3> kMeshes = {"data=1,model=1", "data=2,model=4",
                                                         "data=8"};
  static constexpr const char* kTag = "workloads";

 protected:
  // Runs `workload` 20 steps under `layout` on the cluster for `mesh`.
  static RunResult Run(const std::string& workload, const std::string& layout,
                       const std::string& mesh, TrainStep* built = nullptr,
                       DType dtype = v1::DTYPE_F32, DType reduce_dtype = v1::DTYPE_F32) {
    auto w = SeedWorkload(workload, {dtype});
    EXPECT_TRUE(w.ok()) << w.status();
    if (w.ok()) w->optimizer.reduce_dtype = reduce_dtype;
    auto sharding = LayoutSharding(layout);
    EXPECT_TRUE(sharding.ok()) << sharding.status();
    if (!w.ok() || !sharding.ok()) return {};
    auto step = BuildTrainStep(*Mesh::Parse(mesh), *sharding, w->optimizer, w->batch, w->loss, 0,
                               w->num_minibatches);
    EXPECT_TRUE(step.ok()) << workload << " " << layout << ": " << step.status();
    auto batch = SeedWorkloadBatch(*w);
    EXPECT_TRUE(batch.ok()) << batch.status();
    if (!step.ok() || !batch.ok()) return {};
    if (built != nullptr) *built = *step;
    std::vector<const Tensor*> inputs;
    for (const Tensor& t : *batch) inputs.push_back(&t);
    return Train(client(mesh), *step, inputs, 20);
  }
};

constexpr const char* kOne = "data=1,model=1";
constexpr const char* kTwoByFour = "data=2,model=4";

// Workload 1: seed 000's MLP under every 2x4 layout of seeds 000 and 002 (only the rules differ).
TEST_F(SeedWorkloadsE2ETest, Seed000ScanMlpLossesAgreeAcrossLayouts) {
  const RunResult want = Run("mlp", "single", kOne);
  ASSERT_EQ(want.losses.size(), 20u);
  EXPECT_LT(want.losses.back(), want.losses.front());
  for (const std::string layout : {"dp", "fsdp", "tp", "2d", "fsdp_tp"}) {
    TrainStep step;
    ExpectAgree(Run("mlp", layout, kTwoByFour, &step), want, layout);
    if (layout == "2d") {
      // The seed's specs: W1 (None, None, 'model'), W2 (None, 'model', None); Adam's state alike.
      EXPECT_EQ(step.params[0].spec, P({"", "", "model"}));
      EXPECT_EQ(step.params[1].spec, P({"", "model", ""}));
      for (const PlannedArray& a : step.state) {
        if (a.name == "opt_state/mu/params/mlp/ScanDotReluDot_0/W1") {
          EXPECT_EQ(a.spec, P({"", "", "model"}));
        }
      }
    }
  }
}

// Workload 2: seed 003's DotReluDot with MSE, input and label laid out ('data', None).
TEST_F(SeedWorkloadsE2ETest, Seed003DotReluDotMseLossesAgreeAcrossLayouts) {
  const RunResult want = Run("dot_relu_dot", "single", kOne);
  ASSERT_EQ(want.losses.size(), 20u);
  // The seed's run over-fits quickly (1.455, 0.765, 0.510, ...): so does this one.
  EXPECT_LT(want.losses[4], 0.5 * want.losses[0]);
  for (const std::string layout : {"dp", "fsdp", "tp", "2d", "fsdp_tp"}) {
    ExpectAgree(Run("dot_relu_dot", layout, kTwoByFour), want, layout);
  }
}

// Over the gRPC ring only (as between hosts), the update cannot reach its replicas' memory: the
// fused all-reduce + Adam update all-reduces a copy of the gradient and every replica updates all
// of it; the losses still agree with one worker's.
TEST_F(SeedWorkloadsE2ETest, Seed003UnderTwoDOverTheGrpcRingAgreesWithOneWorker) {
  const RunResult want = Run("dot_relu_dot", "single", kOne);
  auto cluster = testing::StartCluster(kTwoByFour, "workloads_grpc", /*shm_transport=*/false);
  ASSERT_NE(cluster, nullptr);
  auto c = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(c.ok()) << c.status();
  auto w = SeedWorkload("dot_relu_dot");
  ASSERT_TRUE(w.ok()) << w.status();
  auto step = BuildTrainStep(*Mesh::Parse(kTwoByFour), *LayoutSharding("2d"), w->optimizer,
                             w->batch, w->loss, 0);
  ASSERT_TRUE(step.ok()) << step.status();
  auto batch = SeedWorkloadBatch(*w);
  ASSERT_TRUE(batch.ok()) << batch.status();
  std::vector<const Tensor*> inputs;
  for (const Tensor& t : *batch) inputs.push_back(&t);
  ExpectAgree(Train(**c, *step, inputs, 20), want, "2d over the gRPC ring");
}

// TrainState::Steps (Keras's steps_per_execution): several steps in one call, each over its own
// batch, give the losses of the same steps called one at a time, bit for bit; bad calls are
// refused before anything runs.
TEST_F(SeedWorkloadsE2ETest, StepsInOneCallEqualStepsCalledOneAtATime) {
  auto w = SeedWorkload("dot_relu_dot");
  ASSERT_TRUE(w.ok()) << w.status();
  auto step = BuildTrainStep(*Mesh::Parse(kTwoByFour), *LayoutSharding("2d"), w->optimizer,
                             w->batch, w->loss, 0);
  ASSERT_TRUE(step.ok()) << step.status();
  auto batch = SeedWorkloadBatch(*w);
  ASSERT_TRUE(batch.ok()) << batch.status();
  Tensor other = (*batch)[0];  // a second batch: the input halved
  for (int64_t i = 0; i < other.num_elements(); ++i) other.data<float>()[i] *= 0.5f;
  Client& c = client(kTwoByFour);
  const std::vector<std::string> a = PutBatch(c, *step, {&(*batch)[0], &(*batch)[1]});
  const std::vector<std::string> b = PutBatch(c, *step, {&other, &(*batch)[1]});
  ASSERT_EQ(a.size(), 2u);
  ASSERT_EQ(b.size(), 2u);
  const std::vector<std::vector<std::string>> order = {a, b, a, b, a, b};

  std::vector<float> one_at_a_time;
  {
    auto state = TrainState::Init(&c, &*step, "one");
    ASSERT_TRUE(state.ok()) << state.status();
    for (const auto& ids : order) {
      auto loss = state->Step(ids);
      ASSERT_TRUE(loss.ok()) << loss.status();
      one_at_a_time.push_back(*loss);
    }
    ASSERT_TRUE(state->Delete().ok());
  }
  auto state = TrainState::Init(&c, &*step, "many");
  ASSERT_TRUE(state.ok()) << state.status();
  auto first = state->Steps({order.begin(), order.begin() + 3});
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = state->Steps({order.begin() + 3, order.end()});
  ASSERT_TRUE(second.ok()) << second.status();
  std::vector<float> in_calls = *first;
  in_calls.insert(in_calls.end(), second->begin(), second->end());
  EXPECT_EQ(in_calls, one_at_a_time);
  EXPECT_NE(one_at_a_time[0], one_at_a_time[1]) << "the batches differ, so do their losses";
  EXPECT_EQ(state->steps(), 6);

  // A batch of the wrong arity names its step; a kept result that takes no donated argument's id
  // would be overwritten by the next run; a donated argument must be the same array in every run.
  auto bad = state->Steps({a, {a[0]}});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), ::testing::HasSubstr("for step 1"));
  std::vector<std::string> inputs, fresh, same;
  std::vector<int> donate;
  for (const PlannedArray& s : step->state) {
    donate.push_back(static_cast<int>(inputs.size()));
    inputs.push_back(state->Id(s.name));
    fresh.push_back(absl::StrCat("fresh/", s.name));
  }
  fresh.push_back("");
  inputs.insert(inputs.end(), a.begin(), a.end());
  const int loss_index = static_cast<int>(fresh.size()) - 1;
  auto overwritten =
      c.Jit(step->step_global, inputs, fresh, absl::Seconds(30), {}, {loss_index}, {inputs});
  EXPECT_EQ(overwritten.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(overwritten.status().message(),
              ::testing::HasSubstr("would be overwritten by the next run"));
  std::vector<std::string> swapped = inputs;
  swapped[0] = inputs[1];
  std::vector<std::string> outputs(inputs.begin(), inputs.begin() + step->state.size());
  outputs.push_back("");
  auto not_carried =
      c.Jit(step->step_global, inputs, outputs, absl::Seconds(30), donate, {loss_index}, {swapped});
  EXPECT_EQ(not_carried.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(not_carried.status().message(), ::testing::HasSubstr("run 1: donated argument 0"));
  auto after = state->Steps({a});
  ASSERT_TRUE(after.ok()) << "refused calls leave the TrainState as it was: " << after.status();
  EXPECT_TRUE(state->Delete().ok());
  for (const auto& id : a) EXPECT_TRUE(c.Delete(id).ok());
  for (const auto& id : b) EXPECT_TRUE(c.Delete(id).ok());
}

// Workload 3: the seed classifier on real Fashion-MNIST images, 8-way data parallel and FSDP
// against one worker, and FSDP's resident state against DP's.
TEST_F(SeedWorkloadsE2ETest, SeedClassifierUnderDataParallelAndFsdp) {
  const RunResult want = Run("classifier", "single", kOne);
  ASSERT_EQ(want.losses.size(), 20u);
  EXPECT_LT(want.losses.back(), 0.5 * want.losses.front());
  const RunResult dp = Run("classifier", "dp", "data=8");
  const RunResult fsdp = Run("classifier", "fsdp", "data=8");
  ExpectAgree(dp, want, "dp");
  ExpectAgree(fsdp, want, "fsdp");
  // ZeRO-3: FSDP's resident params + Adam state per worker <= DP's / 8 + 10%.
  EXPECT_GT(dp.state_bytes_per_worker, 0);
  EXPECT_LE(fsdp.state_bytes_per_worker, dp.state_bytes_per_worker / 8 * 1.1)
      << "FSDP " << fsdp.state_bytes_per_worker << " bytes/worker vs DP "
      << dp.state_bytes_per_worker;
}

// Mixed precision (flax's dtype=bf16, param_dtype=f32): seeds 000 and 003 under 2d on 2x4, and the
// seed classifier on one worker, with bf16 compute. Every GEMM of the step takes bf16 operands,
// every state array (the parameters and Adam's moments) stays f32 on the cluster, and the first 20
// losses track the f32 run's within bf16 rounding (2e-2 relative) without equalling them. One
// exception: the MLP's first loss, y.sum() over 8192 outputs of both signs, cancels to under 1% of
// sum(|y|), so rounding each output to bf16 moves it by a few percent (PyTorch's bf16 emulation of
// the same model moves it by 0.1-3.2% on three draws); 5e-2 there.
TEST_F(SeedWorkloadsE2ETest, Bf16ComputeTracksTheF32RunWithF32Masters) {
  for (const std::string workload : {"mlp", "dot_relu_dot", "classifier"}) {
    // The classifier (no dropout: SiLU's bf16 output is the second Dense's input as it is) on one
    // worker.
    const bool classifier = workload == "classifier";
    const std::string layout = classifier ? "single" : "2d", mesh = classifier ? kOne : kTwoByFour;
    TrainStep f32_step, step;
    const RunResult f32 = Run(workload, layout, mesh, &f32_step);
    const RunResult bf16 = Run(workload, layout, mesh, &step, v1::DTYPE_BF16);
    // Every block's relu runs as its GEMM's post-op, in f32 and in bf16 (SimplifyProgram).
    for (const TrainStep* s : {&f32_step, &step}) {
      int relus = 0, fused = 0;
      for (const v1::Op& op : s->step.program().functions(0).ops()) {
        relus += op.kind() == v1::OP_UNARY && op.fn() == "relu";
        fused += op.kind() == v1::OP_MATMUL && op.fn() == "relu";
      }
      EXPECT_EQ(relus, 0) << workload;
      EXPECT_EQ(fused, workload == "mlp" ? 4 : classifier ? 0 : 1) << workload;
    }
    ASSERT_EQ(f32.losses.size(), 20u) << workload;
    ASSERT_EQ(bf16.losses.size(), 20u) << workload;
    for (const PlannedArray& a : step.state) {
      EXPECT_EQ(a.dtype, a.name == "rng" ? v1::DTYPE_U32 : v1::DTYPE_F32)
          << workload << " " << a.name;
    }
    for (const auto& [name, t] : bf16.init) EXPECT_EQ(t.dtype(), v1::DTYPE_F32) << name;
    std::map<std::string, DType> dtypes;
    for (const v1::BufferDecl& b : step.step.program().buffers()) dtypes[b.name()] = b.dtype();
    int gemms = 0;
    for (const v1::Op& op : step.step.program().functions(0).ops()) {
      if (op.kind() != v1::OP_MATMUL) continue;
      ++gemms;
      EXPECT_EQ(dtypes[op.inputs(0)], v1::DTYPE_BF16) << workload << ": " << op.ShortDebugString();
      EXPECT_EQ(dtypes[op.inputs(1)], v1::DTYPE_BF16) << workload << ": " << op.ShortDebugString();
    }
    // Forward, and both gradients of each GEMM but the input's (mlp: 4 blocks of 2 GEMMs; the
    // classifier: 2 Dense layers per minibatch, 2 minibatches).
    EXPECT_GE(gemms, workload == "mlp" ? 23 : classifier ? 10 : 5) << workload;
    EXPECT_NE(bf16.losses, f32.losses) << workload << ": bf16 compute changed nothing";
    for (size_t k = 0; k < f32.losses.size(); ++k) {
      const double rel = workload == "mlp" && k == 0 ? 5e-2 : 2e-2;
      EXPECT_NEAR(bf16.losses[k], f32.losses[k], rel * std::abs(f32.losses[k]))
          << workload << " step " << k + 1;
    }
    EXPECT_LT(bf16.losses.back(), bf16.losses.front()) << workload;
  }
}

// FSDP2's reduce_dtype bf16: each gradient is all-reduced in bf16 inside its Adam update (2d on
// 2x4; dp on 8 workers) or reduce-scattered in bf16 before it (fsdp's sharded parameters, on 8
// workers), at half the bytes of the f32 reduction, and the losses track the f32 run's within
// 2e-2 relative without equalling them; SGD, which has no update to reduce in, refuses it.
TEST_F(SeedWorkloadsE2ETest, GradientsReducedInBf16TrackTheF32Reduction) {
  const struct {
    const char* workload;
    const char* layout;
    const char* mesh;
  } cases[] = {{"dot_relu_dot", "2d", kTwoByFour},
               {"classifier", "dp", "data=8"},
               {"classifier", "fsdp", "data=8"}};
  for (const auto& c : cases) {
    const std::string what = absl::StrCat(c.workload, " ", c.layout);
    TrainStep f32_step, step;
    const RunResult f32 = Run(c.workload, c.layout, c.mesh, &f32_step);
    const RunResult bf16 = Run(c.workload, c.layout, c.mesh, &step, v1::DTYPE_F32, v1::DTYPE_BF16);
    std::map<std::string, DType> dtypes;
    for (const v1::BufferDecl& b : step.step.program().buffers()) dtypes[b.name()] = b.dtype();
    int fused = 0, scattered = 0;
    for (const v1::Op& op : step.step.program().functions(0).ops()) {
      if (op.kind() == v1::OP_ADAM_UPDATE && op.axis_names_size() > 0) {
        ++fused;
        EXPECT_EQ(op.adamw().reduce_dtype(), v1::DTYPE_BF16) << what;
      }
      if (op.kind() == v1::OP_PSUM_SCATTER) {
        ++scattered;
        EXPECT_EQ(dtypes[op.inputs(0)], v1::DTYPE_BF16) << what << ": " << op.ShortDebugString();
      }
    }
    // (FSDP shards the parameters past min_weight_size; the small ones stay replicated.)
    EXPECT_GT(fused, 0) << what;
    EXPECT_EQ(scattered > 0, std::string(c.layout) == "fsdp") << what;
    int64_t bytes = 0, f32_bytes = 0;
    for (const JitBuilder::Collective& k : step.collectives)  // the gradients' reductions
      if (absl::StrContains(k.reason, "adam update")) bytes += k.bytes_per_device;
    for (const JitBuilder::Collective& k : f32_step.collectives)
      if (absl::StrContains(k.reason, "adam update")) f32_bytes += k.bytes_per_device;
    EXPECT_LT(bytes, f32_bytes * 0.6) << what << ": " << bytes << " vs " << f32_bytes;
    ASSERT_EQ(f32.losses.size(), 20u) << what;
    ASSERT_EQ(bf16.losses.size(), 20u) << what;
    EXPECT_NE(bf16.losses, f32.losses) << what << ": the bf16 reduction changed nothing";
    for (size_t k = 0; k < f32.losses.size(); ++k) {
      EXPECT_NEAR(bf16.losses[k], f32.losses[k], 2e-2 * std::abs(f32.losses[k]))
          << what << " step " << k + 1;
    }
    EXPECT_LT(bf16.losses.back(), bf16.losses.front()) << what;
  }
  auto w = SeedWorkload("classifier");
  ASSERT_TRUE(w.ok()) << w.status();
  w->optimizer.kind = OptimizerConfig::kSgd;
  w->optimizer.reduce_dtype = v1::DTYPE_BF16;
  auto sgd = BuildTrainStep(*Mesh::Parse("data=8"), *LayoutSharding("dp"), w->optimizer, w->batch,
                            w->loss, 0);
  ASSERT_FALSE(sgd.ok());
  EXPECT_THAT(std::string(sgd.status().message()),
              ::testing::HasSubstr("reduce dtype bf16 with optimizer sgd"));
}

}  // namespace
}  // namespace meshrun
