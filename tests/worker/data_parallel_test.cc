// Data-parallel equivalence: with dropout off, 8 workers (threads over the in-process transport)
// and 1 worker produce the same loss at each of the first 20 steps from the same seed.
#include <thread>

#include "core/collectives/in_process_transport.h"
#include "core/config/job_config.h"
#include "core/program/dp_classifier.h"
#include "gtest/gtest.h"
#include "worker/trainer.h"

namespace meshrun {
namespace {

constexpr const char* kData = "/usr/share/datasets/fashion-mnist";

struct Datasets {
  std::shared_ptr<const ImageDataset> train, test;
};

const Datasets& LoadData() {
  static Datasets* d = [] {
    auto* out = new Datasets;
    out->train = std::make_shared<ImageDataset>(*LoadFashionMnist(kData, "train"));
    out->test = std::make_shared<ImageDataset>(*LoadFashionMnist(kData, "test"));
    return out;
  }();
  return *d;
}

// Mean loss over the global batch at each step, for a run on `world` workers.
std::vector<double> TrainLosses(int world, int steps, double dropout) {
  JobConfig config;
  config.model.dropout_rate = dropout;
  Mesh mesh = *Mesh::Create({{"data", world}});
  absl::StatusOr<v1::StepProgram> program = BuildDpClassifierProgram(config, mesh);
  EXPECT_TRUE(program.ok()) << program.status();
  auto transports = CreateInProcessTransports(world);
  std::vector<std::vector<StepResult>> results(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      Executor::Options eo;
      eo.mesh = &mesh;
      eo.rank = r;
      eo.transport = transports[r].get();
      eo.init_key = MakePRNGKey(config.train.seed);
      auto ex = Executor::Create(*program, eo);
      ASSERT_TRUE(ex.ok()) << ex.status();
      Trainer::Options to;
      to.seed = config.train.seed;
      to.global_batch_size = config.data.batch_size;
      to.compute_threads = 1;
      auto trainer = Trainer::Create(*std::move(ex), LoadData().train, LoadData().test, to);
      ASSERT_TRUE(trainer.ok()) << trainer.status();
      for (int s = 0; s < steps; ++s) {
        auto res = (*trainer)->RunStep(s);
        ASSERT_TRUE(res.ok()) << res.status();
        results[r].push_back(*res);
      }
    });
  }
  for (auto& t : threads) t.join();
  std::vector<double> losses(steps, 0.0);
  for (int s = 0; s < steps; ++s) {
    double sum = 0;
    int64_t count = 0;
    for (int r = 0; r < world; ++r) {
      if (results[r].size() <= static_cast<size_t>(s)) return {};
      sum += results[r][s].loss_sum;
      count += results[r][s].count;
    }
    losses[s] = sum / count;
  }
  return losses;
}

TEST(DataParallelTest, EightWorkersMatchOneWorker) {
  std::vector<double> one = TrainLosses(1, 20, 0.0);
  std::vector<double> eight = TrainLosses(8, 20, 0.0);
  ASSERT_EQ(one.size(), 20u);
  ASSERT_EQ(eight.size(), 20u);
  for (int s = 0; s < 20; ++s) {
    EXPECT_LE(std::abs(one[s] - eight[s]) / std::abs(one[s]), 1e-4)
        << "step " << s << ": 1 worker " << one[s] << ", 8 workers " << eight[s];
  }
  // The model learns: the loss fell over 20 steps.
  EXPECT_LT(one[19], one[0] - 0.5);
}

TEST(DataParallelTest, DropoutMasksDifferAcrossWorkersAndChangeTheLoss) {
  std::vector<double> with = TrainLosses(2, 3, 0.5);
  std::vector<double> without = TrainLosses(2, 3, 0.0);
  ASSERT_EQ(with.size(), 3u);
  ASSERT_EQ(without.size(), 3u);
  EXPECT_NE(with[0], without[0]);
}

}  // namespace
}  // namespace meshrun
