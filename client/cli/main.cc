// meshrun: the command-line client. Subcommands: up, certs, train, ckpt, export, status, health,
// arrays, show, shutdown, plan, bench. Each Add* function declares a subcommand as
// client/cli/flags.h describes: its flags, and a callback that runs it.
#include <climits>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "client/cli/commands.h"
#include "client/cli/flags.h"
#include "net/grpc_util.h"

namespace meshrun::cli {
namespace {

void AddUpAndCerts(CLI::App& app, int* exit_code) {
  auto up = std::make_shared<UpArgs>();
  auto* up_cmd =
      app.add_subcommand("up", "start a local cluster (coordinator + one worker per mesh device)");
  up_cmd->add_option("--mesh", up->mesh, "mesh axes, e.g. data=8 or data=2,model=4")
      ->capture_default_str();
  up_cmd->add_option("--port", up->port, "coordinator port (0: any free port)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  up_cmd->add_option("--log-dir", up->log_dir, "directory for process logs");
  up_cmd->add_option(
      "--tls-dir", up->tls_dir,
      "the cluster's credentials (default: MESHRUN_TLS_DIR, else ~/.meshrun/tls, made "
      "there if absent; MESHRUN_INSECURE=1: none)");
  up_cmd->add_flag("--insecure", up->insecure,
                   "no TLS and no authentication (anyone who reaches the ports controls it)");
  up_cmd->add_flag("--no-respawn", up->no_respawn,
                   "do not start a worker again when it dies (default: respawn it, so a job with "
                   "recovery.max_restarts continues)");
  up_cmd->add_flag("--no-shm", up->no_shm,
                   "workers exchange collective data over the gRPC ring only (default: shared "
                   "memory on this host)");
  up_cmd->add_flag("--stop-on-stdin-eof", up->stop_on_stdin_eof,
                   "stop the cluster when standard input reaches its end: a pipe from the program "
                   "that started it closes when that program exits, however it exits (the Python "
                   "SDK's local_cluster)");
  up_cmd->callback([up, exit_code] { *exit_code = Up(*up); });

  auto* certs_cmd =
      app.add_subcommand("certs", "the cluster's credentials: CA, node certificate, client token");
  certs_cmd->require_subcommand(1);
  auto dir = std::make_shared<std::string>();
  auto* init_cmd = certs_cmd->add_subcommand(
      "init",
      "make DIR/{ca.pem,ca-key.pem,node.pem,node-key.pem,token}; nodes take --tls_dir DIR, clients "
      "MESHRUN_TLS_DIR=DIR");
  init_cmd->add_option("dir", *dir, "directory to create")->required();
  init_cmd->callback([dir, exit_code] { *exit_code = CertsInit(*dir); });
}

void AddTrain(CLI::App& app, int* exit_code) {
  auto args = std::make_shared<std::pair<TrainArgs, WorkloadTrainArgs>>();
  TrainArgs& train = args->first;
  WorkloadTrainArgs& w = args->second;
  auto* cmd = app.add_subcommand("train", "run a train job");
  cmd->add_option("--config", train.config_path, "job config (JSON) of the main job");
  cmd->add_option("--workload", w.workload, "or a seed workload: mlp, dot_relu_dot, classifier");
  cmd->add_option("--layout", w.layout, "workload layout: single, dp, fsdp, tp, 2d, fsdp_tp")
      ->capture_default_str();
  cmd->add_option("--steps", w.steps, "workload: train until this step")
      ->check(CLI::Range(0, INT_MAX))
      ->capture_default_str();
  cmd->add_option("--steps-per-call", w.steps_per_call,
                  "workload: steps per call, run back to back on the workers (steps_per_execution)")
      ->check(CLI::Range(1, INT_MAX))
      ->capture_default_str();
  cmd->add_option("--ckpt-dir", w.ckpt_dir,
                  "checkpoint root (for --config: replaces checkpoint.dir)");
  cmd->add_option("--save-every", w.save_every, "workload: save every N steps (and at the end)")
      ->check(CLI::Range(0, INT_MAX));
  cmd->add_option("--keep", w.keep, "workload: keep the newest K checkpoints")
      ->check(CLI::Range(0, INT_MAX));
  cmd->add_flag("--async-save", w.async_save, "workload: save in the background");
  cmd->add_flag(
      "--resume", w.resume,
      "continue from the newest committed checkpoint (the config's checkpoint.dir or --ckpt-dir)");
  cmd->add_option("--precision", w.precision, kPrecisionHelp)
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();
  cmd->add_option("--init-from", w.init_from, "workload: parameters from a safetensors file");
  cmd->add_option("--coordinator", train.coordinator,
                  "a running cluster's coordinator (default: start one)");
  cmd->add_option("--mesh", train.mesh,
                  "mesh of the embedded cluster (default: the config's, else data=8)");
  cmd->add_option("--log-dir", train.log_dir, "directory for the embedded cluster's logs");
  cmd->callback([args, exit_code] {
    TrainArgs& train = args->first;
    WorkloadTrainArgs& w = args->second;
    if (!w.workload.empty()) {
      w.coordinator = train.coordinator;
      w.log_dir = train.log_dir;
      if (!train.mesh.empty()) {
        w.mesh = train.mesh;
      } else if (!train.coordinator.empty()) {
        w.mesh.clear();  // the running cluster's
      }
      *exit_code = TrainWorkload(w);
      return;
    }
    if (train.config_path.empty()) throw CLI::RequiredError("--config or --workload");
    train.resume = w.resume;
    train.ckpt_dir = w.ckpt_dir;
    *exit_code = Train(train);
  });
}

void AddCheckpointCommands(CLI::App& app, int* exit_code) {
  struct Args {
    std::string path, config, export_out;
    std::string workload = "mlp", layout = "dp", mesh = "data=2,model=4";
  };
  auto a = std::make_shared<Args>();
  auto* ckpt_cmd = app.add_subcommand("ckpt", "sharded checkpoints");
  ckpt_cmd->require_subcommand(1);
  auto* validate = ckpt_cmd->add_subcommand(
      "validate",
      "check a checkpoint, allocating nothing: against a job (--config) or a workload "
      "(--workload, --layout, --mesh), else by itself (every block's size and CRC-32; with "
      "--mesh, each array restorable on it as saved)");
  validate->add_option("checkpoint", a->path, "a committed checkpoint directory")->required();
  validate->add_option("--config", a->config,
                       "job config (JSON): check against its TrainState and mesh");
  validate->add_option("--workload", a->workload)->capture_default_str();
  validate->add_option("--layout", a->layout)->capture_default_str();
  validate->add_option("--mesh", a->mesh)->capture_default_str();
  validate->callback([a, validate, exit_code] {
    if (!a->config.empty()) {
      *exit_code = CkptValidateJob(a->path, a->config, validate->count("--mesh") ? a->mesh : "");
      return;
    }
    if (!validate->count("--workload") && !validate->count("--layout")) {
      *exit_code = CkptValidateAlone(a->path, validate->count("--mesh") ? a->mesh : "");
      return;
    }
    WorkloadTrainArgs w;
    w.workload = a->workload;
    w.layout = a->layout;
    w.mesh = a->mesh;
    *exit_code = CkptValidate(a->path, w);
  });
  auto* export_cmd =
      app.add_subcommand("export", "a checkpoint's parameters, unsharded, as one safetensors file");
  export_cmd->add_option("checkpoint", a->path, "a committed checkpoint directory")->required();
  export_cmd->add_option("file", a->export_out, "output .safetensors")->required();
  export_cmd->callback([a, exit_code] { *exit_code = Export(a->path, a->export_out); });
}

// status, health, arrays, show and shutdown: a running cluster's state.
void AddClusterCommands(CLI::App& app, int* exit_code) {
  struct Args {
    std::string coordinator = "127.0.0.1:50051";
    std::string health_addr, health_service, array_id;
    double health_timeout = 2.0;
    std::vector<std::string> delete_ids;
  };
  auto a = std::make_shared<Args>();
  auto* status = app.add_subcommand("status", "show the cluster's workers and job");
  status->add_option("--coordinator", a->coordinator)->capture_default_str();
  status->callback([a, exit_code] { *exit_code = Status(a->coordinator); });
  auto* health = app.add_subcommand("health", "grpc.health.v1 probe: exit 0 only when SERVING");
  health->add_option("--addr", a->health_addr, "server address HOST:PORT")->required();
  health->add_option("--service", a->health_service,
                     "service name (default: the server as a whole)");
  health->add_option("--timeout", a->health_timeout, "seconds")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  health->callback([a, exit_code] {
    *exit_code = Health(a->health_addr, a->health_service, a->health_timeout);
  });
  auto* arrays =
      app.add_subcommand("arrays", "list the cluster's sharded arrays with bytes per worker");
  arrays->add_option("--coordinator", a->coordinator)->capture_default_str();
  arrays->add_option("--delete", a->delete_ids,
                     "delete these arrays (all: every array) instead of listing them");
  arrays->callback([a, exit_code] { *exit_code = Arrays(a->coordinator, a->delete_ids); });
  auto* show =
      app.add_subcommand("show", "print an array's sharding grid (visualize_array_sharding)");
  show->add_option("array", a->array_id, "array id")->required();
  show->add_option("--coordinator", a->coordinator)->capture_default_str();
  show->callback([a, exit_code] { *exit_code = Show(a->coordinator, a->array_id); });
  auto* shutdown = app.add_subcommand("shutdown", "stop a cluster's workers and coordinator");
  shutdown->add_option("--coordinator", a->coordinator)->capture_default_str();
  shutdown->callback([a, exit_code] { *exit_code = Shutdown(a->coordinator); });
}

void AddPlan(CLI::App& app, int* exit_code) {
  auto plan = std::make_shared<PlanArgs>();
  auto* cmd = app.add_subcommand(
      "plan",
      "plan a job (JOB.json) or a workload's train step under a layout, allocating nothing");
  cmd->add_option("job", plan->config_path, "job config (JSON)");
  cmd->add_option("--workload", plan->workload, "mlp, dot_relu_dot or classifier")
      ->capture_default_str();
  cmd->add_option("--mesh", plan->mesh, "mesh axes")->capture_default_str();
  cmd->add_option("--layout", plan->layout, "single, dp, fsdp, tp, 2d or fsdp_tp");
  cmd->add_option("--rules", plan->rules, "logical axis rules, e.g. batch=data,hidden=model");
  cmd->add_option("--fsdp", plan->fsdp_axis, "shard parameters over this mesh axis (with --rules)");
  cmd->add_option("--min-weight-size", plan->min_weight_size,
                  "FSDP leaves smaller parameters replicated")
      ->check(CLI::Range(0, INT_MAX))
      ->capture_default_str();
  cmd->callback([plan, cmd, exit_code] {
    if (!plan->config_path.empty() && !cmd->count("--mesh")) plan->mesh.clear();
    *exit_code = Plan(*plan);
  });
}

}  // namespace
}  // namespace meshrun::cli

int main(int argc, char** argv) {
  meshrun::GrpcLifetime grpc_lifetime;  // first: destroyed after everything that uses gRPC
  CLI::App app{"meshrun: train neural networks sharded over a mesh of worker processes"};
  app.require_subcommand(1);
  int exit_code = 1;
  meshrun::cli::AddUpAndCerts(app, &exit_code);
  meshrun::cli::AddTrain(app, &exit_code);
  meshrun::cli::AddCheckpointCommands(app, &exit_code);
  meshrun::cli::AddClusterCommands(app, &exit_code);
  meshrun::cli::AddPlan(app, &exit_code);
  meshrun::cli::AddBenchCommands(app, &exit_code);
  CLI11_PARSE(app, argc, argv);
  return exit_code;
}
