// `meshrun train --workload`, `meshrun ckpt validate` and `meshrun export`: the SDK's derived
// train steps with sharded checkpoints, from the command line.
#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/cli/commands.h"
#include "core/checkpoint/checkpoint.h"
#include "core/sharding/logical_axes.h"
#include "meshrun/client.h"
#include "meshrun/local_cluster.h"
#include "meshrun/train_step.h"
#include "meshrun/workloads.h"

namespace meshrun::cli {
namespace {

int Fail(const std::string& cmd, const absl::Status& s) {
  std::fprintf(stderr, "meshrun %s: %s\n", cmd.c_str(), std::string(s.message()).c_str());
  return s.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

absl::StatusOr<TrainStep> PlanWorkload(const WorkloadTrainArgs& a) {
  absl::StatusOr<Workload> w = SeedWorkload(a.workload);
  if (!w.ok()) return w.status();
  absl::StatusOr<nn::ShardingConfig> sharding =
      WorkloadSharding(a.layout, a.rules, a.fsdp_axis, a.min_weight_size);
  if (!sharding.ok()) return sharding.status();
  absl::StatusOr<Mesh> mesh = Mesh::Parse(a.mesh);
  if (!mesh.ok()) return mesh.status();
  return BuildTrainStep(*mesh, *sharding, w->optimizer, w->batch, w->loss, 0, w->num_minibatches);
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
  std::unique_ptr<Client> running;  // the cluster at a.coordinator: plan for its mesh
  if (!a.coordinator.empty()) {
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(a.coordinator);
    if (!c.ok()) return Fail(cmd, c.status());
    running = *std::move(c);
    absl::StatusOr<std::string> mesh = ClusterMeshText(*running, a.coordinator, a.mesh);
    if (!mesh.ok()) return Fail(cmd, mesh.status());
    a.mesh = *mesh;
  }
  absl::StatusOr<TrainStep> step = PlanWorkload(a);
  if (!step.ok()) return Fail(cmd, step.status());
  absl::StatusOr<Workload> w = SeedWorkload(a.workload);
  absl::StatusOr<std::vector<Tensor>> batch = SeedWorkloadBatch(*w);
  if (!batch.ok()) return Fail(cmd, batch.status());
  std::unique_ptr<LocalCluster> cluster;
  std::string address = a.coordinator;
  if (address.empty()) {
    LocalClusterOptions o;
    o.mesh = a.mesh;
    o.log_dir = a.log_dir;
    std::fprintf(stderr, "starting a local cluster (mesh %s)\n", o.mesh.c_str());
    absl::StatusOr<std::unique_ptr<LocalCluster>> started = LocalCluster::Start(o);
    if (!started.ok()) return Fail(cmd, started.status());
    cluster = *std::move(started);
    address = cluster->coordinator_address();
  }
  auto stop = [&](int code) {
    if (cluster) cluster->Stop().IgnoreError();
    return code;
  };
  absl::StatusOr<std::unique_ptr<Client>> client =
      running != nullptr ? absl::StatusOr<std::unique_ptr<Client>>(std::move(running))
                         : Client::Connect(address);
  if (!client.ok()) return stop(Fail(cmd, client.status()));
  absl::StatusOr<TrainState> state = absl::UnknownError("unset");
  if (a.resume) {
    if (a.ckpt_dir.empty())
      return stop(Fail(cmd, absl::InvalidArgumentError("--resume needs --ckpt-dir")));
    absl::StatusOr<std::string> latest = checkpoint::LatestCheckpoint(a.ckpt_dir);
    if (!latest.ok()) return stop(Fail(cmd, latest.status()));
    std::printf("resuming from %s\n", latest->c_str());
    state = TrainState::Restore(client->get(), &*step, *latest);
  } else if (!a.init_from.empty()) {
    state = TrainState::InitFrom(client->get(), &*step, a.init_from);
  } else {
    state = TrainState::Init(client->get(), &*step);
  }
  if (!state.ok()) return stop(Fail(cmd, state.status()));
  std::vector<std::string> ids;
  for (size_t i = 0; i < batch->size(); ++i) {
    absl::StatusOr<v1::ArrayInfo> info = (*client)->Put((*batch)[i], step->batch[i].spec);
    if (!info.ok()) return stop(Fail(cmd, info.status()));
    ids.push_back(info->id());
  }
  const auto save = [&]() -> absl::Status {
    if (a.ckpt_dir.empty()) return absl::OkStatus();
    if (a.async_save) return state->SaveAsync(a.ckpt_dir, a.keep);
    absl::StatusOr<std::string> path = state->Save(a.ckpt_dir, a.keep);
    if (path.ok()) std::printf("saved %s\n", path->c_str());
    return path.status();
  };
  while (state->steps() < a.steps) {
    // A call never runs past the next checkpoint.
    int64_t n = std::min<int64_t>(std::max(1, a.steps_per_call), a.steps - state->steps());
    if (a.save_every > 0) n = std::min<int64_t>(n, a.save_every - state->steps() % a.save_every);
    const int64_t first = state->steps() + 1;
    absl::StatusOr<std::vector<float>> losses =
        state->Steps(std::vector<std::vector<std::string>>(n, ids));
    if (!losses.ok()) return stop(Fail(cmd, losses.status()));
    for (size_t k = 0; k < losses->size(); ++k) {
      std::printf("step %lld loss %.9g\n", static_cast<long long>(first + k), (*losses)[k]);
      // Before any save of this state: a non-finite loss is never checkpointed.
      if (absl::Status s = CheckLossFinite(first + k, (*losses)[k]); !s.ok())
        return stop(Fail(cmd, s));
    }
    if (a.save_every > 0 && state->steps() % a.save_every == 0 && state->steps() < a.steps) {
      if (absl::Status s = save(); !s.ok()) return stop(Fail(cmd, s));
    }
  }
  // Always at the end of the job.
  if (absl::Status s = save(); !s.ok()) return stop(Fail(cmd, s));
  if (a.async_save && !a.ckpt_dir.empty()) {
    absl::StatusOr<std::string> path = state->WaitForSave();
    if (!path.ok()) return stop(Fail(cmd, path.status()));
    std::printf("saved %s\n", path->c_str());
  }
  std::fflush(stdout);
  return stop(0);
}

namespace {

// Prints what ValidateRestore found; exit 0 when restorable.
int ReportRestore(const std::string& path, const checkpoint::Manifest* m,
                  const std::vector<checkpoint::WantedArray>& wanted, const Mesh& mesh,
                  const std::string& layout, const std::string& mesh_text) {
  checkpoint::RestoreReport r = checkpoint::ValidateRestore(*m, wanted, mesh);
  for (std::string& e : checkpoint::VerifyBlocks(path, *m)) r.errors.push_back(std::move(e));
  std::printf("checkpoint %s: step %lld, saved on %s, %zu arrays\n", path.c_str(),
              static_cast<long long>(m->step), m->mesh.c_str(), m->arrays.size());
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
  absl::StatusOr<TrainStep> step = PlanWorkload(workload);
  if (!step.ok()) return Fail(cmd, step.status());
  std::vector<checkpoint::WantedArray> wanted;
  for (const PlannedArray& a : step->state) wanted.push_back({a.name, a.dtype, a.shape, a.spec});
  const std::string layout =
      !workload.layout.empty() ? workload.layout : absl::StrCat("rules ", workload.rules);
  return ReportRestore(path, &*m, wanted, step->mesh, layout, workload.mesh);
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
