// `meshrun train --workload`, `meshrun ckpt validate` and `meshrun export`: the SDK's derived
// train steps with sharded checkpoints, from the command line. A workload trains as a job (the
// coordinator's JobDriver, as the main job does), on the workload's own batch.
#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/cli/commands.h"
#include "core/checkpoint/checkpoint.h"
#include "meshrun/client.h"
#include "meshrun/job.h"
#include "meshrun/local_cluster.h"

namespace meshrun::cli {
namespace {

int Fail(const std::string& cmd, const absl::Status& s) {
  std::fprintf(stderr, "meshrun %s: %s\n", cmd.c_str(), std::string(s.message()).c_str());
  return s.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

// The job a workload's command line stands for: the workload's own model, optimizer and batch
// (data.dataset synthetic), seed 0, the layout or rules, `steps` (absolute: a resumed job runs up
// to it; 0: no step), a worker call every `steps_per_call` steps and the checkpoint flags.
absl::StatusOr<PlannedJob> PlanWorkload(const WorkloadTrainArgs& a) {
  JobConfig c;
  c.model.name = a.workload;
  c.sharding.layout = a.layout;
  c.sharding.rules = a.rules;
  c.sharding.fsdp_axis = a.fsdp_axis;
  c.sharding.min_weight_size = a.min_weight_size;
  c.data.dataset = "synthetic";
  c.train.seed = 0;
  c.train.log_every = std::max(1, a.steps_per_call);
  c.train.evaluate = false;
  c.precision.compute = a.precision;
  for (const auto& [path, given] : {std::pair{&c.checkpoint.dir, a.ckpt_dir},
                                    std::pair{&c.checkpoint.init_from, a.init_from}}) {
    if (!given.empty()) *path = std::filesystem::absolute(given).lexically_normal().string();
  }
  c.checkpoint.save_every = a.save_every;
  c.checkpoint.keep = a.keep;
  c.checkpoint.async = a.async_save;
  c.checkpoint.resume = a.resume;
  absl::StatusOr<Mesh> mesh = Mesh::Parse(a.mesh);
  if (!mesh.ok()) return mesh.status();
  absl::StatusOr<PlannedJob> job = PlanJob(c, *mesh);
  if (!job.ok()) return job.status();
  v1::TrainSchedule* schedule = job->spec.mutable_schedule();
  schedule->set_total_steps(a.steps);
  schedule->set_epochs(0);
  return job;
}

// The mesh of the cluster at `address` ("data=2,model=4"); a non-empty `given` must equal it.
absl::StatusOr<std::string> ClusterMeshText(Client& client, const std::string& address,
                                            const std::string& given) {
  absl::StatusOr<v1::GetStatusResponse> status = client.GetStatus();
  if (!status.ok()) return status.status();
  absl::StatusOr<Mesh> mesh = Mesh::FromProto(status->mesh());
  if (!mesh.ok()) return mesh.status();
  std::vector<std::string> axes;
  for (int a = 0; a < mesh->num_axes(); ++a) {
    axes.push_back(absl::StrCat(mesh->axis_name(a), "=", mesh->axis_size(a)));
  }
  const std::string text = absl::StrJoin(axes, ",");
  if (given.empty()) return text;
  absl::StatusOr<Mesh> wanted = Mesh::Parse(given);
  if (!wanted.ok()) return wanted.status();
  if (!(*wanted == *mesh)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--mesh ", given, " is not the mesh of the cluster at ", address, " (", text, ")"));
  }
  return text;
}

}  // namespace

int TrainWorkload(const WorkloadTrainArgs& args) {
  const std::string cmd = "train";
  WorkloadTrainArgs a = args;
  if (a.resume && a.ckpt_dir.empty())
    return Fail(cmd, absl::InvalidArgumentError("--resume needs --ckpt-dir"));
  std::unique_ptr<Client> running;  // the cluster at a.coordinator: plan for its mesh
  if (!a.coordinator.empty()) {
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(a.coordinator);
    if (!c.ok()) return Fail(cmd, c.status());
    running = *std::move(c);
    absl::StatusOr<std::string> mesh = ClusterMeshText(*running, a.coordinator, a.mesh);
    if (!mesh.ok()) return Fail(cmd, mesh.status());
    a.mesh = *mesh;
  }
  absl::StatusOr<PlannedJob> job = PlanWorkload(a);
  if (!job.ok()) return Fail(cmd, job.status());
  std::unique_ptr<LocalCluster> cluster;
  if (running == nullptr) {
    LocalClusterOptions o;
    o.mesh = a.mesh;
    o.log_dir = a.log_dir;
    std::fprintf(stderr, "starting a local cluster (mesh %s)\n", o.mesh.c_str());
    absl::StatusOr<std::unique_ptr<LocalCluster>> started = LocalCluster::Start(o);
    if (!started.ok()) return Fail(cmd, started.status());
    cluster = *std::move(started);
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(cluster->coordinator_address());
    if (!c.ok()) {
      cluster->Stop().IgnoreError();
      return Fail(cmd, c.status());
    }
    running = *std::move(c);
  }
  // The coordinator's JobDriver runs the job; each report carries its steps' losses.
  absl::StatusOr<TrainResult> result = running->Train(*std::move(job), [](const v1::JobEvent& e) {
    if (e.has_info()) std::printf("%s\n", e.info().c_str());
    if (e.has_worker_lost() || e.has_recovered())
      std::printf("%s\n", FormatRecoveryEvent(e).c_str());
    if (e.has_step()) {
      const int64_t first = e.step().step() - e.step().losses_size() + 1;
      for (int k = 0; k < e.step().losses_size(); ++k) {
        std::printf("step %lld loss %.9g\n", static_cast<long long>(first + k), e.step().losses(k));
      }
    }
    std::fflush(stdout);
  });
  if (cluster) cluster->Stop().IgnoreError();
  if (!result.ok()) return Fail(cmd, result.status());
  return 0;
}

namespace {

// The first line of every `ckpt validate` report: the checkpoint and what it holds.
void PrintCheckpointHeader(const std::string& path, const checkpoint::Manifest& m) {
  std::printf("checkpoint %s: step %lld, saved on %s, %zu arrays\n", path.c_str(),
              static_cast<long long>(m.step), m.mesh.c_str(), m.arrays.size());
}

// Prints what ValidateRestore found; exit 0 when restorable.
int ReportRestore(const std::string& path, const checkpoint::Manifest* m,
                  const std::vector<checkpoint::WantedArray>& wanted, const Mesh& mesh,
                  const std::string& layout, const std::string& mesh_text) {
  checkpoint::RestoreReport r = checkpoint::ValidateRestore(*m, wanted, mesh);
  for (std::string& e : checkpoint::VerifyBlocks(path, *m)) r.errors.push_back(std::move(e));
  PrintCheckpointHeader(path, *m);
  for (const std::string& e : r.extra) std::printf("  extra array (not restored): %s\n", e.c_str());
  for (const std::string& e : r.errors) std::printf("  ERROR %s\n", e.c_str());
  for (size_t rank = 0; rank < r.bytes_per_worker.size(); ++rank) {
    std::printf("  worker %zu would read %lld bytes\n", rank,
                static_cast<long long>(r.bytes_per_worker[rank]));
  }
  std::printf(r.errors.empty() ? "OK: restorable as %s on %s\n" : "NOT restorable as %s on %s\n",
              layout.c_str(), mesh_text.c_str());
  return r.errors.empty() ? 0 : 1;
}

}  // namespace

int CkptValidate(const std::string& path, const WorkloadTrainArgs& workload) {
  const std::string cmd = "ckpt validate";
  absl::StatusOr<checkpoint::Manifest> m = checkpoint::ReadManifest(path);
  if (!m.ok()) return Fail(cmd, m.status());
  absl::StatusOr<PlannedJob> job = PlanWorkload(workload);
  if (!job.ok()) return Fail(cmd, job.status());
  std::vector<checkpoint::WantedArray> wanted;
  for (const PlannedArray& a : job->step.state)
    wanted.push_back({a.name, a.dtype, a.shape, a.spec});
  const std::string layout =
      !workload.layout.empty() ? workload.layout : absl::StrCat("rules ", workload.rules);
  return ReportRestore(path, &*m, wanted, job->step.mesh, layout, workload.mesh);
}

int CkptValidateJob(const std::string& path, const std::string& config_path,
                    const std::string& mesh_text) {
  const std::string cmd = "ckpt validate";
  absl::StatusOr<JobConfig> config = LoadJobConfig(config_path);
  if (!config.ok()) return Fail(cmd, config.status());
  absl::StatusOr<checkpoint::Manifest> m = checkpoint::ReadManifest(path);
  if (!m.ok()) return Fail(cmd, m.status());
  absl::StatusOr<PlannedJob> job = PlanConfigJob(*config, mesh_text);
  if (!job.ok()) return Fail(cmd, job.status());
  std::vector<checkpoint::WantedArray> wanted;
  for (const PlannedArray& a : job->step.state)
    wanted.push_back({a.name, a.dtype, a.shape, a.spec});
  return ReportRestore(path, &*m, wanted, job->step.mesh,
                       absl::StrCat("the TrainState of ", config_path), job->step.mesh.ToString());
}

int CkptValidateAlone(const std::string& path, const std::string& mesh_text) {
  const std::string cmd = "ckpt validate";
  absl::StatusOr<checkpoint::Manifest> m = checkpoint::ReadManifest(path);
  if (!m.ok()) return Fail(cmd, m.status());
  std::vector<checkpoint::WantedArray> wanted;
  for (const checkpoint::ArrayEntry& a : m->arrays)
    wanted.push_back({a.name, a.dtype, a.shape, a.spec});
  if (!mesh_text.empty()) {
    absl::StatusOr<Mesh> mesh = Mesh::Parse(mesh_text);
    if (!mesh.ok()) return Fail(cmd, mesh.status());
    return ReportRestore(path, &*m, wanted, *mesh, "saved", mesh_text);
  }
  const std::vector<std::string> errors = checkpoint::VerifyBlocks(path, *m);
  PrintCheckpointHeader(path, *m);
  for (const std::string& e : errors) std::printf("  ERROR %s\n", e.c_str());
  std::printf(errors.empty() ? "OK: every block is sound (size and CRC-32)\n"
                             : "NOT sound: %zu bad blocks\n",
              errors.size());
  return errors.empty() ? 0 : 1;
}

int Export(const std::string& path, const std::string& out) {
  const std::string cmd = "export";
  absl::StatusOr<checkpoint::Manifest> m = checkpoint::ReadManifest(path);
  if (!m.ok()) return Fail(cmd, m.status());
  std::vector<Tensor> arrays;
  std::vector<std::string> names;
  for (const checkpoint::ArrayEntry& a : m->arrays) {
    if (a.name.rfind("params/", 0) != 0) continue;  // the parameters only, as Flax's params tree
    absl::StatusOr<Tensor> t = checkpoint::ReadArray(path, a);
    if (!t.ok()) return Fail(cmd, t.status());
    arrays.push_back(*std::move(t));
    names.push_back(a.name);
  }
  std::vector<std::pair<std::string, const Tensor*>> tensors;
  for (size_t i = 0; i < arrays.size(); ++i) tensors.emplace_back(names[i], &arrays[i]);
  absl::StatusOr<std::vector<int64_t>> written = checkpoint::WriteSafetensors(
      out, tensors, {{"format", "pt"}, {"source", path}, {"step", absl::StrCat(m->step)}});
  if (!written.ok()) return Fail(cmd, written.status());
  std::printf("wrote %zu parameters to %s\n", tensors.size(), out.c_str());
  return 0;
}

}  // namespace meshrun::cli
