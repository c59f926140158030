// One train pipeline on real clusters: every job is a derived train step fed by the workers'
// sharded input pipelines. A dataset written by numpy trains a seed workload while each worker
// reads only its block; the main job's losses are the same on 1, 2, 4 and 8 workers under DP and
// FSDP (the same global batches); bad data fails clearly and leaves nothing behind.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "meshrun/client.h"
#include "meshrun/job.h"
#include "tests/testutil/cluster.h"
#include "tests/testutil/process_util.h"

namespace meshrun {
namespace {

namespace fs = std::filesystem;
using ::meshrun::testing::HttpGet;
using ::meshrun::testing::RunCommand;
using ::testing::HasSubstr;
using ::testing::Not;

// Runs a numpy script with the test environment's Python (scripts/python-env.sh makes it).
void Numpy(const std::string& script) {
  const std::string path = ::testing::TempDir() + "/write_dataset.py";
  FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs(script.c_str(), f);
  std::fclose(f);
  auto r = RunCommand({MESHRUN_VENV_PYTHON, path}, 120);
  ASSERT_EQ(r.exit_code, 0) << MESHRUN_VENV_PYTHON << ": " << r.output;
}

// A synthetic regression problem for seed 003's DotReluDot: label = tanh(input @ w).
std::string WriteRegression(const std::string& name, int n) {
  const std::string dir = ::testing::TempDir() + "/" + name;
  fs::remove_all(dir);
  Numpy(absl::StrCat(R"(
import numpy as np, os
os.makedirs(")",
                     dir, R"(", exist_ok=True)
rng = np.random.default_rng(0)
x = rng.normal(size=()",
                     n, R"(, 1024)).astype(np.float32)
w = (rng.normal(size=(1024, 1024)) / 32).astype(np.float32)
np.save(")",
                     dir, R"(/input.npy", x)
np.save(")",
                     dir, R"(/label.npy", np.tanh(x @ w).astype(np.float32))
)"));
  return dir;
}

// Seed 003's DotReluDot under DP on an .npy dataset at `path`.
JobConfig NpyJob(const std::string& path, int64_t steps) {
  JobConfig config;
  config.model.name = "dot_relu_dot";
  config.sharding.layout = "dp";
  config.data.dataset = "npy";
  config.data.path = path;
  config.train.max_steps = steps;
  return config;
}

std::vector<double> Losses(const TrainResult& r) {
  std::vector<double> out;
  for (const v1::StepReport& rep : r.reports) out.push_back(rep.loss());
  return out;
}

TEST(InputPipelineE2ETest, ANumpyDatasetTrainsAWorkloadAndEachWorkerReadsOnlyItsBlock) {
  const std::string dir = WriteRegression("regression", 512);
  auto cluster = testing::StartCluster("data=4", "npy");
  ASSERT_NE(cluster, nullptr);
  auto client = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(client.ok());
  JobConfig config = NpyJob(dir, 80);  // 512 examples in batches of 8: into the second epoch
  config.train.log_every = 1;
  absl::StatusOr<TrainResult> r = (*client)->Train(config);
  ASSERT_TRUE(r.ok()) << r.status();
  const std::vector<double> loss = Losses(*r);
  ASSERT_EQ(loss.size(), 80u);
  double first = 0, last = 0;
  for (int k = 0; k < 10; ++k) {
    first += loss[k];
    last += loss[loss.size() - 1 - k];
  }
  EXPECT_LT(last, 0.7 * first) << "the loss falls";
  // A regression loss has no accuracy: the reports carry none, and the progress line shows none.
  EXPECT_FALSE(r->reports.back().has_accuracy());
  EXPECT_THAT(FormatProgress(r->reports.back()), Not(HasSubstr("acc")));
  // Each worker read 80 steps x its 2 of the 8 rows x (1024 + 1024) f32: its block, not the batch.
  auto st = (*client)->GetStatus();
  ASSERT_TRUE(st.ok());
  for (const auto& w : st->workers()) {
    EXPECT_THAT(HttpGet(w.peer().metrics_address(), "/metrics"),
                HasSubstr("meshrun_worker_input_bytes_total 1310720"));
  }
  auto arrays = (*client)->ListArrays();
  ASSERT_TRUE(arrays.ok());
  EXPECT_TRUE(arrays->empty()) << "the job's state and batch are released";
  ASSERT_TRUE(cluster->Stop().ok());
}

// The main job's first 50 losses with dropout off (the same function on every layout).
std::vector<double> MainJobLosses(const std::string& mesh, const std::string& layout) {
  auto cluster = testing::StartCluster(mesh, "losses");
  EXPECT_NE(cluster, nullptr);
  if (cluster == nullptr) return {};
  auto client = Client::Connect(cluster->coordinator_address());
  EXPECT_TRUE(client.ok());
  JobConfig config;
  config.model.dropout_rate = 0;
  config.sharding.layout = layout;
  config.train.max_steps = 50;
  config.train.log_every = 1;
  config.train.evaluate = false;
  absl::StatusOr<TrainResult> r = (*client)->Train(config);
  EXPECT_TRUE(r.ok()) << mesh << " " << layout << ": " << r.status();
  EXPECT_TRUE(cluster->Stop().ok());
  return r.ok() ? Losses(*r) : std::vector<double>{};
}

TEST(InputPipelineE2ETest, TheMainJobsLossesAgreeOnOneToEightWorkersUnderDpAndFsdp) {
  const std::vector<double> one = MainJobLosses("data=1", "dp");
  ASSERT_EQ(one.size(), 50u);
  for (const char* layout : {"dp", "fsdp"}) {
    for (const char* mesh : {"data=2", "data=4", "data=8"}) {
      const std::vector<double> many = MainJobLosses(mesh, layout);
      ASSERT_EQ(many.size(), 50u) << mesh << " " << layout;
      for (size_t k = 0; k < one.size(); ++k) {
        EXPECT_NEAR(many[k], one[k], 1e-5 * std::abs(one[k]))
            << mesh << " " << layout << " step " << k + 1;
      }
    }
  }
}

// Mixed precision (precision.compute bf16, Flax's Dense(dtype=bf16, param_dtype=f32)): the
// step's GEMMs take bf16 operands while every state array (params, opt_state) stays f32; one
// epoch reaches the main job's accuracy, and its losses track the f32 run's (the same batches,
// dropout masks and initial parameters) within bf16 rounding.
// "precision": {"reduce": "bf16"} reaches every Adam update that all-reduces its gradient in
// the main job's planned step (the reduction itself: fused_reduction_test.cc and the seeds'
// e2e test).
TEST(InputPipelineE2ETest, TheJobsReduceDtypeReachesItsAdamUpdates) {
  JobConfig config;
  config.precision.reduce = "bf16";
  absl::StatusOr<PlannedJob> planned = PlanJob(config, *Mesh::Parse("data=2"));
  ASSERT_TRUE(planned.ok()) << planned.status();
  int fused = 0;
  for (const v1::Op& op : planned->step.step.program().functions(0).ops()) {
    if (op.kind() != v1::OP_ADAM_UPDATE) continue;
    ++fused;
    EXPECT_THAT(op.axis_names(), ::testing::ElementsAre("data"));
    EXPECT_EQ(op.adamw().reduce_dtype(), v1::DTYPE_BF16);
  }
  EXPECT_EQ(fused, 4);  // both Dense layers' kernels and biases
  config.optimizer.name = "sgd";
  EXPECT_THAT(std::string(PlanJob(config, *Mesh::Parse("data=2")).status().message()),
              ::testing::HasSubstr("reduce dtype bf16 with optimizer sgd"));
}

TEST(InputPipelineE2ETest, TheMainJobInBf16KeepsF32MastersAndTracksTheF32Run) {
  JobConfig config;
  config.train.log_every = 1;
  config.precision.compute = "bf16";
  absl::StatusOr<PlannedJob> planned = PlanJob(config, *Mesh::Parse("data=2"));
  ASSERT_TRUE(planned.ok()) << planned.status();
  for (const PlannedArray& a : planned->step.state) {
    EXPECT_EQ(a.dtype, a.name == "rng" ? v1::DTYPE_U32 : v1::DTYPE_F32) << a.name;
  }
  std::map<std::string, DType> dtypes;
  for (const v1::BufferDecl& b : planned->step.step.program().buffers())
    dtypes[b.name()] = b.dtype();
  int bf16_gemms = 0;
  for (const v1::Op& op : planned->step.step.program().functions(0).ops()) {
    if (op.kind() == v1::OP_ADAM_UPDATE) {
      for (int in = 0; in < 4; ++in)
        EXPECT_EQ(dtypes[op.inputs(in)], v1::DTYPE_F32) << op.inputs(in);
    }
    bf16_gemms += op.kind() == v1::OP_MATMUL && dtypes[op.inputs(0)] == v1::DTYPE_BF16 &&
                  dtypes[op.inputs(1)] == v1::DTYPE_BF16;
  }
  // Per minibatch, both Dense layers forward and their kernels' and the hidden layer's gradients.
  EXPECT_GE(bf16_gemms, 4 * config.optimizer.num_minibatches);

  auto cluster = testing::StartCluster("data=2", "bf16");
  ASSERT_NE(cluster, nullptr);
  auto client = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<TrainResult> bf16 = (*client)->Train(config);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  ASSERT_TRUE(bf16->evaluated);
  EXPECT_GE(bf16->test_accuracy, 0.84);
  config.precision.compute = "f32";
  config.train.max_steps = 50;
  config.train.evaluate = false;
  absl::StatusOr<TrainResult> f32 = (*client)->Train(config);
  ASSERT_TRUE(f32.ok()) << f32.status();
  const std::vector<double> a = Losses(*f32), b = Losses(*bf16);
  ASSERT_EQ(a.size(), 50u);
  ASSERT_GT(b.size(), 400u);  // one epoch of 60000 / 128
  for (size_t k = 0; k < a.size(); ++k) {
    EXPECT_NEAR(b[k], a[k], 2e-2 * std::abs(a[k])) << "step " << k + 1;
  }
  EXPECT_TRUE(cluster->Stop().ok());
}

// train.on_nonfinite "skip_step" (optax.apply_if_finite): with an infinity in one example of
// step 4's batch, that step's loss is not finite and its update is skipped: the parameters after
// step 4 are those after step 3 (the same evaluation loss, bit for bit), the job trains on and
// ends finite. Under "stop" the same data stops the job at step 4, naming it.
TEST(InputPipelineE2ETest, SkipStepLeavesTheStateOfANonFiniteStepUnchanged) {
  const std::string dir = ::testing::TempDir() + "/with_inf";
  fs::remove_all(dir);
  Numpy(absl::StrCat(R"(
import numpy as np, os
for name, n in (("train", 64), ("eval", 32)):
    d = os.path.join(")",
                     dir, R"(", name)
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(n)
    x = rng.normal(size=(n, 1024)).astype(np.float32)
    w = (rng.normal(size=(1024, 1024)) / 32).astype(np.float32)
    y = np.tanh(x @ w).astype(np.float32)
    if name == "train":
        x[27, 5] = np.inf  # unshuffled batches of 8: step 4 reads examples 24..31
    np.save(os.path.join(d, "input.npy"), x)
    np.save(os.path.join(d, "label.npy"), y)
)"));
  auto cluster = testing::StartCluster("data=2", "skip");
  ASSERT_NE(cluster, nullptr);
  auto client = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(client.ok());
  auto run = [&](const std::string& policy, int64_t steps) {
    JobConfig config = NpyJob(dir + "/train", steps);
    config.data.eval_path = dir + "/eval";
    config.data.batch_size = 8;
    config.data.shuffle = false;
    config.train.log_every = 1;
    config.train.on_nonfinite = policy;
    return (*client)->Train(config);
  };
  absl::StatusOr<TrainResult> three = run("skip_step", 3), four = run("skip_step", 4),
                              six = run("skip_step", 6);
  ASSERT_TRUE(three.ok()) << three.status();
  ASSERT_TRUE(four.ok()) << four.status();
  ASSERT_TRUE(six.ok()) << six.status();
  std::vector<float> losses;
  for (const v1::StepReport& rep : six->reports)
    losses.insert(losses.end(), rep.losses().begin(), rep.losses().end());
  ASSERT_EQ(losses.size(), 6u);
  for (int k = 0; k < 6; ++k) EXPECT_EQ(std::isfinite(losses[k]), k != 3) << "step " << k + 1;
  ASSERT_TRUE(three->evaluated && four->evaluated && six->evaluated);
  EXPECT_EQ(four->test_loss, three->test_loss) << "step 4 changed nothing";
  EXPECT_TRUE(std::isfinite(six->test_loss));
  EXPECT_NE(six->test_loss, four->test_loss) << "steps 5 and 6 trained";
  absl::StatusOr<TrainResult> stopped = run("stop", 6);
  EXPECT_FALSE(stopped.ok());
  EXPECT_THAT(std::string(stopped.status().message()), HasSubstr("at step 4"));
  ASSERT_TRUE(cluster->Stop().ok());
}

TEST(InputPipelineE2ETest, BadDataFailsNamingTheValueAndLeavesNothingBehind) {
  const std::string good = WriteRegression("bad_data", 64);
  auto cluster = testing::StartCluster("data=2", "bad_data");
  ASSERT_NE(cluster, nullptr);
  auto client = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(client.ok());
  JobConfig config = NpyJob(good, 2);
  const auto expect_error = [&](const std::string& path, const std::string& what) {
    config.data.path = path;
    absl::StatusOr<TrainResult> r = (*client)->Train(config);
    ASSERT_FALSE(r.ok()) << what;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(what));
    auto arrays = (*client)->ListArrays();
    ASSERT_TRUE(arrays.ok());
    EXPECT_TRUE(arrays->empty()) << what << ": nothing is left on the cluster";
  };
  expect_error("/no/such/dataset", "/no/such/dataset");
  // A truncated file, fields of different lengths, a dtype the model does not take.
  const std::string bad = ::testing::TempDir() + "/bad_data_variants";
  fs::remove_all(bad);
  fs::create_directories(bad);
  fs::copy_file(good + "/input.npy", bad + "/input.npy");
  fs::copy_file(good + "/label.npy", bad + "/label.npy");
  fs::resize_file(bad + "/label.npy", fs::file_size(bad + "/label.npy") - 100);
  expect_error(bad, "label.npy: truncated");
  Numpy(absl::StrCat("import numpy as np\nnp.save('", bad,
                     "/label.npy', np.zeros((32, 1024), np.float32))\n"));
  expect_error(bad, "field 'label' has 32 examples but field 'input' has 64");
  Numpy(absl::StrCat("import numpy as np\nnp.save('", bad,
                     "/label.npy', np.zeros((64, 1024), np.int32))\n"));
  expect_error(bad, "the program takes f32 but the dataset holds i32");
  // The main job's global batch of 100 in 4 minibatches of 25 does not divide over 2 workers.
  JobConfig main;
  main.data.batch_size = 100;
  main.train.max_steps = 2;
  absl::StatusOr<TrainResult> r = (*client)->Train(main);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("(25)"));
  // The cluster keeps serving.
  config.data.path = good;
  EXPECT_TRUE((*client)->Train(config).ok());
  ASSERT_TRUE(cluster->Stop().ok());
}

}  // namespace
}  // namespace meshrun
