// The worker process's environment as it runs: OpenMP's (oneDNN's) idle threads sleep
// (OMP_WAIT_POLICY=PASSIVE, set by the worker before libgomp loads) unless the operator chose a
// policy, which the worker keeps.
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gtest/gtest.h"
#include "meshrun/local_cluster.h"
#include "tests/testutil/cluster.h"
#include "tests/testutil/process_util.h"

namespace meshrun {
namespace {

// The value of `name` in process `pid`'s environment ("" if unset).
std::string EnvironmentOf(pid_t pid, const std::string& name) {
  const std::string environ = testing::ReadFile(absl::StrCat("/proc/", pid, "/environ"));
  for (absl::string_view entry : absl::StrSplit(environ, '\0')) {
    if (absl::ConsumePrefix(&entry, name + "=")) return std::string(entry);
  }
  return "";
}

TEST(WorkerProcessTest, OpenMpThreadsSleepUnlessTheOperatorChoseAPolicy) {
  for (const char* chosen : {"", "ACTIVE"}) {
    if (*chosen != '\0') {
      setenv("OMP_WAIT_POLICY", chosen, 1);  // inherited by the cluster's processes
    } else {
      unsetenv("OMP_WAIT_POLICY");
    }
    auto cluster = testing::StartCluster("data=2", "omp");
    ASSERT_NE(cluster, nullptr);
    ASSERT_EQ(cluster->worker_pids().size(), 2u);
    for (pid_t pid : cluster->worker_pids()) {
      EXPECT_EQ(EnvironmentOf(pid, "OMP_WAIT_POLICY"), *chosen != '\0' ? chosen : "PASSIVE")
          << "worker pid " << pid << ", operator's policy '" << chosen << "'";
    }
    EXPECT_TRUE(cluster->Stop().ok());
  }
  unsetenv("OMP_WAIT_POLICY");
}

}  // namespace
}  // namespace meshrun
