// Prometheus metrics of a live cluster: the coordinator and every worker serve /metrics with the
// series the dashboards use, `promtool check metrics` is clean on each, and values move with a job.
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "meshrun/client.h"
#include "tests/testutil/cluster.h"
#include "tests/testutil/process_util.h"

namespace meshrun {
namespace {

using ::meshrun::testing::HttpGet;
using ::meshrun::testing::RunCommand;
using ::meshrun::testing::WriteTempFile;
using ::testing::HasSubstr;

// `promtool check metrics` on `text`; "" when promtool is not installed.
std::string Promtool(const std::string& text, int* exit_code) {
  if (access("/usr/bin/promtool", X_OK) != 0) {
    *exit_code = 0;
    return "";
  }
  const std::string path = WriteTempFile(absl::StrCat("metrics-", getpid(), ".txt"), text);
  auto r = RunCommand({"/bin/sh", "-c", "/usr/bin/promtool check metrics < " + path}, 30);
  *exit_code = r.exit_code;
  return r.output;
}

TEST(MetricsE2ETest, CoordinatorAndWorkersExposeLintCleanMetrics) {
  auto cluster = testing::StartCluster("data=2", "metrics");
  ASSERT_NE(cluster, nullptr);
  auto client = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(client.ok());
  JobConfig config;
  config.train.max_steps = 6;
  config.train.log_every = 3;
  config.train.evaluate = false;
  ASSERT_TRUE((*client)->Train(config).ok());
  auto st = (*client)->GetStatus();
  ASSERT_TRUE(st.ok());

  const std::string coord = HttpGet(st->metrics_address(), "/metrics");
  for (const char* series :
       {"meshrun_build_info{component=\"coordinator\"", "meshrun_registered_workers 2",
        "meshrun_mesh_devices 2", "meshrun_train_steps_total 6", "meshrun_train_samples_total 768",
        "meshrun_train_loss ", "meshrun_train_accuracy ", "meshrun_step_duration_seconds_bucket",
        "meshrun_step_collective_seconds_count",
        "meshrun_worker_last_heartbeat_timestamp_seconds{rank=\"1\"}",
        "meshrun_jobs_total{state=\"done\"} 1",
        "grpc_server_handled_total{grpc_code=\"OK\",grpc_method=\"SubmitJob\",grpc_service="
        "\"meshrun.v1.Coordinator\","
        "grpc_type=\"server_stream\"} 1",
        "grpc_server_handling_seconds_bucket"}) {
    EXPECT_THAT(coord, HasSubstr(series));
  }
  int code = 0;
  std::string lint = Promtool(coord, &code);
  EXPECT_EQ(code, 0) << lint;
  EXPECT_EQ(lint, "") << "promtool: " << lint;

  ASSERT_EQ(st->workers_size(), 2);
  for (const auto& w : st->workers()) {
    ASSERT_FALSE(w.peer().metrics_address().empty());
    const std::string text = HttpGet(w.peer().metrics_address(), "/metrics");
    EXPECT_THAT(text, HasSubstr("meshrun_build_info{component=\"worker\""));
    EXPECT_THAT(text, HasSubstr("meshrun_worker_steps_total 6"));
    EXPECT_THAT(text, HasSubstr("meshrun_kernel_duration_seconds_count{kernel=\"matmul\"}"));
    // One all-reduce per step: the kernel gradient's, fused with its Adam update, with the small
    // gradients, the loss and the correct count riding along (worker/combine_reductions.h).
    EXPECT_THAT(
        text, HasSubstr("meshrun_collective_duration_seconds_count{axis=\"data\",op=\"psum\"} 6"));
    // 6 x (the 407,050 f32 parameters' gradients + the loss + the correct count).
    EXPECT_THAT(text,
                HasSubstr("meshrun_collective_bytes_total{axis=\"data\",op=\"psum\"} 9769248"));
    EXPECT_THAT(text, HasSubstr("meshrun_worker_input_bytes_total 301440"));  // 6 x 64 x (784 + 1)
    EXPECT_THAT(
        text, HasSubstr("grpc_server_handled_total{grpc_code=\"OK\",grpc_method=\"RunShardMap\""));
    lint = Promtool(text, &code);
    EXPECT_EQ(code, 0) << lint;
    EXPECT_EQ(lint, "") << "promtool: " << lint;
  }
  ASSERT_TRUE(cluster->Stop().ok());
}

}  // namespace
}  // namespace meshrun
