#include "tests/testutil/cluster.h"

#include <unistd.h>

#include <deque>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

namespace meshrun::testing {

namespace {

// Prints the end of every process log of the clusters a failed test used (those it started, and
// its suite's), so that a failure on a machine that is gone afterwards (CI) shows what the
// coordinator and the workers said. Appended to gtest's listeners (which own it) on first use.
class ClusterLogsOnFailure : public ::testing::EmptyTestEventListener {
 public:
  static ClusterLogsOnFailure& Get() {
    static ClusterLogsOnFailure* listener = [] {
      auto* l = new ClusterLogsOnFailure;
      ::testing::UnitTest::GetInstance()->listeners().Append(l);
      return l;
    }();
    return *listener;
  }

  void Watch(const std::string& dir) {
    absl::MutexLock lock(&mu_);
    (in_test_ ? test_dirs_ : suite_dirs_).push_back(dir);
  }

  void OnTestStart(const ::testing::TestInfo&) override {
    absl::MutexLock lock(&mu_);
    in_test_ = true;
  }

  void OnTestEnd(const ::testing::TestInfo& info) override {
    absl::MutexLock lock(&mu_);
    in_test_ = false;
    if (info.result()->Failed()) {
      for (const auto* dirs : {&suite_dirs_, &test_dirs_})
        for (const std::string& dir : *dirs) PrintLogTails(dir);
    }
    test_dirs_.clear();
  }

  void OnTestSuiteEnd(const ::testing::TestSuite&) override {
    absl::MutexLock lock(&mu_);
    suite_dirs_.clear();
  }

 private:
  static void PrintLogTails(const std::string& dir) {
    constexpr size_t kLines = 25;
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
      if (entry.path().extension() != ".log") continue;
      std::ifstream in(entry.path());
      std::deque<std::string> tail;
      for (std::string line; std::getline(in, line);) {
        tail.push_back(std::move(line));
        if (tail.size() > kLines) tail.pop_front();
      }
      std::cerr << "---- last " << tail.size() << " lines of " << entry.path().string() << "\n";
      for (const std::string& line : tail) std::cerr << line << "\n";
    }
  }

  absl::Mutex mu_;
  bool in_test_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::string> suite_dirs_ ABSL_GUARDED_BY(mu_);  // started outside a test
  std::vector<std::string> test_dirs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<LocalCluster> StartCluster(const std::string& mesh, const std::string& tag,
                                           bool shm_transport, bool process_checks,
                                           const std::vector<std::string>& worker_flags) {
  auto c = TryStartCluster(mesh, tag, shm_transport, process_checks, worker_flags);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

absl::StatusOr<std::unique_ptr<LocalCluster>> TryStartCluster(
    const std::string& mesh, const std::string& tag, bool shm_transport, bool process_checks,
    const std::vector<std::string>& worker_flags) {
  LocalClusterOptions o;
  o.worker_flags = worker_flags;
  o.mesh = mesh;
  o.shm_transport = shm_transport;
  o.process_checks = process_checks;
  o.log_dir = absl::StrCat(::testing::TempDir(), "/meshrun-", tag, "-", mesh,
                           shm_transport ? "" : "-grpc", "-", getpid());
  ClusterLogsOnFailure::Get().Watch(o.log_dir);
  return LocalCluster::Start(o);
}

TempRootTest::TempRootTest(const std::string& prefix)
    : root_((std::filesystem::temp_directory_path() /
             absl::StrCat(prefix, getpid(), "-",
                          ::testing::UnitTest::GetInstance()->current_test_info()->name()))) {
  std::filesystem::remove_all(root_);
  std::filesystem::create_directories(root_);
}

TempRootTest::~TempRootTest() { std::filesystem::remove_all(root_); }

JobConfig PerStepJobConfig(int64_t max_steps) {
  JobConfig c;
  c.train.max_steps = max_steps;
  c.train.log_every = 1;
  c.train.evaluate = false;
  return c;
}

Tensor NormalTensor(Dims dims, uint32_t seed) {
  Tensor t(v1::DTYPE_F32, std::move(dims));
  std::mt19937 rng(seed);
  std::normal_distribution<float> d;
  for (int64_t i = 0; i < t.num_elements(); ++i) t.data<float>()[i] = d(rng);
  return t;
}

std::vector<Tensor> RunShardMapAll(Client& client,
                                   const absl::StatusOr<v1::ShardMapProgram>& program,
                                   const std::vector<const Tensor*>& inputs) {
  EXPECT_TRUE(program.ok()) << program.status();
  if (!program.ok()) return {};
  std::vector<std::string> ids;
  for (size_t i = 0; i < inputs.size(); ++i) {
    auto info = client.Put(*inputs[i], PartitionSpec::FromProto(program->in_specs(i)));
    EXPECT_TRUE(info.ok()) << info.status();
    if (!info.ok()) return {};
    ids.push_back(info->id());
  }
  auto outs = client.ShardMap(*program, ids);
  EXPECT_TRUE(outs.ok()) << outs.status();
  if (!outs.ok()) return {};
  std::vector<Tensor> results;
  for (const auto& o : *outs) {
    auto result = client.Get(o.id());
    EXPECT_TRUE(result.ok()) << result.status();
    if (!result.ok()) return {};
    results.push_back(*std::move(result));
  }
  return results;
}

Tensor RunShardMap(Client& client, const absl::StatusOr<v1::ShardMapProgram>& program,
                   const std::vector<const Tensor*>& inputs) {
  std::vector<Tensor> results = RunShardMapAll(client, program, inputs);
  return results.empty() ? Tensor() : std::move(results[0]);
}

}  // namespace meshrun::testing
