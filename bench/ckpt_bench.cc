// `meshrun bench ckpt`: save and restore a workload's TrainState on a real local cluster; the
// aggregate GB/s of each, and how long an async save blocks the step loop.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "bench/bench.h"
#include "bench/collective_timer.h"
#include "core/checkpoint/checkpoint.h"
#include "meshrun/client.h"
#include "meshrun/local_cluster.h"
#include "meshrun/workloads.h"

namespace meshrun {
namespace {

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int Fail(const absl::Status& s, const std::string& what) {
  std::fprintf(stderr, "meshrun bench ckpt: %s: %s\n", what.c_str(),
               std::string(s.message()).c_str());
  return 1;
}

}  // namespace

int RunCkptBench(const CkptBenchOptions& o) {
  namespace fs = std::filesystem;
  absl::StatusOr<Workload> w = SeedWorkload(o.workload);
  if (!w.ok()) return Fail(w.status(), o.workload);
  absl::StatusOr<nn::ShardingConfig> sharding = LayoutSharding(o.layout);
  if (!sharding.ok()) return Fail(sharding.status(), o.layout);
  absl::StatusOr<Mesh> mesh = Mesh::Parse(o.mesh);
  if (!mesh.ok()) return Fail(mesh.status(), o.mesh);
  absl::StatusOr<TrainStep> step =
      BuildTrainStep(*mesh, *sharding, w->optimizer, w->batch, w->loss, 0, w->num_minibatches);
  if (!step.ok()) return Fail(step.status(), "plan");
  auto cluster = StartBenchCluster(o.mesh, o.bin_dir, 0);
  if (cluster == nullptr) return 1;
  auto client = Client::Connect(cluster->coordinator_address());
  if (!client.ok()) return Fail(client.status(), "connect");
  absl::StatusOr<TrainState> state = TrainState::Init(client->get(), &*step);
  if (!state.ok()) return Fail(state.status(), "init");
  absl::StatusOr<std::vector<Tensor>> batch = SeedWorkloadBatch(*w);
  if (!batch.ok()) return Fail(batch.status(), "batch");
  std::vector<std::string> ids;
  for (size_t i = 0; i < batch->size(); ++i)
    ids.push_back((*client)->Put((*batch)[i], step->batch[i].spec)->id());
  const std::string root =
      o.dir.empty() ? (fs::temp_directory_path() / "meshrun-bench-ckpt").string() : o.dir;
  fs::remove_all(root);

  // The step time without saving, for reference.
  std::vector<double> plain;
  for (int i = 0; i < o.steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    if (auto l = state->Step(ids); !l.ok()) return Fail(l.status(), "step");
    plain.push_back(Seconds(t0));
  }
  std::sort(plain.begin(), plain.end());
  const double step_s = plain[plain.size() / 2];

  int64_t total_bytes = 0;
  for (const PlannedArray& a : step->state)
    total_bytes += NumElements(a.shape) * static_cast<int64_t>(sizeof(float));
  std::printf(
      "# %s, layout %s, mesh %s: TrainState %.1f MB (params + Adam state); checkpoint root %s\n",
      o.workload.c_str(), o.layout.c_str(), o.mesh.c_str(), total_bytes * 1e-6, root.c_str());
  std::printf("%-28s %10s %10s %10s\n", "operation", "seconds", "MB", "GB/s");
  for (int rep = 0; rep < o.repeats; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<std::string> path = state->Save(root, /*keep=*/1);
    const double save_s = Seconds(t0);
    if (!path.ok()) return Fail(path.status(), "save");
    int64_t bytes = 0;
    for (const auto& e : fs::directory_iterator(*path))
      bytes += static_cast<int64_t>(fs::file_size(e.path()));
    std::printf("%-28s %10.3f %10.1f %10.2f\n", "save (sync, fsynced)", save_s, bytes * 1e-6,
                bytes / save_s * 1e-9);
    // Restore from the page cache into the same layout, as a second copy of the state.
    t0 = std::chrono::steady_clock::now();
    absl::StatusOr<TrainState> restored =
        TrainState::Restore(client->get(), &*step, *path, "restored");
    const double restore_s = Seconds(t0);
    if (!restored.ok()) return Fail(restored.status(), "restore");
    std::printf("%-28s %10.3f %10.1f %10.2f\n", "restore (all workers)", restore_s, bytes * 1e-6,
                bytes / restore_s * 1e-9);
    // What the workers received in all: replicated arrays are read by every worker holding them.
    const double delivered = static_cast<double>(step->StateBytesPerWorker()) * mesh->size();
    std::printf("%-28s %10.3f %10.1f %10.2f\n", "  delivered to the workers", restore_s,
                delivered * 1e-6, delivered / restore_s * 1e-9);
    if (absl::Status s = restored->Delete(); !s.ok()) return Fail(s, "delete");
    // Async: how long the step loop is blocked by the save call, against one step's time.
    t0 = std::chrono::steady_clock::now();
    if (absl::Status s = state->SaveAsync(root, 1); !s.ok()) return Fail(s, "async save");
    const double blocked_s = Seconds(t0);
    int steps_during = 0;
    const auto t_async = std::chrono::steady_clock::now();
    if (auto l = state->Step(ids); !l.ok()) return Fail(l.status(), "step");
    ++steps_during;
    absl::StatusOr<std::string> done = state->WaitForSave();
    if (!done.ok()) return Fail(done.status(), "async save");
    std::printf("%-28s %10.3f %10s %10s  (step p50 %.3f s; %.2f steps; save+1 step took %.3f s)\n",
                "async save: loop blocked", blocked_s, "", "", step_s, blocked_s / step_s,
                Seconds(t_async));
  }
  std::fflush(stdout);
  cluster->Stop().IgnoreError();
  fs::remove_all(root);
  return 0;
}

}  // namespace meshrun
