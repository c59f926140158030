// Helpers for end-to-end tests: local clusters with per-test log directories, random tensors.
#ifndef MESHRUN_TESTS_TESTUTIL_CLUSTER_H_
#define MESHRUN_TESTS_TESTUTIL_CLUSTER_H_

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/sharding/mesh.h"
#include "core/tensor.h"
#include "gtest/gtest.h"
#include "meshrun/client.h"
#include "meshrun/local_cluster.h"
#include "meshrun/v1/program.pb.h"

namespace meshrun::testing {

// A cluster for `mesh` whose logs go under the test temp dir, named after `tag`, or why it did
// not start (nothing recorded as a test failure: a suite's setup reports it from each test).
absl::StatusOr<std::unique_ptr<LocalCluster>> TryStartCluster(
    const std::string& mesh, const std::string& tag, bool shm_transport = true,
    bool process_checks = true, const std::vector<std::string>& worker_flags = {});
// As TryStartCluster; null (with a test failure recorded) if it does not start.
// `shm_transport`, `process_checks`: as LocalClusterOptions (false: collectives over the gRPC
// ring only; a stopped worker found by its heartbeats or the collectives' deadlines only).
std::unique_ptr<LocalCluster> StartCluster(const std::string& mesh, const std::string& tag,
                                           bool shm_transport = true, bool process_checks = true,
                                           const std::vector<std::string>& worker_flags = {});

// The main job (seed 001's classifier on Fashion-MNIST, dropout on: the rng is part of what a
// resumed or recovered run must bring back) for `max_steps` steps, a report every step, no
// evaluation.
JobConfig PerStepJobConfig(int64_t max_steps);

// A test with a fresh directory of its own, root_ ($TMPDIR/<prefix><pid>-<test name>), removed
// when the test ends.
class TempRootTest : public ::testing::Test {
 protected:
  explicit TempRootTest(const std::string& prefix);
  ~TempRootTest() override;
  const std::filesystem::path root_;
};

// f32 standard normal samples from std::mt19937(seed).
Tensor NormalTensor(Dims dims, uint32_t seed);

// Puts `inputs` laid out as `program`'s in_specs (device_put), runs it and fetches result 0
// (device_get). On any error: the failure is recorded and the Tensor is empty.
Tensor RunShardMap(Client& client, const absl::StatusOr<v1::ShardMapProgram>& program,
                   const std::vector<const Tensor*>& inputs);

// As RunShardMap, returning every result (device_get); empty on any error (recorded).
std::vector<Tensor> RunShardMapAll(Client& client,
                                   const absl::StatusOr<v1::ShardMapProgram>& program,
                                   const std::vector<const Tensor*>& inputs);

// Base of a suite whose tests share one cluster for Derived::kMesh (logs tagged Derived::kTag),
// a client connected to it and the parsed mesh, started once per suite. A cluster that does not
// start fails every test of the suite in SetUp (a derived SetUp must call the base's): any
// failure recorded in SetUpTestSuite has GoogleTest 1.12 skip the suite's tests, which CTest
// counts as skipped, not failed.
//   class ShardMapE2ETest : public testing::ClusterSuite<ShardMapE2ETest> {
//    public:
//     static constexpr const char* kMesh = "i=4,j=2";
//     static constexpr const char* kTag = "shardmap";
//   };
template <typename Derived>
class ClusterSuite : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    mesh_ = new Mesh(*Mesh::Parse(Derived::kMesh));
    setup_error_ = new std::string;
    auto cluster = TryStartCluster(Derived::kMesh, Derived::kTag);
    if (!cluster.ok()) {
      *setup_error_ = cluster.status().ToString();
      return;
    }
    cluster_ = cluster->release();
    auto client = Client::Connect(cluster_->coordinator_address());
    if (!client.ok()) {
      *setup_error_ = client.status().ToString();
      return;
    }
    client_ = client->release();
  }
  void SetUp() override {
    ASSERT_TRUE(setup_error_->empty())
        << "the suite's cluster (" << Derived::kMesh << ") did not start: " << *setup_error_;
  }
  static void TearDownTestSuite() {
    delete client_;
    client_ = nullptr;
    if (cluster_ != nullptr) cluster_->Stop().IgnoreError();
    delete cluster_;
    cluster_ = nullptr;
    delete mesh_;
    mesh_ = nullptr;
    delete setup_error_;
    setup_error_ = nullptr;
  }
  static Tensor Run(const absl::StatusOr<v1::ShardMapProgram>& program,
                    const std::vector<const Tensor*>& inputs) {
    return RunShardMap(*client_, program, inputs);
  }

  static inline LocalCluster* cluster_ = nullptr;
  static inline Client* client_ = nullptr;
  static inline Mesh* mesh_ = nullptr;
  static inline std::string* setup_error_ = nullptr;  // why SetUpTestSuite failed, else empty
};

// Base of a suite whose tests share one cluster per mesh of Derived::kMeshes (a
// std::array<const char*, N>), logs tagged Derived::kTag, with a client for each:
//   class CheckpointE2ETest : public testing::MultiClusterSuite<CheckpointE2ETest> {
//    public:
//     static constexpr std::array<const char*, 2> kMeshes = {"data=2,model=4", "data=1,model=1"};
//     static constexpr const char* kTag = "checkpoint";
//   };
//   ... client("data=2,model=4") ...
template <typename Derived>
class MultiClusterSuite : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {  // failures reported by each test's SetUp: see ClusterSuite
    setup_error_.clear();
    for (const char* mesh : Derived::kMeshes) {
      auto cluster = TryStartCluster(mesh, Derived::kTag);
      if (!cluster.ok()) {
        setup_error_ = absl::StrCat(mesh, ": ", cluster.status().ToString());
        return;
      }
      clusters_[mesh] = cluster->release();
      auto client = Client::Connect(clusters_[mesh]->coordinator_address());
      if (!client.ok()) {
        setup_error_ = absl::StrCat(mesh, ": ", client.status().ToString());
        return;
      }
      clients_[mesh] = client->release();
    }
  }
  void SetUp() override {
    ASSERT_TRUE(setup_error_.empty()) << "a cluster of the suite did not start: " << setup_error_;
  }
  static void TearDownTestSuite() {
    for (auto& [mesh, client] : clients_) delete client;
    for (auto& [mesh, cluster] : clusters_) {
      cluster->Stop().IgnoreError();
      delete cluster;
    }
    clients_.clear();
    clusters_.clear();
  }
  static Client& client(const std::string& mesh) { return *clients_.at(mesh); }

  static inline std::map<std::string, LocalCluster*> clusters_;
  static inline std::map<std::string, Client*> clients_;
  static inline std::string setup_error_;  // why SetUpTestSuite failed, else empty
};

}  // namespace meshrun::testing

#endif  // MESHRUN_TESTS_TESTUTIL_CLUSTER_H_
