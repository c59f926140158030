#include <cstdio>

#include "absl/strings/str_cat.h"
#include "bench/bench.h"
#include "bench/collective_timer.h"
#include "meshrun/client.h"
#include "meshrun/local_cluster.h"

namespace meshrun {

int RunTrainBench(const TrainBenchOptions& o) {
  std::printf(
      "# main job (DPClassifier, Fashion-MNIST, global batch 128, %d minibatch(es), AdamW, %s "
      "compute, gradients reduced in %s, %s)\n",
      o.num_minibatches, o.precision.c_str(), o.reduce.c_str(),
      o.shm_transport ? "shared memory" : "gRPC ring");
  std::printf("%8s %8s %14s %10s %14s %16s\n", "workers", "steps", "samples/s", "loss", "step (ms)",
              "all-reduce (ms)");
  for (int n : o.workers) {
    auto cluster =
        StartBenchCluster(absl::StrCat("data=", n), o.bin_dir, 0, o.shm_transport, o.insecure);
    if (cluster == nullptr) return 1;
    auto client = Client::Connect(cluster->coordinator_address());
    if (!client.ok()) return 1;
    JobConfig config;
    config.train.max_steps = o.steps;
    config.train.log_every = std::max(1, o.steps / 5);
    config.train.evaluate = false;
    config.precision.compute = o.precision;
    config.precision.reduce = o.reduce;
    config.optimizer.num_minibatches = o.num_minibatches;
    auto result = (*client)->Train(config);
    if (!result.ok()) {
      std::fprintf(stderr, "meshrun bench: %s\n", std::string(result.status().message()).c_str());
      return 1;
    }
    // Steady state: skip the first interval (warm-up: page faults, connection set-up).
    double samples = 0, seconds = 0, step_ms = 0, collective_ms = 0;
    for (size_t i = 1; i < result->reports.size(); ++i) {
      const auto& r = result->reports[i];
      const double block_samples = (r.step() - result->reports[i - 1].step()) * 128.0;
      samples += block_samples;
      seconds += block_samples / r.samples_per_second();
      step_ms += r.step_seconds() * 1e3 / (result->reports.size() - 1);
      collective_ms += r.collective_seconds() * 1e3 / (result->reports.size() - 1);
    }
    std::printf("%8d %8d %14.0f %10.4f %14.2f %16.2f\n", n, o.steps, samples / seconds,
                result->reports.back().loss(), step_ms, collective_ms);
    std::fflush(stdout);
    cluster->Stop().IgnoreError();
  }
  return 0;
}

}  // namespace meshrun
