// meshrun: the command-line client. Subcommands: up, train, status, shutdown, plan, bench.
#include <climits>

#include "CLI/CLI.hpp"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/bench.h"
#include "client/cli/commands.h"
#include "net/grpc_util.h"

namespace {

std::vector<int> ParseInts(const std::string& csv) {
  std::vector<int> out;
  for (absl::string_view p : absl::StrSplit(csv, ',', absl::SkipEmpty())) {
    int v;
    if (!absl::SimpleAtoi(p, &v) || v < 1)
      throw CLI::ValidationError("--workers", "expected positive integers, e.g. 2,4,8");
    out.push_back(v);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  meshrun::GrpcLifetime grpc_lifetime;  // first: destroyed after everything that uses gRPC
  CLI::App app{"meshrun: train neural networks sharded over a mesh of worker processes"};
  app.require_subcommand(1);

  meshrun::cli::UpArgs up;
  auto* up_cmd =
      app.add_subcommand("up", "start a local cluster (coordinator + one worker per mesh device)");
  up_cmd->add_option("--mesh", up.mesh, "mesh axes, e.g. data=8 or data=2,model=4")
      ->capture_default_str();
  up_cmd->add_option("--port", up.port, "coordinator port (0: any free port)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  up_cmd->add_option("--log-dir", up.log_dir, "directory for process logs");
  up_cmd->add_option(
      "--tls-dir", up.tls_dir,
      "the cluster's credentials (default: MESHRUN_TLS_DIR, else ~/.meshrun/tls, made "
      "there if absent; MESHRUN_INSECURE=1: none)");
  up_cmd->add_flag("--insecure", up.insecure,
                   "no TLS and no authentication (anyone who reaches the ports controls it)");
  auto* certs_cmd =
      app.add_subcommand("certs", "the cluster's credentials: CA, node certificate, client token");
  certs_cmd->require_subcommand(1);
  std::string certs_dir;
  auto* certs_init_cmd = certs_cmd->add_subcommand(
      "init",
      "make DIR/{ca.pem,ca-key.pem,node.pem,node-key.pem,token}; nodes take --tls_dir DIR, clients "
      "MESHRUN_TLS_DIR=DIR");
  certs_init_cmd->add_option("dir", certs_dir, "directory to create")->required();
  up_cmd->add_flag("--no-respawn", up.no_respawn,
                   "do not start a worker again when it dies (default: respawn it, so a job with "
                   "recovery.max_restarts continues)");
  up_cmd->add_flag("--no-shm", up.no_shm,
                   "workers exchange collective data over the gRPC ring only (default: shared "
                   "memory on this host)");

  const std::string kPrecision =
      "the layers' compute dtype: bf16 is mixed precision (bf16 GEMMs accumulating in f32; f32 "
      "parameters, gradients and optimizer state)";
  meshrun::cli::TrainArgs train;
  auto* train_cmd = app.add_subcommand("train", "run a train job");
  meshrun::cli::WorkloadTrainArgs wtrain;
  train_cmd->add_option("--config", train.config_path, "job config (JSON) of the main job");
  train_cmd->add_option("--workload", wtrain.workload,
                        "or a seed workload: mlp, dot_relu_dot, classifier");
  train_cmd
      ->add_option("--layout", wtrain.layout, "workload layout: single, dp, fsdp, tp, 2d, fsdp_tp")
      ->capture_default_str();
  train_cmd->add_option("--steps", wtrain.steps, "workload: train until this step")
      ->check(CLI::Range(0, INT_MAX))
      ->capture_default_str();
  train_cmd
      ->add_option(
          "--steps-per-call", wtrain.steps_per_call,
          "workload: steps per call, run back to back on the workers (steps_per_execution)")
      ->check(CLI::Range(1, INT_MAX))
      ->capture_default_str();
  train_cmd->add_option("--ckpt-dir", wtrain.ckpt_dir,
                        "checkpoint root (for --config: replaces checkpoint.dir)");
  train_cmd
      ->add_option("--save-every", wtrain.save_every,
                   "workload: save every N steps (and at the end)")
      ->check(CLI::Range(0, INT_MAX));
  train_cmd->add_option("--keep", wtrain.keep, "workload: keep the newest K checkpoints")
      ->check(CLI::Range(0, INT_MAX));
  train_cmd->add_flag("--async-save", wtrain.async_save, "workload: save in the background");
  train_cmd->add_flag(
      "--resume", wtrain.resume,
      "continue from the newest committed checkpoint (the config's checkpoint.dir or --ckpt-dir)");
  train_cmd->add_option("--precision", wtrain.precision, kPrecision)
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();
  train_cmd->add_option("--init-from", wtrain.init_from,
                        "workload: parameters from a safetensors file");
  train_cmd->add_option("--coordinator", train.coordinator,
                        "a running cluster's coordinator (default: start one)");
  train_cmd->add_option("--mesh", train.mesh,
                        "mesh of the embedded cluster (default: the config's, else data=8)");
  train_cmd->add_option("--log-dir", train.log_dir, "directory for the embedded cluster's logs");

  std::string ckpt_path, ckpt_workload = "mlp", ckpt_layout = "dp", ckpt_mesh = "data=2,model=4";
  auto* ckpt_cmd = app.add_subcommand("ckpt", "sharded checkpoints");
  ckpt_cmd->require_subcommand(1);
  std::string ckpt_config;
  auto* validate_cmd = ckpt_cmd->add_subcommand(
      "validate", "check a checkpoint against a job or workload, allocating nothing");
  validate_cmd->add_option("checkpoint", ckpt_path, "a committed checkpoint directory")->required();
  validate_cmd->add_option("--config", ckpt_config,
                           "job config (JSON): check against its TrainState and mesh");
  validate_cmd->add_option("--workload", ckpt_workload)->capture_default_str();
  validate_cmd->add_option("--layout", ckpt_layout)->capture_default_str();
  validate_cmd->add_option("--mesh", ckpt_mesh)->capture_default_str();
  std::string export_out;
  auto* export_cmd =
      app.add_subcommand("export", "a checkpoint's parameters, unsharded, as one safetensors file");
  export_cmd->add_option("checkpoint", ckpt_path, "a committed checkpoint directory")->required();
  export_cmd->add_option("file", export_out, "output .safetensors")->required();

  std::string coordinator = "127.0.0.1:50051";
  auto* status_cmd = app.add_subcommand("status", "show the cluster's workers and job");
  status_cmd->add_option("--coordinator", coordinator)->capture_default_str();
  std::string health_addr, health_service;
  double health_timeout = 2.0;
  auto* health_cmd = app.add_subcommand("health", "grpc.health.v1 probe: exit 0 only when SERVING");
  health_cmd->add_option("--addr", health_addr, "server address HOST:PORT")->required();
  health_cmd->add_option("--service", health_service,
                         "service name (default: the server as a whole)");
  health_cmd->add_option("--timeout", health_timeout, "seconds")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  auto* arrays_cmd =
      app.add_subcommand("arrays", "list the cluster's sharded arrays with bytes per worker");
  arrays_cmd->add_option("--coordinator", coordinator)->capture_default_str();
  std::vector<std::string> delete_ids;
  arrays_cmd->add_option("--delete", delete_ids,
                         "delete these arrays (all: every array) instead of listing them");
  std::string array_id;
  auto* show_cmd =
      app.add_subcommand("show", "print an array's sharding grid (visualize_array_sharding)");
  show_cmd->add_option("array", array_id, "array id")->required();
  show_cmd->add_option("--coordinator", coordinator)->capture_default_str();
  auto* shutdown_cmd = app.add_subcommand("shutdown", "stop a cluster's workers and coordinator");
  shutdown_cmd->add_option("--coordinator", coordinator)->capture_default_str();

  meshrun::cli::PlanArgs plan;
  auto* plan_cmd = app.add_subcommand(
      "plan",
      "plan a job (JOB.json) or a workload's train step under a layout, allocating nothing");
  plan_cmd->add_option("job", plan.config_path, "job config (JSON)");
  plan_cmd->add_option("--workload", plan.workload, "mlp, dot_relu_dot or classifier")
      ->capture_default_str();
  plan_cmd->add_option("--mesh", plan.mesh, "mesh axes")->capture_default_str();
  plan_cmd->add_option("--layout", plan.layout, "single, dp, fsdp, tp, 2d or fsdp_tp");
  plan_cmd->add_option("--rules", plan.rules, "logical axis rules, e.g. batch=data,hidden=model");
  plan_cmd->add_option("--fsdp", plan.fsdp_axis,
                       "shard parameters over this mesh axis (with --rules)");
  plan_cmd
      ->add_option("--min-weight-size", plan.min_weight_size,
                   "FSDP leaves smaller parameters replicated")
      ->check(CLI::Range(0, INT_MAX))
      ->capture_default_str();

  auto* bench_cmd = app.add_subcommand("bench", "benchmarks over real local clusters");
  bench_cmd->require_subcommand(1);
  std::string ar_workers = "2,4,8", train_workers = "1,2,8";
  meshrun::AllReduceBenchOptions ar;
  auto* ar_cmd = bench_cmd->add_subcommand("allreduce",
                                           "ring all-reduce time, algbw and busbw, 4 KiB..64 MiB");
  ar_cmd->add_option("--workers", ar_workers, "worker counts")->capture_default_str();
  ar_cmd->add_option("--iters", ar.iters, "timed iterations per size (0: scaled to the size)")
      ->check(CLI::Range(0, INT_MAX));
  ar_cmd->add_option("--sizes", ar.sizes_bytes, "message sizes in bytes (default 4 KiB..64 MiB)")
      ->check(CLI::Range(int64_t{4}, int64_t{1} << 32));
  const std::string kNoShm =
      "collectives over the loopback gRPC ring, as between hosts (default: shared memory)";
  bool ar_no_shm = false, cb_no_shm = false, sb_no_shm = false, tb_no_shm = false;
  ar_cmd->add_flag("--no-shm", ar_no_shm, kNoShm);
  ar_cmd->add_flag("--insecure", ar.insecure,
                   "no TLS between the processes (default: mutual TLS, as deployed)");
  auto* ar_netns =
      ar_cmd->add_flag("--netns", ar.netns,
                       "each worker on a host of its own: a network namespace joined to a bridge, "
                       "over gRPC (needs root and iproute2)");
  ar_cmd
      ->add_option("--netem-delay-us", ar.netem_delay_us,
                   "with --netns: one-way delay tc netem adds to each packet a worker sends")
      ->check(CLI::Range(int64_t{0}, int64_t{10'000'000}))
      ->needs(ar_netns);
  ar_cmd
      ->add_option("--grpc-stripes", ar.grpc_stripes,
                   "the workers' --grpc_stripes: the most gRPC streams per peer a message is "
                   "striped over; several: a cluster for each in turn (default: the workers')")
      ->check(CLI::Range(1, 16));
  ar_cmd
      ->add_option("--grpc-stripe-bytes", ar.grpc_stripe_bytes,
                   "with --grpc-stripes: the workers' --grpc_stripe_bytes (one stream per this "
                   "many bytes of a message)")
      ->check(CLI::Range(int64_t{8}, int64_t{1} << 40))
      ->needs("--grpc-stripes");
  std::vector<std::string> ar_algorithms;
  ar_cmd
      ->add_option("--algorithm", ar_algorithms,
                   "auto (by size, as programs run), ring, recursive_doubling, one_shot; "
                   "several: each in turn (default: auto)")
      ->check(CLI::IsMember({"auto", "ring", "recursive_doubling", "one_shot"}));
  meshrun::CollectivesBenchOptions cb;
  auto* cb_cmd = bench_cmd->add_subcommand(
      "collectives", "psum, all_gather, psum_scatter, ppermute over each mesh axis");
  cb_cmd->add_option("--mesh", cb.mesh, "mesh")->capture_default_str();
  cb_cmd->add_option("--sizes", cb.sizes_bytes, "message sizes in bytes")
      ->check(CLI::Range(int64_t{4}, int64_t{1} << 32));
  cb_cmd->add_flag("--no-shm", cb_no_shm, kNoShm);
  meshrun::TrainBenchOptions tb;
  auto* tb_cmd = bench_cmd->add_subcommand("train", "samples/s of the main job");
  tb_cmd->add_option("--workers", train_workers, "worker counts")->capture_default_str();
  tb_cmd->add_flag("--insecure", tb.insecure,
                   "no TLS between the processes (default: mutual TLS, as deployed)");
  tb_cmd->add_option("--precision", tb.precision, kPrecision)
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();
  tb_cmd
      ->add_option("--reduce-precision", tb.reduce,
                   "the dtype gradients are all-reduced in: bf16 halves the bytes between workers "
                   "(FSDP2's reduce_dtype)")
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();
  tb_cmd->add_flag("--no-shm", tb_no_shm, kNoShm);
  tb_cmd
      ->add_option("--minibatches", tb.num_minibatches,
                   "gradient accumulation: the global batch of 128 as this many minibatches")
      ->check(CLI::IsMember({1, 2, 4, 8}))
      ->capture_default_str();
  tb_cmd->add_option("--steps", tb.steps, "steps per run")
      ->check(CLI::Range(1, INT_MAX))
      ->capture_default_str();

  meshrun::InputBenchOptions ib;
  std::vector<int> input_workers = ib.workers;
  auto* ib_cmd =
      bench_cmd->add_subcommand("input", "steps/s of the main job's input pipeline alone");
  ib_cmd->add_option("--workers", input_workers, "worker counts (rank 0's blocks are read)")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  ib_cmd->add_option("--steps", ib.steps, "timed steps")
      ->check(CLI::Range(1, INT_MAX))
      ->capture_default_str();
  ib_cmd->add_option("--data", ib.data_dir, "the Fashion-MNIST IDX directory")
      ->capture_default_str();

  meshrun::StepBenchOptions sb;
  std::string sb_workloads = "mlp,dot_relu_dot,classifier", sb_layouts = "single,dp,fsdp,tp,2d";
  auto* sb_cmd = bench_cmd->add_subcommand(
      "step", "step time, samples/s and peak RSS of the seeds' workloads per layout");
  sb_cmd->add_option("--workloads", sb_workloads, "comma-separated")->capture_default_str();
  sb_cmd->add_option("--layouts", sb_layouts, "comma-separated")->capture_default_str();
  sb_cmd->add_option("--mesh", sb.mesh, "mesh of the multi-worker layouts")->capture_default_str();
  sb_cmd->add_option("--steps", sb.steps, "timed steps per run")
      ->check(CLI::Range(1, INT_MAX))
      ->capture_default_str();
  sb_cmd
      ->add_option("--steps-per-call", sb.steps_per_call,
                   "train steps per call, run back to back on the workers (steps_per_execution)")
      ->check(CLI::Range(1, INT_MAX))
      ->capture_default_str();
  sb_cmd->add_flag("--no-shm", sb_no_shm, kNoShm);
  std::string sb_precision = "f32";
  sb_cmd->add_option("--precision", sb_precision, kPrecision)
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();

  meshrun::KernelBenchOptions gb;
  std::string gb_workloads = "classifier,mlp,dot_relu_dot", gb_layouts = "single",
              gb_precisions = "f32,bf16";
  auto* gb_cmd = bench_cmd->add_subcommand(
      "kernels", "GFLOP/s of the seeds' GEMMs inside a worker beside the oneDNN primitive alone");
  gb_cmd->add_option("--workloads", gb_workloads, "comma-separated")->capture_default_str();
  gb_cmd->add_option("--layouts", gb_layouts, "comma-separated")->capture_default_str();
  gb_cmd->add_option("--mesh", gb.mesh, "mesh whose per-worker shapes the layouts have")
      ->capture_default_str();
  gb_cmd->add_option("--precisions", gb_precisions, "comma-separated: f32, bf16")
      ->capture_default_str();
  gb_cmd->add_option("--min-seconds", gb.min_seconds, "time per GEMM alone")
      ->check(CLI::Range(0.0, 60.0))
      ->capture_default_str();
  gb_cmd->add_option("--steps", gb.steps, "whole steps timed in the worker")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();

  meshrun::CkptBenchOptions kb;
  auto* kb_cmd = bench_cmd->add_subcommand(
      "ckpt", "save / restore GB/s of a TrainState and async-save blocking");
  kb_cmd->add_option("--workload", kb.workload)->capture_default_str();
  kb_cmd->add_option("--layout", kb.layout)->capture_default_str();
  kb_cmd->add_option("--mesh", kb.mesh)->capture_default_str();
  kb_cmd->add_option("--dir", kb.dir, "checkpoint root (default: under the temp dir)");

  CLI11_PARSE(app, argc, argv);
  try {
    if (up_cmd->parsed()) return meshrun::cli::Up(up);
    if (certs_init_cmd->parsed()) return meshrun::cli::CertsInit(certs_dir);
    if (train_cmd->parsed()) {
      if (!wtrain.workload.empty()) {
        wtrain.coordinator = train.coordinator;
        wtrain.log_dir = train.log_dir;
        if (!train.mesh.empty()) {
          wtrain.mesh = train.mesh;
        } else if (!train.coordinator.empty()) {
          wtrain.mesh.clear();  // the running cluster's
        }
        return meshrun::cli::TrainWorkload(wtrain);
      }
      if (train.config_path.empty()) throw CLI::RequiredError("--config or --workload");
      train.resume = wtrain.resume;
      train.ckpt_dir = wtrain.ckpt_dir;
      return meshrun::cli::Train(train);
    }
    if (validate_cmd->parsed()) {
      if (!ckpt_config.empty()) {
        return meshrun::cli::CkptValidateJob(ckpt_path, ckpt_config,
                                             validate_cmd->count("--mesh") ? ckpt_mesh : "");
      }
      meshrun::cli::WorkloadTrainArgs w;
      w.workload = ckpt_workload;
      w.layout = ckpt_layout;
      w.mesh = ckpt_mesh;
      return meshrun::cli::CkptValidate(ckpt_path, w);
    }
    if (export_cmd->parsed()) return meshrun::cli::Export(ckpt_path, export_out);
    if (status_cmd->parsed()) return meshrun::cli::Status(coordinator);
    if (shutdown_cmd->parsed()) return meshrun::cli::Shutdown(coordinator);
    if (health_cmd->parsed())
      return meshrun::cli::Health(health_addr, health_service, health_timeout);
    if (arrays_cmd->parsed()) return meshrun::cli::Arrays(coordinator, delete_ids);
    if (show_cmd->parsed()) return meshrun::cli::Show(coordinator, array_id);
    if (ar_cmd->parsed()) {
      ar.workers = ParseInts(ar_workers);
      ar.shm_transport = !ar_no_shm;
      if (!ar_algorithms.empty()) ar.algorithms.clear();
      for (const std::string& a : ar_algorithms) ar.algorithms.push_back(a == "auto" ? "" : a);
      return meshrun::RunAllReduceBench(ar);
    }
    if (cb_cmd->parsed()) {
      cb.shm_transport = !cb_no_shm;
      return meshrun::RunCollectivesBench(cb);
    }
    if (plan_cmd->parsed()) {
      if (!plan.config_path.empty() && !plan_cmd->count("--mesh")) plan.mesh.clear();
      return meshrun::cli::Plan(plan);
    }
    if (kb_cmd->parsed()) return meshrun::RunCkptBench(kb);
    if (ib_cmd->parsed()) {
      ib.workers = input_workers;
      return meshrun::RunInputBench(ib);
    }
    if (gb_cmd->parsed()) {
      gb.workloads = absl::StrSplit(gb_workloads, ',', absl::SkipEmpty());
      gb.layouts = absl::StrSplit(gb_layouts, ',', absl::SkipEmpty());
      gb.precisions = absl::StrSplit(gb_precisions, ',', absl::SkipEmpty());
      for (const std::string& p : gb.precisions) {
        if (p != "f32" && p != "bf16") {
          std::fprintf(stderr, "meshrun bench kernels: --precisions: '%s'; expected f32 or bf16\n",
                       p.c_str());
          return 2;
        }
      }
      return meshrun::RunKernelBench(gb);
    }
    if (sb_cmd->parsed()) {
      sb.workloads = absl::StrSplit(sb_workloads, ',', absl::SkipEmpty());
      sb.layouts = absl::StrSplit(sb_layouts, ',', absl::SkipEmpty());
      sb.shm_transport = !sb_no_shm;
      sb.dtype = sb_precision == "bf16" ? meshrun::v1::DTYPE_BF16 : meshrun::v1::DTYPE_F32;
      return meshrun::RunStepBench(sb);
    }
    if (tb_cmd->parsed()) {
      tb.workers = ParseInts(train_workers);
      tb.shm_transport = !tb_no_shm;
      return meshrun::RunTrainBench(tb);
    }
  } catch (const CLI::Error& e) {
    return app.exit(e);
  }
  return 1;
}
