// `meshrun bench step`: the seeds' workloads under each layout on a real local cluster, timed
// from the client (one ShardMap call per step, as a user's step loop runs).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "bench/bench.h"
#include "bench/collective_timer.h"
#include "core/port/process.h"
#include "meshrun/client.h"
#include "meshrun/local_cluster.h"
#include "meshrun/workloads.h"

namespace meshrun {
namespace {

int Fail(const absl::Status& s, const std::string& what) {
  std::fprintf(stderr, "meshrun bench step: %s: %s\n", what.c_str(),
               std::string(s.message()).c_str());
  return 1;
}

}  // namespace

int RunStepBench(const StepBenchOptions& o) {
  std::printf(
      "# train steps derived by autodiff, partitioned per layout; mesh %s (single: 1 worker); "
      "%d step(s) per call; %s compute\n",
      o.mesh.c_str(), o.steps_per_call, DTypeName(o.dtype).c_str());
  std::printf("%-13s %-8s %7s %11s %11s %10s %10s %14s %14s\n", "workload", "layout", "workers",
              "step p50 ms", "samples/s", "loss[0]", "loss[-1]", "state MB/wkr", "peak RSS MB");
  for (const std::string& name : o.workloads) {
    absl::StatusOr<Workload> w = SeedWorkload(name, {o.dtype});
    if (!w.ok()) return Fail(w.status(), name);
    absl::StatusOr<std::vector<Tensor>> batch = SeedWorkloadBatch(*w);
    if (!batch.ok()) return Fail(batch.status(), name);
    for (const std::string& layout : o.layouts) {
      const std::string mesh_text = layout == "single" ? "data=1,model=1" : o.mesh;
      absl::StatusOr<nn::ShardingConfig> sharding = LayoutSharding(layout);
      if (!sharding.ok()) return Fail(sharding.status(), layout);
      absl::StatusOr<Mesh> mesh = Mesh::Parse(mesh_text);
      if (!mesh.ok()) return Fail(mesh.status(), mesh_text);
      absl::StatusOr<TrainStep> step =
          BuildTrainStep(*mesh, *sharding, w->optimizer, w->batch, w->loss, 0, w->num_minibatches);
      if (!step.ok()) {
        std::printf("%-13s %-8s  (not plannable on %s: %s)\n", name.c_str(), layout.c_str(),
                    mesh_text.c_str(), std::string(step.status().message()).c_str());
        continue;
      }
      auto cluster = StartBenchCluster(mesh_text, o.bin_dir, 0, o.shm_transport);
      if (cluster == nullptr) return 1;
      auto client = Client::Connect(cluster->coordinator_address());
      if (!client.ok()) return Fail(client.status(), "connect");
      absl::StatusOr<TrainState> state = TrainState::Init(client->get(), &*step);
      if (!state.ok()) return Fail(state.status(), "init");
      std::vector<std::string> ids;
      for (size_t i = 0; i < batch->size(); ++i) {
        auto info = (*client)->Put((*batch)[i], step->batch[i].spec);
        if (!info.ok()) return Fail(info.status(), "put batch");
        ids.push_back(info->id());
      }
      std::vector<double> ms;  // per step: each call's time over its steps
      std::vector<float> losses;
      const int per_call = std::max(1, o.steps_per_call);
      const int calls = o.warmup + std::max(1, o.steps / per_call);
      for (int i = 0; i < calls; ++i) {
        const int n = i < o.warmup ? 1 : per_call;  // warm-up calls are single steps
        const auto t0 = std::chrono::steady_clock::now();
        absl::StatusOr<std::vector<float>> got =
            state->Steps(std::vector<std::vector<std::string>>(n, ids));
        const auto t1 = std::chrono::steady_clock::now();
        if (!got.ok()) return Fail(got.status(), absl::StrCat(name, " ", layout, " call ", i));
        losses.insert(losses.end(), got->begin(), got->end());
        if (i >= o.warmup)
          ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count() / n);
      }
      std::sort(ms.begin(), ms.end());
      const double p50 = ms.empty() ? 0 : ms[ms.size() / 2];
      int64_t peak = 0;
      for (pid_t pid : cluster->worker_pids())
        peak = std::max(peak, ProcessStatusBytes(pid, "VmHWM"));
      std::printf("%-13s %-8s %7d %11.1f %11.0f %10.4f %10.4f %14.1f %14.1f\n", name.c_str(),
                  layout.c_str(), mesh->size(), p50, p50 > 0 ? w->examples_per_step * 1e3 / p50 : 0,
                  losses.front(), losses.back(), step->StateBytesPerWorker() / 1e6, peak / 1e6);
      std::fflush(stdout);
      cluster->Stop().IgnoreError();
    }
  }
  return 0;
}

}  // namespace meshrun
