#include "core/config/job_config.h"

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace meshrun {
namespace {

using ::testing::HasSubstr;

TEST(JobConfigTest, DefaultsAreTheSeedsMainJob) {
  absl::StatusOr<JobConfig> c = ParseJobConfig("{}");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model.hidden_size, 512);
  EXPECT_EQ(c->optimizer.name, "adamw");
  EXPECT_DOUBLE_EQ(c->optimizer.weight_decay, 1e-4);
  EXPECT_EQ(c->optimizer.num_minibatches, 4);
  EXPECT_EQ(c->data.batch_size, 128);
}

TEST(JobConfigTest, ParsesEverySection) {
  absl::StatusOr<JobConfig> c =
      ParseJobConfig(R"({"mesh": {"data": 8}, "model": {"dropout_rate": 0},
      "optimizer": {"name": "sgd", "learning_rate": 0.1}, "train": {"max_steps": 20, "seed": 7}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->mesh.size(), 1u);
  EXPECT_EQ(c->mesh[0].second, 8);
  EXPECT_EQ(c->optimizer.name, "sgd");
  EXPECT_EQ(c->train.max_steps, 20);
  EXPECT_EQ(c->train.seed, 7u);
  absl::StatusOr<JobConfig> again = ParseJobConfig(JobConfigToJson(*c));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->train.max_steps, 20);
}

TEST(JobConfigTest, ParsesTheCheckpointPolicy) {
  absl::StatusOr<JobConfig> c =
      ParseJobConfig(R"({"checkpoint": {"dir": "/tmp/ck", "save_every": 20,
      "keep": 2, "async": true, "resume": true, "init_from": "w.safetensors"}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->checkpoint.dir, "/tmp/ck");
  EXPECT_EQ(c->checkpoint.save_every, 20);
  EXPECT_EQ(c->checkpoint.keep, 2);
  EXPECT_TRUE(c->checkpoint.async);
  EXPECT_TRUE(c->checkpoint.resume);
  absl::StatusOr<JobConfig> again = ParseJobConfig(JobConfigToJson(*c));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->checkpoint.dir, "/tmp/ck");
  EXPECT_EQ(again->checkpoint.save_every, 20);
  EXPECT_EQ(again->checkpoint.init_from, "w.safetensors");
  EXPECT_TRUE(again->checkpoint.resume);
  EXPECT_EQ(ParseJobConfig(R"({"checkpoint": {"save_every": 5}})").status().message(),
            "'checkpoint.save_every' is set but 'checkpoint.dir' is not");
  EXPECT_THAT(ParseJobConfig(R"({"checkpoint": {"keep": -1, "dir": "x"}})").status().message(),
              HasSubstr("'checkpoint.keep' is -1"));
}

TEST(JobConfigTest, ParsesTheShardingOfDerivedTrainSteps) {
  absl::StatusOr<JobConfig> c = ParseJobConfig(R"({"model": {"name": "mlp"}, "sharding": {
      "rules": [["batch", "data"], ["hidden", "model"], ["embed", null], ["heads", ["data", "model"]]],
      "fsdp_axis": "data", "min_weight_size": 1024}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->data.dataset, "synthetic");  // a seed workload's own batch when no data is given
  EXPECT_EQ(c->sharding.rules, "batch=data,hidden=model,embed=,heads=data+model");
  EXPECT_EQ(c->sharding.fsdp_axis, "data");
  EXPECT_EQ(c->sharding.min_weight_size, 1024);
  absl::StatusOr<JobConfig> again = ParseJobConfig(JobConfigToJson(*c));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->sharding.rules, c->sharding.rules);
  EXPECT_EQ(again->sharding.fsdp_axis, "data");
  EXPECT_EQ(again->model.name, "mlp");
  c = ParseJobConfig(R"({"model": {"name": "classifier"}, "sharding": {"layout": "fsdp"}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->sharding.layout, "fsdp");
  EXPECT_EQ(ParseJobConfig("{}")->data.dataset, "fashion_mnist");
  // The main job takes a layout like any model.
  c = ParseJobConfig(R"({"sharding": {"layout": "fsdp"}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->sharding.layout, "fsdp");
  EXPECT_THAT(ParseJobConfig(R"({"data": {"dataset": "npy"}})").status().message(),
              HasSubstr("'data.dataset' is npy but 'data.path'"));
  EXPECT_THAT(ParseJobConfig(R"({"data": {"dataset": "synthetic"}})").status().message(),
              HasSubstr("dp_classifier reads fashion_mnist or npy"));
  c = ParseJobConfig(
      R"({"data": {"dataset": "npy", "path": "/d", "eval_path": "/e", "shuffle": false,
          "drop_remainder": false, "eval_batch_size": 100}})");
  ASSERT_TRUE(c.ok()) << c.status();
  again = ParseJobConfig(JobConfigToJson(*c));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->data.eval_path, "/e");
  EXPECT_FALSE(again->data.shuffle);
  EXPECT_FALSE(again->data.drop_remainder);
  EXPECT_EQ(again->data.eval_batch_size, 100);
  EXPECT_THAT(ParseJobConfig(R"({"model": {"name": "mlp"}, "sharding": {"rules": [["batch", 3]]}})")
                  .status()
                  .message(),
              HasSubstr("'sharding.rules' is [\"batch\",3]; expected a list of"));
  EXPECT_THAT(
      ParseJobConfig(
          R"({"model": {"name": "mlp"}, "sharding": {"layout": "2d", "fsdp_axis": "data"}})")
          .status()
          .message(),
      HasSubstr("give either it or 'sharding.rules'"));
}

TEST(JobConfigTest, RejectsUnknownKeysNamingThem) {
  EXPECT_EQ(
      ParseJobConfig(R"({"model": {"hiden_size": 3}})").status().message(),
      "unknown key 'model.hiden_size'; allowed: dropout_rate, hidden_size, name, num_classes");
  EXPECT_THAT(ParseJobConfig(R"({"modle": {}})").status().message(),
              HasSubstr("unknown key 'modle'"));
}

TEST(JobConfigTest, ParsesTheRecoveryPolicy) {
  absl::StatusOr<JobConfig> c = ParseJobConfig(
      R"({"recovery": {"max_restarts": 2, "min_workers": 4, "peer_state_every": 25}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->recovery.max_restarts, 2);
  EXPECT_EQ(c->recovery.min_workers, 4);
  EXPECT_EQ(c->recovery.peer_state_every, 25);
  absl::StatusOr<JobConfig> again = ParseJobConfig(JobConfigToJson(*c));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->recovery.peer_state_every, 25);
  EXPECT_THAT(ParseJobConfig(R"({"recovery": {"peer_state_every": -5}})").status().message(),
              HasSubstr("'recovery.peer_state_every' is -5"));
}

TEST(JobConfigTest, RejectsBadValuesNamingAllowedOnes) {
  EXPECT_EQ(ParseJobConfig(R"({"optimizer": {"name": "adamx"}})").status().message(),
            "'optimizer.name' is \"adamx\"; allowed: adamw, adam, sgd");
  EXPECT_THAT(ParseJobConfig(R"({"data": {"batch_size": -1}})").status().message(),
              HasSubstr("'data.batch_size' is -1; expected an integer in [1, 16777216]"));
  EXPECT_THAT(ParseJobConfig(R"({"data": {"batch_size": 130}})").status().message(),
              HasSubstr("divisible by 'optimizer.num_minibatches'"));
  EXPECT_THAT(ParseJobConfig("{").status().message(), HasSubstr("not valid JSON"));
  // Where: the parser's line and column.
  EXPECT_THAT(ParseJobConfig("{\n  \"mesh\": {\"data\": 2},\n  \"model\": ,\n}").status().message(),
              HasSubstr("line 3, column 12"));
  // A number past double's range is nlohmann's out_of_range, not a parse_error: still an error.
  EXPECT_THAT(ParseJobConfig("{\"train\": {\"seed\": 1e400}}").status().message(),
              HasSubstr("not valid JSON: [json.exception.out_of_range.406] number overflow"));
  EXPECT_THAT(LoadJobConfig("/nonexistent/job.json").status().message(),
              HasSubstr("/nonexistent/job.json"));
}

TEST(JobConfigTest, ParsesThePrecisionOfEveryModel) {
  absl::StatusOr<JobConfig> c =
      ParseJobConfig(R"({"precision": {"compute": "bf16", "reduce": "bf16"}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->precision.compute, "bf16");
  EXPECT_EQ(c->precision.reduce, "bf16");
  absl::StatusOr<JobConfig> again = ParseJobConfig(JobConfigToJson(*c));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->precision.compute, "bf16");
  EXPECT_EQ(again->precision.reduce, "bf16");
  EXPECT_EQ(ParseJobConfig("{}")->precision.compute, "f32");
  EXPECT_EQ(ParseJobConfig("{}")->precision.reduce, "f32");
  EXPECT_EQ(ParseJobConfig(R"({"precision": {"compute": "fp16"}})").status().message(),
            "'precision.compute' is \"fp16\"; allowed: f32, bf16");
  EXPECT_EQ(ParseJobConfig(R"({"precision": {"reduce": "f16"}})").status().message(),
            "'precision.reduce' is \"f16\"; allowed: f32, bf16");
  for (const char* model : {"mlp", "dot_relu_dot", "classifier"}) {
    absl::StatusOr<JobConfig> seed = ParseJobConfig(
        absl::StrCat(R"({"model": {"name": ")", model, R"("}, "precision": {"compute": "bf16"}})"));
    ASSERT_TRUE(seed.ok()) << model << ": " << seed.status();
    EXPECT_EQ(seed->precision.compute, "bf16") << model;
  }
}

}  // namespace
}  // namespace meshrun
