#include "client/cli/commands.h"

#include <poll.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/port/process.h"
#include "core/sharding/logical_axes.h"
#include "core/sharding/mesh.h"
#include "core/sharding/named_sharding.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "meshrun/client.h"
#include "meshrun/job.h"
#include "meshrun/local_cluster.h"
#include "meshrun/workloads.h"
#include "net/credentials.h"
#include "net/grpc_util.h"

namespace meshrun::cli {
namespace {

std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop.store(true); }

// Waits up to `timeout` for standard input: true once it has ended (EOF, a hang-up, or no
// standard input at all); what arrives on it is read and dropped.
bool StdinEnded(absl::Duration timeout) {
  pollfd in{STDIN_FILENO, POLLIN, 0};
  const int n = poll(&in, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout)));
  if (n < 0) return errno != EINTR;
  if (n == 0) return false;
  if (in.revents & (POLLERR | POLLNVAL)) return true;
  char buf[256];
  const ssize_t got = read(STDIN_FILENO, buf, sizeof(buf));
  return got == 0 || (got < 0 && errno != EINTR && errno != EAGAIN);
}

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "meshrun: %s\n", std::string(s.message()).c_str());
  return 1;
}

}  // namespace

int CertsInit(const std::string& dir) {
  if (absl::Status s = InitCredentials(dir); !s.ok()) return Fail(s);
  std::printf(
      "wrote the cluster's CA, node certificate and client token to %s\n"
      "nodes:   meshrun-coordinator --tls_dir %s ...; meshrun-worker --tls_dir %s ...\n"
      "clients: export %s=%s\n",
      dir.c_str(), dir.c_str(), dir.c_str(), kTlsDirEnv, dir.c_str());
  return 0;
}

int Up(const UpArgs& args) {
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  LocalClusterOptions o;
  o.insecure = args.insecure;
  o.tls_dir = args.tls_dir;
  if (!o.insecure && o.tls_dir.empty()) {
    // The credentials the CLI's clients use in this environment (DefaultClientCredentials):
    // MESHRUN_INSECURE=1, else MESHRUN_TLS_DIR, else ~/.meshrun/tls.
    const char* insecure = std::getenv(kInsecureEnv);
    const char* env_dir = std::getenv(kTlsDirEnv);
    const char* home = std::getenv("HOME");
    o.insecure = insecure != nullptr && std::string(insecure) == "1";
    o.tls_dir = env_dir != nullptr && *env_dir != '\0'
                    ? std::string(env_dir)
                    : absl::StrCat(home != nullptr ? home : ".", "/.meshrun/tls");
  }
  if (!o.insecure && args.tls_dir.empty()) {
    if (!std::filesystem::exists(o.tls_dir + "/ca.pem")) {
      if (absl::Status s = InitCredentials(o.tls_dir); !s.ok()) return Fail(s);
      std::printf("made the cluster's credentials in %s\n", o.tls_dir.c_str());
    }
  }
  if (o.insecure) std::printf("WARNING: --insecure: no TLS, no authentication\n");
  o.mesh = args.mesh;
  o.port = args.port;
  o.log_dir = args.log_dir;
  o.shm_transport = !args.no_shm;
  o.respawn_workers = !args.no_respawn;  // a lost worker is replaced (elastic recovery)
  auto cluster = LocalCluster::Start(o);
  if (!cluster.ok()) return Fail(cluster.status());
  std::printf(
      "meshrun cluster up: coordinator %s, %zu workers, mesh %s\nlogs: %s\n%s%s%spress Ctrl-C to "
      "stop\n",
      (*cluster)->coordinator_address().c_str(), (*cluster)->worker_pids().size(),
      args.mesh.c_str(), (*cluster)->log_dir().c_str(),
      o.insecure ? "" : "credentials: ", o.tls_dir.c_str(),
      o.insecure ? "" : " (clients: MESHRUN_TLS_DIR, default ~/.meshrun/tls)\n");
  std::fflush(stdout);
  // A remote `meshrun shutdown` ends the coordinator: it is then gone or a zombie (ours to reap).
  while (!g_stop.load()) {
    if (!ProcessAlive((*cluster)->coordinator_pid())) break;
    if (!args.stop_on_stdin_eof) {
      absl::SleepFor(absl::Milliseconds(200));
    } else if (StdinEnded(absl::Milliseconds(200))) {
      std::printf("standard input ended\n");
      break;
    }
  }
  std::printf("stopping cluster\n");
  (*cluster)->Stop().IgnoreError();
  return 0;
}

int Train(const TrainArgs& args) {
  absl::StatusOr<JobConfig> config = LoadJobConfig(args.config_path);
  if (!config.ok()) return Fail(config.status());
  if (!args.ckpt_dir.empty()) config->checkpoint.dir = args.ckpt_dir;
  if (args.resume) config->checkpoint.resume = true;
  if (config->checkpoint.resume && config->checkpoint.dir.empty()) {
    return Fail(absl::InvalidArgumentError(
        "--resume needs a checkpoint directory: 'checkpoint.dir' in the config or --ckpt-dir"));
  }
  for (std::string* path : {&config->checkpoint.dir, &config->checkpoint.init_from}) {
    if (!path->empty()) *path = std::filesystem::absolute(*path).lexically_normal().string();
  }
  std::unique_ptr<LocalCluster> cluster;
  std::string address = args.coordinator;
  if (address.empty()) {
    LocalClusterOptions o;
    o.mesh = JobMeshText(*config, args.mesh, "data=8");
    o.log_dir = args.log_dir;
    std::fprintf(stderr, "starting a local cluster (mesh %s)\n", o.mesh.c_str());
    auto started = LocalCluster::Start(o);
    if (!started.ok()) return Fail(started.status());
    cluster = *std::move(started);
    address = cluster->coordinator_address();
  }
  auto client = Client::Connect(address);
  if (!client.ok()) return Fail(client.status());
  const bool tty = isatty(fileno(stdout));
  auto result = (*client)->Train(*config, [&](const v1::JobEvent& e) {
    if (e.has_info()) std::printf("%s\n", e.info().c_str());
    if (e.has_worker_lost() || e.has_recovered())
      std::printf("%s\n", FormatRecoveryEvent(e).c_str());
    if (e.has_step()) {
      std::printf(tty ? "\r%s" : "%s\n", FormatProgress(e.step()).c_str());
    }
    if (e.has_eval()) {
      const long long n = e.eval().num_examples();
      if (e.eval().has_accuracy()) {
        std::printf("%stest accuracy %.4f (loss %.4f, %lld examples)\n", tty ? "\n" : "",
                    e.eval().accuracy(), e.eval().loss(), n);
      } else {  // a regression loss: no accuracy to report
        std::printf("%stest loss %.4f (%lld examples)\n", tty ? "\n" : "", e.eval().loss(), n);
      }
    }
    std::fflush(stdout);
  });
  if (tty) std::printf("\n");
  if (cluster) cluster->Stop().IgnoreError();
  if (!result.ok()) return Fail(result.status());
  return 0;
}

int Status(const std::string& coordinator) {
  auto client = Client::Connect(coordinator, absl::Seconds(3));
  if (!client.ok()) return Fail(client.status());
  auto st = (*client)->GetStatus();
  if (!st.ok()) return Fail(st.status());
  absl::StatusOr<Mesh> mesh = Mesh::FromProto(st->mesh());
  std::printf("coordinator %s  mesh %s  workers %d/%d  job %s (step %lld)\n", coordinator.c_str(),
              mesh.ok() ? mesh->ToString().c_str() : "?", st->workers_size(),
              st->expected_workers(), st->job_state().c_str(),
              static_cast<long long>(st->job_step()));
  if (!st->last_error().empty()) std::printf("last error: %s\n", st->last_error().c_str());
  std::string last_axes;
  for (const auto& g : st->groups()) {
    const std::string axes = absl::StrJoin(g.axis_names(), ",");
    if (axes != last_axes)
      std::printf("%sgroups over (%s):", last_axes.empty() ? "" : "\n", axes.c_str());
    last_axes = axes;
    std::printf(" [%s]", absl::StrJoin(g.ranks(), " ").c_str());
  }
  if (!last_axes.empty()) std::printf("\n");
  std::printf("%5s %-22s %8s %-16s %6s %10s\n", "rank", "address", "pid", "host", "alive",
              "heartbeat");
  for (const auto& w : st->workers()) {
    std::printf("%5d %-22s %8lld %-16s %6s %9.1fs\n", w.peer().rank(), w.peer().address().c_str(),
                static_cast<long long>(w.peer().pid()), w.peer().hostname().c_str(),
                w.alive() ? "yes" : "NO", w.seconds_since_heartbeat());
  }
  return 0;
}

int Arrays(const std::string& coordinator, const std::vector<std::string>& to_delete) {
  auto client = Client::Connect(coordinator, absl::Seconds(3));
  if (!client.ok()) return Fail(client.status());
  auto arrays = (*client)->ListArrays();
  if (!arrays.ok()) return Fail(arrays.status());
  if (!to_delete.empty()) {
    const bool all = std::find(to_delete.begin(), to_delete.end(), "all") != to_delete.end();
    std::vector<std::string> ids = to_delete;
    if (all) {
      ids.clear();
      for (const auto& a : *arrays) ids.push_back(a.id());
    }
    if (ids.empty()) return 0;
    // One call: every known id is freed even when the error names an unknown one.
    if (absl::Status s = (*client)->Delete(ids); !s.ok()) return Fail(s);
    for (const std::string& id : ids) std::printf("deleted %s\n", id.c_str());
    return 0;
  }
  std::printf("%-24s %-6s %-16s %-36s %16s  %s\n", "id", "dtype", "shape", "spec", "bytes/worker",
              "owner (client session)");
  for (const auto& a : *arrays) {
    const Dims dims(a.shape().dims().begin(), a.shape().dims().end());
    std::printf("%-24s %-6s %-16s %-36s %16lld  %s\n", a.id().c_str(), DTypeName(a.dtype()).c_str(),
                DimsToString(dims).c_str(),
                PartitionSpec::FromProto(a.sharding().spec()).ToString().c_str(),
                static_cast<long long>(a.bytes_per_worker()),
                a.owner().empty() ? "-" : a.owner().c_str());
  }
  return 0;
}

int Show(const std::string& coordinator, const std::string& id) {
  auto client = Client::Connect(coordinator, absl::Seconds(3));
  if (!client.ok()) return Fail(client.status());
  auto grid = (*client)->VisualizeSharding(id);
  if (!grid.ok()) return Fail(grid.status());
  std::printf("%s", grid->c_str());
  return 0;
}

int Health(const std::string& address, const std::string& service, double timeout_seconds) {
  auto stub = grpc::health::v1::Health::NewStub(CreateChannel(address));
  grpc::ClientContext ctx;
  SetTimeout(ctx, absl::Seconds(timeout_seconds));
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status s = stub->Check(&ctx, req, &resp);
  if (!s.ok()) return Fail(FromGrpcStatus(s, absl::StrCat("health check of ", address)));
  std::printf("%s\n",
              grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status()).c_str());
  return resp.status() == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
}

int Shutdown(const std::string& coordinator) {
  auto client = Client::Connect(coordinator, absl::Seconds(3));
  if (!client.ok()) return Fail(client.status());
  if (absl::Status s = (*client)->Shutdown(); !s.ok()) return Fail(s);
  std::printf("shutdown requested\n");
  return 0;
}

std::string JobMeshText(const JobConfig& config, const std::string& given,
                        const std::string& fallback) {
  if (!given.empty()) return given;
  if (config.mesh.empty()) return fallback;
  std::vector<std::string> parts;
  for (const auto& [name, size] : config.mesh) parts.push_back(absl::StrCat(name, "=", size));
  return absl::StrJoin(parts, ",");
}

absl::StatusOr<PlannedJob> PlanConfigJob(const JobConfig& config, const std::string& mesh_text) {
  absl::StatusOr<Mesh> mesh = Mesh::Parse(JobMeshText(config, mesh_text, "data=8"));
  if (!mesh.ok()) return mesh.status();
  return PlanJob(config, *mesh);
}

int Plan(const PlanArgs& in) {
  const auto fail = [](const absl::Status& s) {
    std::fprintf(stderr, "meshrun plan: %s\n", std::string(s.message()).c_str());
    return 2;
  };
  PlanArgs args = in;
  if (!args.config_path.empty()) {
    // A job's plan: the train step its config derives, on its mesh.
    absl::StatusOr<JobConfig> config = LoadJobConfig(args.config_path);
    if (!config.ok()) return fail(config.status());
    absl::StatusOr<PlannedJob> job = PlanConfigJob(*config, args.mesh);
    if (!job.ok()) return fail(job.status());
    std::printf("# job %s: model %s, %d examples per step\n# rules %s%s\n%s",
                args.config_path.c_str(), config->model.name.c_str(),
                static_cast<int>(job->spec.examples_per_step()),
                LogicalAxisRulesToString(job->step.sharding.rules).c_str(),
                job->step.sharding.fsdp_axis.empty()
                    ? ""
                    : absl::StrCat(", FSDP over '", job->step.sharding.fsdp_axis, "'").c_str(),
                job->step.Plan().c_str());
    if (!config->checkpoint.dir.empty()) {
      std::printf("checkpoint: %s every %d steps and at the end, keep %d%s%s\n",
                  config->checkpoint.dir.c_str(), config->checkpoint.save_every,
                  config->checkpoint.keep, config->checkpoint.async ? ", async" : "",
                  config->checkpoint.resume ? ", resume" : "");
    }
    return 0;
  }
  absl::StatusOr<Workload> w = SeedWorkload(args.workload);
  if (!w.ok()) return fail(w.status());
  absl::StatusOr<Mesh> mesh = Mesh::Parse(args.mesh);
  if (!mesh.ok()) return fail(mesh.status());
  absl::StatusOr<nn::ShardingConfig> named =
      WorkloadSharding(args.layout, args.rules, args.fsdp_axis, args.min_weight_size);
  if (!named.ok()) return fail(named.status());
  const nn::ShardingConfig& sharding = *named;
  absl::StatusOr<TrainStep> step =
      BuildTrainStep(*mesh, sharding, w->optimizer, w->batch, w->loss, 0, w->num_minibatches);
  if (!step.ok()) return fail(step.status());
  std::printf("# %s\n# rules %s%s\n%s", w->description.c_str(),
              LogicalAxisRulesToString(sharding.rules).c_str(),
              sharding.fsdp_axis.empty()
                  ? ""
                  : absl::StrCat(", FSDP over '", sharding.fsdp_axis, "'").c_str(),
              step->Plan().c_str());
  return 0;
}

}  // namespace meshrun::cli
