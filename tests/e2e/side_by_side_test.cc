// Two clusters on one host at once, as two users' jobs would run: their workers share /dev/shm,
// the loopback interface and the cores, and each cluster's collectives must see only its own
// workers' data (shared-memory rings and arenas are named per cluster; ports are each worker's
// own).
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "meshrun/client.h"
#include "meshrun/local_cluster.h"
#include "meshrun/shard_map.h"
#include "tests/testutil/cluster.h"

namespace meshrun {
namespace {

// Cluster c's input value at index i: the two clusters' values differ everywhere, so a block
// summed with the other cluster's data cannot come out right.
float Value(int c, int64_t i) { return c == 0 ? static_cast<float>(i % 7 + 1) : (i % 5) * 100.0f; }

// Runs psums of several sizes (the small-message path, and chunked ring collectives past the
// shared-memory rings' fragment size) `rounds` times on `client`'s 2-worker cluster `c`, checking
// every device's block.
void RunPsums(Client& client, int c, int rounds) {
  const Mesh mesh = *Mesh::Parse("x=2");
  const PartitionSpec px = PartitionSpec::Of({"x"});
  for (int round = 0; round < rounds; ++round) {
    for (int64_t count : {1, 1000, 300000}) {
      SCOPED_TRACE(absl::StrCat("cluster ", c, " round ", round, " count ", count));
      ShardMapBuilder sm(mesh);
      auto x = sm.Input(v1::DTYPE_F32, {2 * count}, px);
      sm.Output(sm.Psum(x, {"x"}), px);
      Tensor in(v1::DTYPE_F32, {2 * count});
      for (int64_t i = 0; i < 2 * count; ++i) in.data<float>()[i] = Value(c, i) + round;
      Tensor out = testing::RunShardMap(client, sm.Build(), {&in});
      ASSERT_EQ(out.num_elements(), 2 * count);
      for (int d = 0; d < 2; ++d) {
        for (int64_t i = 0; i < count; ++i) {
          const float want = in.data<float>()[i] + in.data<float>()[count + i];
          ASSERT_EQ(out.data<float>()[d * count + i], want) << "device " << d << " element " << i;
        }
      }
    }
  }
}

// Every line of the logs in `dir` that says a shared-memory link could not be set up (a ring
// name already taken, a segment that cannot be mapped): each cluster must get links of its own.
std::string ShmSetupFailures(const std::string& dir) {
  std::string found;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    std::ifstream in(entry.path());
    for (std::string line; std::getline(in, line);) {
      if (line.find("no shared-memory link") != std::string::npos ||
          line.find("shared-memory ring this worker cannot map") != std::string::npos) {
        found += entry.path().filename().string() + ": " + line + "\n";
      }
    }
  }
  return found;
}

TEST(SideBySideTest, TwoClustersOnOneHostEachSumOnlyTheirOwnData) {
  auto a = testing::StartCluster("x=2", "side_a");
  auto b = testing::StartCluster("x=2", "side_b");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  auto client_a = Client::Connect(a->coordinator_address());
  auto client_b = Client::Connect(b->coordinator_address());
  ASSERT_TRUE(client_a.ok()) << client_a.status();
  ASSERT_TRUE(client_b.ok()) << client_b.status();
  std::thread other([&] { RunPsums(**client_b, 1, 8); });
  RunPsums(**client_a, 0, 8);
  other.join();
  EXPECT_EQ(ShmSetupFailures(a->log_dir()), "");
  EXPECT_EQ(ShmSetupFailures(b->log_dir()), "");
}

// A second cluster started on a live cluster's coordinator port (two users' `meshrun up` with the
// default port) fails at start, saying which port and why, and the first cluster serves on.
TEST(SideBySideTest, ASecondClusterOnALiveCoordinatorsPortIsRefusedNamingThePort) {
  auto a = testing::StartCluster("x=2", "side_port_a");
  ASSERT_NE(a, nullptr);
  const std::string address = a->coordinator_address();
  const std::string port = address.substr(address.rfind(':') + 1);
  LocalClusterOptions o;
  o.mesh = "x=2";
  o.port = std::stoi(port);
  o.log_dir = absl::StrCat(::testing::TempDir(), "/meshrun-side_port_b-", getpid());
  auto b = LocalCluster::Start(o);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kUnavailable) << b.status();
  EXPECT_THAT(b.status().message(), ::testing::HasSubstr("cannot listen on 127.0.0.1:" + port));
  EXPECT_THAT(b.status().message(), ::testing::HasSubstr("held by another process"));
  auto client = Client::Connect(address);
  ASSERT_TRUE(client.ok()) << client.status();
  RunPsums(**client, 0, 1);
}

}  // namespace
}  // namespace meshrun
