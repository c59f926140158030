// The Grafana dashboards under deploy/grafana: every dashboard parses, every PromQL expression
// passes promtool, and against a real Prometheus server scraping a live cluster during training
// every panel's query returns data.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "meshrun/client.h"
#include "meshrun/shard_map.h"
#include "nlohmann/json.hpp"
#include "tests/testutil/cluster.h"
#include "tests/testutil/process_util.h"

namespace meshrun {
namespace {

using ::meshrun::testing::HttpGet;
using ::meshrun::testing::RunCommand;
using ::meshrun::testing::WriteTempFile;

struct Query {
  std::string dashboard, panel, expr;
};

std::vector<Query> DashboardQueries() {
  std::vector<Query> out;
  const std::string dir = std::string(MESHRUN_SOURCE_DIR) + "/deploy/grafana/dashboards";
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    std::ifstream in(entry.path());
    nlohmann::json d = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    EXPECT_FALSE(d.is_discarded()) << entry.path() << " is not valid JSON";
    if (d.is_discarded()) continue;
    EXPECT_TRUE(d.contains("uid") && d.contains("panels")) << entry.path();
    for (const auto& panel : d["panels"]) {
      EXPECT_EQ(panel["datasource"]["uid"], "meshrun-prometheus") << panel["title"];
      for (const auto& target : panel["targets"]) {
        out.push_back({d["title"], panel["title"], target["expr"]});
      }
    }
  }
  return out;
}

std::string UrlEncode(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out += static_cast<char>(c);
    } else {
      out += absl::StrCat("%", absl::Hex(c, absl::kZeroPad2));
    }
  }
  return out;
}

TEST(DashboardsTest, EveryExpressionPassesPromtool) {
  const std::vector<Query> queries = DashboardQueries();
  ASSERT_GE(queries.size(), 15u);
  if (access("/usr/bin/promtool", X_OK) != 0) GTEST_SKIP() << "promtool not installed (Debian package prometheus)";
  std::string rules = "groups:\n  - name: dashboards\n    rules:\n";
  for (size_t i = 0; i < queries.size(); ++i) {
    absl::StrAppend(&rules, "      - record: meshrun:dashboard_check_", i, "\n        expr: '", queries[i].expr, "'\n");
  }
  const std::string path = WriteTempFile("dashboard-rules.yml", rules);
  auto r = RunCommand({"/usr/bin/promtool", "check", "rules", path}, 60);
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

TEST(DashboardsTest, EveryPanelReturnsDataFromALiveClusterDuringTraining) {
  if (access("/usr/bin/prometheus", X_OK) != 0) GTEST_SKIP() << "prometheus not installed";
  auto cluster = testing::StartCluster("data=2", "dashboards");
  ASSERT_NE(cluster, nullptr);
  auto client = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(client.ok());
  auto st = (*client)->GetStatus();
  ASSERT_TRUE(st.ok());
  std::vector<std::string> targets = {absl::StrCat("'", st->metrics_address(), "'")};
  for (const auto& w : st->workers()) targets.push_back(absl::StrCat("'", w.peer().metrics_address(), "'"));
  const std::string dir = absl::StrCat(::testing::TempDir(), "/prometheus-", getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string config = WriteTempFile(
      absl::StrCat("prometheus-", getpid(), ".yml"),
      absl::StrCat("global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: meshrun\n    static_configs:\n"
                   "      - targets: [",
                   absl::StrJoin(targets, ", "), "]\n"));
  const int port = 20000 + getpid() % 20000;
  const std::string web = absl::StrCat("127.0.0.1:", port);
  pid_t prom = fork();
  if (prom == 0) {
    FILE* f = freopen((dir + "/log").c_str(), "w", stdout);
    (void)f;
    dup2(1, 2);
    execl("/usr/bin/prometheus", "prometheus", ("--config.file=" + config).c_str(),
          ("--storage.tsdb.path=" + dir).c_str(), ("--web.listen-address=" + web).c_str(),
          static_cast<char*>(nullptr));
    _exit(127);
  }
  // Train for a while with Prometheus scraping every second.
  JobConfig job;
  job.train.max_steps = 1200;
  job.train.log_every = 100;
  job.train.evaluate = false;
  auto result = (*client)->Train(job);
  ASSERT_TRUE(result.ok()) << result.status();
  // The train job only all-reduces; shard_map programs feed the gather and scatter series.
  ShardMapBuilder sm(*Mesh::Parse("data=2"));
  auto x = sm.Input(v1::DTYPE_F32, {1 << 16}, PartitionSpec::Of({"data"}));
  sm.Output(sm.AllGather(x, {"data"}, 0, true), PartitionSpec());
  sm.Output(sm.PsumScatter(sm.AllGather(x, {"data"}, 0, true), {"data"}, 0, true), PartitionSpec::Of({"data"}));
  auto program = sm.Build();
  ASSERT_TRUE(program.ok()) << program.status();
  ASSERT_TRUE((*client)->Put(testing::NormalTensor({1 << 16}, 1), PartitionSpec::Of({"data"}), "x").ok());
  for (const absl::Time until = absl::Now() + absl::Seconds(4); absl::Now() < until;) {
    auto outs = (*client)->ShardMap(*program, {"x"});
    ASSERT_TRUE(outs.ok()) << outs.status();
    for (const auto& o : *outs) ASSERT_TRUE((*client)->Delete(o.id()).ok());
    absl::SleepFor(absl::Milliseconds(100));
  }
  absl::SleepFor(absl::Seconds(3));  // a few scrapes after the last step
  std::vector<std::string> empty;
  for (const Query& q : DashboardQueries()) {
    const std::string body = HttpGet(web, "/api/v1/query?query=" + UrlEncode(q.expr));
    nlohmann::json j = nlohmann::json::parse(body, nullptr, false);
    const bool has_data = !j.is_discarded() && j["status"] == "success" && !j["data"]["result"].empty();
    if (!has_data) empty.push_back(absl::StrCat(q.dashboard, " / ", q.panel, ": ", q.expr, " -> ", body));
  }
  kill(prom, SIGTERM);
  waitpid(prom, nullptr, 0);
  EXPECT_TRUE(empty.empty()) << "panels without data:\n" << absl::StrJoin(empty, "\n")
                             << "\nprometheus log:\n" << testing::ReadFile(dir + "/log");
  ASSERT_TRUE(cluster->Stop().ok());
}

}  // namespace
}  // namespace meshrun
