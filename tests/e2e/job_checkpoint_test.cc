// The main job's checkpoint policy on real clusters (config "checkpoint": save_every, keep, async,
// resume, init_from): a job stopped at step 40 and resumed to 80 reports the same losses, bit for
// bit, as an uninterrupted run; its checkpoint resumes on another mesh; a safetensors file of
// params starts a job; a checkpoint of another model is rejected naming the array.
#include <cmath>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/checkpoint/checkpoint.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "meshrun/client.h"
#include "meshrun/local_cluster.h"
#include "tests/testutil/cluster.h"

namespace meshrun {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

struct JobRun {
  absl::Status status;
  std::map<int64_t, double> loss;  // per reported step (log_every 1: every step)
  std::vector<std::string> info;
};

JobRun RunJob(Client& client, const JobConfig& config) {
  JobRun run;
  absl::StatusOr<TrainResult> r = client.Train(config, [&](const v1::JobEvent& e) {
    if (e.has_info()) run.info.push_back(e.info());
  });
  run.status = r.status();
  if (r.ok()) {
    for (const v1::StepReport& rep : r->reports) run.loss[rep.step()] = rep.loss();
  }
  return run;
}

bool AnyContains(const std::vector<std::string>& lines, const std::string& part) {
  for (const std::string& l : lines) {
    if (absl::StrContains(l, part)) return true;
  }
  return false;
}

class JobCheckpointTest : public testing::TempRootTest {
 protected:
  JobCheckpointTest() : TempRootTest("meshrun-job-ckpt-") {}
};

TEST_F(JobCheckpointTest, StoppedAtFortyAndResumedToEightyMatchesAnUninterruptedRunBitForBit) {
  auto cluster = testing::StartCluster("data=8", "jobckpt");
  ASSERT_NE(cluster, nullptr);
  auto client = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(client.ok()) << client.status();

  const JobRun straight = RunJob(**client, testing::PerStepJobConfig(100));
  ASSERT_TRUE(straight.status.ok()) << straight.status;
  ASSERT_EQ(straight.loss.size(), 100u);

  // Stopped at 40: saves at 20 and 40 (async: from the workers' snapshot), keeping the newest.
  const std::string dir = (root_ / "ck").string();
  JobConfig first = testing::PerStepJobConfig(40);
  first.checkpoint.dir = dir;
  first.checkpoint.save_every = 20;
  first.checkpoint.keep = 1;
  first.checkpoint.async = true;
  const JobRun stopped = RunJob(**client, first);
  ASSERT_TRUE(stopped.status.ok()) << stopped.status;
  for (int64_t s = 1; s <= 40; ++s)
    EXPECT_EQ(stopped.loss.at(s), straight.loss.at(s)) << "step " << s;
  EXPECT_TRUE(AnyContains(stopped.info, "checkpoint saved: " + dir + "/step_00000020"));
  EXPECT_TRUE(AnyContains(stopped.info, "checkpoint saved: " + dir + "/step_00000040"));
  ASSERT_EQ(checkpoint::ListCheckpoints(dir).size(), 1u) << "keep 1";
  EXPECT_EQ(checkpoint::ListCheckpoints(dir)[0].first, 40);

  // Resumed to 80 (synchronous saves): steps 41..80 as the uninterrupted run's, exactly.
  JobConfig second = testing::PerStepJobConfig(80);
  second.checkpoint.dir = dir;
  second.checkpoint.save_every = 20;
  second.checkpoint.resume = true;
  const JobRun resumed = RunJob(**client, second);
  ASSERT_TRUE(resumed.status.ok()) << resumed.status;
  EXPECT_TRUE(AnyContains(resumed.info, "resumed from " + dir + "/step_00000040 at step 40"));
  ASSERT_EQ(resumed.loss.size(), 40u);
  EXPECT_EQ(resumed.loss.begin()->first, 41);
  for (int64_t s = 41; s <= 80; ++s)
    EXPECT_EQ(resumed.loss.at(s), straight.loss.at(s)) << "step " << s;
  std::vector<int64_t> steps;
  for (const auto& [step, path] : checkpoint::ListCheckpoints(dir)) steps.push_back(step);
  EXPECT_EQ(steps, (std::vector<int64_t>{40, 60, 80}));

  // The same checkpoint resumes on 4 workers (the state is replicated: every worker reads the
  // blocks). Dropout off for this part (its masks are drawn per data shard, so they depend on the
  // mesh): steps 81..100 on 4 workers agree with 8 workers resuming from a copy of the
  // checkpoint, up to the reduction order.
  const std::string copy = (root_ / "ck8").string();
  fs::copy(dir, copy, fs::copy_options::recursive);
  JobConfig third = testing::PerStepJobConfig(100);
  third.model.dropout_rate = 0;
  third.checkpoint.dir = copy;
  third.checkpoint.resume = true;
  const JobRun on_eight = RunJob(**client, third);
  ASSERT_TRUE(on_eight.status.ok()) << on_eight.status;
  ASSERT_TRUE(cluster->Stop().ok());
  auto four = testing::StartCluster("data=4", "jobckpt4");
  ASSERT_NE(four, nullptr);
  auto client4 = Client::Connect(four->coordinator_address());
  ASSERT_TRUE(client4.ok()) << client4.status();
  third.checkpoint.dir = dir;
  const JobRun on_four = RunJob(**client4, third);
  ASSERT_TRUE(on_four.status.ok()) << on_four.status;
  EXPECT_TRUE(AnyContains(on_four.info, "resumed from " + dir + "/step_00000080 at step 80"));
  ASSERT_EQ(on_four.loss.size(), 20u);
  ASSERT_EQ(on_eight.loss.size(), 20u);
  for (int64_t s = 81; s <= 100; ++s) {
    EXPECT_LE(std::abs(on_four.loss.at(s) - on_eight.loss.at(s)) / on_eight.loss.at(s), 1e-4)
        << "step " << s;
  }
  ASSERT_TRUE(four->Stop().ok());
}

TEST_F(JobCheckpointTest, InitFromASafetensorsFileAndMismatchesNamedBeforeTraining) {
  auto cluster = testing::StartCluster("data=2", "jobinit");
  ASSERT_NE(cluster, nullptr);
  auto client = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(client.ok()) << client.status();

  // All-zero parameters: the logits of the first step are 0, so its loss is exactly ln(10)
  // whatever the batch and the dropout mask; a run from its own init is not.
  auto write_params = [&](const std::string& name, int hidden, bool with_output_bias) {
    std::vector<std::pair<std::string, Tensor>> owned = {
        {"params/input_dense/kernel", Tensor(v1::DTYPE_F32, {784, hidden})},
        {"params/input_dense/bias", Tensor(v1::DTYPE_F32, {hidden})},
        {"params/output_dense/kernel", Tensor(v1::DTYPE_F32, {hidden, 10})}};
    if (with_output_bias)
      owned.emplace_back("params/output_dense/bias", Tensor(v1::DTYPE_F32, {10}));
    std::vector<std::pair<std::string, const Tensor*>> tensors;
    for (auto& [n, t] : owned) {
      std::fill(t.data<float>(), t.data<float>() + t.num_elements(), 0.0f);
      tensors.emplace_back(n, &t);
    }
    const std::string path = (root_ / name).string();
    EXPECT_TRUE(checkpoint::WriteSafetensors(path, tensors).ok());
    return path;
  };
  JobConfig config = testing::PerStepJobConfig(3);
  config.checkpoint.init_from = write_params("zeros.safetensors", 512, true);
  const JobRun zeros = RunJob(**client, config);
  ASSERT_TRUE(zeros.status.ok()) << zeros.status;
  EXPECT_TRUE(AnyContains(zeros.info, "initialised from " + config.checkpoint.init_from));
  EXPECT_NEAR(zeros.loss.at(1), std::log(10.0), 1e-5);  // f32 sums over 128 examples
  const JobRun own = RunJob(**client, testing::PerStepJobConfig(3));
  ASSERT_TRUE(own.status.ok()) << own.status;
  EXPECT_GT(std::abs(own.loss.at(1) - std::log(10.0)), 1e-3);

  // A file of another model's shapes, or missing a parameter: rejected naming array and file.
  config.checkpoint.init_from = write_params("narrow.safetensors", 256, true);
  JobRun bad = RunJob(**client, config);
  EXPECT_EQ(bad.status.code(), absl::StatusCode::kInvalidArgument) << bad.status;
  EXPECT_THAT(std::string(bad.status.message()), HasSubstr("params/input_dense/kernel"));
  EXPECT_THAT(std::string(bad.status.message()), HasSubstr("narrow.safetensors"));
  EXPECT_THAT(std::string(bad.status.message()), HasSubstr("f32[784, 512]"));
  EXPECT_TRUE(bad.loss.empty());
  config.checkpoint.init_from = write_params("partial.safetensors", 512, false);
  bad = RunJob(**client, config);
  EXPECT_EQ(bad.status.code(), absl::StatusCode::kNotFound) << bad.status;
  EXPECT_THAT(std::string(bad.status.message()), HasSubstr("params/output_dense/bias"));

  // A checkpoint of a narrower model cannot resume this job; the cluster keeps serving.
  JobConfig narrow = testing::PerStepJobConfig(2);
  narrow.model.hidden_size = 256;
  narrow.checkpoint.dir = (root_ / "narrow").string();
  ASSERT_TRUE(RunJob(**client, narrow).status.ok());
  JobConfig wide = testing::PerStepJobConfig(4);
  wide.checkpoint.dir = narrow.checkpoint.dir;
  wide.checkpoint.resume = true;
  bad = RunJob(**client, wide);
  EXPECT_EQ(bad.status.code(), absl::StatusCode::kInvalidArgument) << bad.status;
  EXPECT_THAT(std::string(bad.status.message()), HasSubstr("step_00000002"));
  EXPECT_THAT(std::string(bad.status.message()), HasSubstr("f32[784, 256]"));
  EXPECT_TRUE(RunJob(**client, testing::PerStepJobConfig(2)).status.ok());
  ASSERT_TRUE(cluster->Stop().ok());
}

}  // namespace
}  // namespace meshrun
