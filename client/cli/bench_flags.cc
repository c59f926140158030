// `meshrun bench ...`: the flags of each benchmark (bench/bench.h has what they measure).
#include <climits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/bench.h"
#include "client/cli/flags.h"
#include "core/sharding/mesh.h"

namespace meshrun::cli {
namespace {

std::vector<int> ParseInts(const std::string& csv) {
  std::vector<int> out;
  for (absl::string_view p : absl::StrSplit(csv, ',', absl::SkipEmpty())) {
    int v;
    if (!absl::SimpleAtoi(p, &v) || v < 1 || v > Mesh::kMaxDevices) {
      throw CLI::ValidationError(
          "--workers", absl::StrCat("'", p, "': expected integers in [1, ", Mesh::kMaxDevices,
                                    "] (a worker process each), e.g. 2,4,8"));
    }
    out.push_back(v);
  }
  return out;
}

std::vector<std::string> SplitCsv(const std::string& csv) {
  return absl::StrSplit(csv, ',', absl::SkipEmpty());
}

void AddAllReduce(CLI::App& bench, int* exit_code) {
  struct Args {
    AllReduceBenchOptions o;
    std::string workers = "2,4,8";
    bool no_shm = false;
    std::vector<std::string> algorithms;
  };
  auto a = std::make_shared<Args>();
  auto* cmd =
      bench.add_subcommand("allreduce", "ring all-reduce time, algbw and busbw, 4 KiB..64 MiB");
  cmd->add_option("--workers", a->workers, "worker counts")->capture_default_str();
  cmd->add_option("--iters", a->o.iters, "timed iterations per size (0: scaled to the size)")
      ->check(CLI::Range(0, INT_MAX));
  cmd->add_option("--sizes", a->o.sizes_bytes, "message sizes in bytes (default 4 KiB..64 MiB)")
      ->check(CLI::Range(int64_t{4}, int64_t{1} << 32));
  cmd->add_flag("--no-shm", a->no_shm, kNoShmHelp);
  cmd->add_flag("--insecure", a->o.insecure,
                "no TLS between the processes (default: mutual TLS, as deployed)");
  auto* netns =
      cmd->add_flag("--netns", a->o.netns,
                    "each worker on a host of its own: a network namespace joined to a bridge, "
                    "over gRPC (needs root and iproute2)");
  cmd->add_option("--netem-delay-us", a->o.netem_delay_us,
                  "with --netns: one-way delay tc netem adds to each packet a worker sends")
      ->check(CLI::Range(int64_t{0}, int64_t{10'000'000}))
      ->needs(netns);
  cmd->add_option("--grpc-stripes", a->o.grpc_stripes,
                  "the workers' --grpc_stripes: the most gRPC streams per peer a message is "
                  "striped over; several: a cluster for each in turn (default: the workers')")
      ->check(CLI::Range(1, 16));
  cmd->add_option("--grpc-stripe-bytes", a->o.grpc_stripe_bytes,
                  "with --grpc-stripes: the workers' --grpc_stripe_bytes (one stream per this "
                  "many bytes of a message)")
      ->check(CLI::Range(int64_t{8}, int64_t{1} << 40))
      ->needs("--grpc-stripes");
  cmd->add_option("--ring-chunk-bytes", a->o.ring_chunk_bytes,
                  "the workers' --ring_chunk_bytes: the most bytes of one message (ring steps "
                  "are pipelined in chunks of this size); several: a cluster for each in turn "
                  "(default: the workers')")
      ->check(CLI::Range(int64_t{8}, int64_t{1} << 30));
  cmd->add_option("--algorithm", a->algorithms,
                  "auto (by size, as programs run), ring, recursive_doubling, one_shot; "
                  "several: each in turn (default: auto)")
      ->check(CLI::IsMember({"auto", "ring", "recursive_doubling", "one_shot"}));
  cmd->callback([a, exit_code] {
    a->o.workers = ParseInts(a->workers);
    a->o.shm_transport = !a->no_shm;
    if (!a->algorithms.empty()) a->o.algorithms.clear();
    for (const std::string& name : a->algorithms)
      a->o.algorithms.push_back(name == "auto" ? "" : name);
    *exit_code = RunAllReduceBench(a->o);
  });
}

void AddCollectivesAndTrain(CLI::App& bench, int* exit_code) {
  auto cb = std::make_shared<std::pair<CollectivesBenchOptions, bool>>();  // (options, no_shm)
  auto* cb_cmd = bench.add_subcommand(
      "collectives", "psum, all_gather, psum_scatter, ppermute over each mesh axis");
  cb_cmd->add_option("--mesh", cb->first.mesh, "mesh")->capture_default_str();
  cb_cmd->add_option("--sizes", cb->first.sizes_bytes, "message sizes in bytes")
      ->check(CLI::Range(int64_t{4}, int64_t{1} << 32));
  cb_cmd->add_flag("--no-shm", cb->second, kNoShmHelp);
  cb_cmd->callback([cb, exit_code] {
    cb->first.shm_transport = !cb->second;
    *exit_code = RunCollectivesBench(cb->first);
  });

  struct TrainArgs {
    TrainBenchOptions o;
    std::string workers = "1,2,8";
    bool no_shm = false;
  };
  auto t = std::make_shared<TrainArgs>();
  auto* cmd = bench.add_subcommand("train", "samples/s of the main job");
  cmd->add_option("--workers", t->workers, "worker counts")->capture_default_str();
  cmd->add_flag("--insecure", t->o.insecure,
                "no TLS between the processes (default: mutual TLS, as deployed)");
  cmd->add_option("--precision", t->o.precision, kPrecisionHelp)
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();
  cmd->add_option("--reduce-precision", t->o.reduce,
                  "the dtype gradients are all-reduced in: bf16 halves the bytes between workers "
                  "(FSDP2's reduce_dtype)")
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();
  cmd->add_flag("--no-shm", t->no_shm, kNoShmHelp);
  cmd->add_option("--minibatches", t->o.num_minibatches,
                  "gradient accumulation: the global batch of 128 as this many minibatches")
      ->check(CLI::IsMember({1, 2, 4, 8}))
      ->capture_default_str();
  cmd->add_option("--steps", t->o.steps, "steps per run")
      ->check(CLI::Range(1, INT_MAX))
      ->capture_default_str();
  cmd->callback([t, exit_code] {
    t->o.workers = ParseInts(t->workers);
    t->o.shm_transport = !t->no_shm;
    *exit_code = RunTrainBench(t->o);
  });
}

void AddInputAndCkpt(CLI::App& bench, int* exit_code) {
  auto ib = std::make_shared<InputBenchOptions>();
  auto* ib_cmd = bench.add_subcommand("input", "steps/s of the main job's input pipeline alone");
  ib_cmd->add_option("--workers", ib->workers, "worker counts (rank 0's blocks are read)")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  ib_cmd->add_option("--steps", ib->steps, "timed steps")
      ->check(CLI::Range(1, INT_MAX))
      ->capture_default_str();
  ib_cmd->add_option("--data", ib->data_dir, "the Fashion-MNIST IDX directory")
      ->capture_default_str();
  ib_cmd->callback([ib, exit_code] { *exit_code = RunInputBench(*ib); });

  auto kb = std::make_shared<CkptBenchOptions>();
  auto* kb_cmd =
      bench.add_subcommand("ckpt", "save / restore GB/s of a TrainState and async-save blocking");
  kb_cmd->add_option("--workload", kb->workload)->capture_default_str();
  kb_cmd->add_option("--layout", kb->layout)->capture_default_str();
  kb_cmd->add_option("--mesh", kb->mesh)->capture_default_str();
  kb_cmd->add_option("--dir", kb->dir, "checkpoint root (default: under the temp dir)");
  kb_cmd->callback([kb, exit_code] { *exit_code = RunCkptBench(*kb); });
}

void AddStep(CLI::App& bench, int* exit_code) {
  struct Args {
    StepBenchOptions o;
    std::string workloads = "mlp,dot_relu_dot,classifier", layouts = "single,dp,fsdp,tp,2d";
    std::string precision = "f32";
    bool no_shm = false;
  };
  auto a = std::make_shared<Args>();
  auto* cmd = bench.add_subcommand(
      "step", "step time, samples/s and peak RSS of the seeds' workloads per layout");
  cmd->add_option("--workloads", a->workloads, "comma-separated")->capture_default_str();
  cmd->add_option("--layouts", a->layouts, "comma-separated")->capture_default_str();
  cmd->add_option("--mesh", a->o.mesh, "mesh of the multi-worker layouts")->capture_default_str();
  cmd->add_option("--steps", a->o.steps, "timed steps per run")
      ->check(CLI::Range(1, INT_MAX))
      ->capture_default_str();
  cmd->add_option("--steps-per-call", a->o.steps_per_call,
                  "train steps per call, run back to back on the workers (steps_per_execution)")
      ->check(CLI::Range(1, INT_MAX))
      ->capture_default_str();
  cmd->add_flag("--no-shm", a->no_shm, kNoShmHelp);
  cmd->add_option("--precision", a->precision, kPrecisionHelp)
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();
  cmd->callback([a, exit_code] {
    a->o.workloads = SplitCsv(a->workloads);
    a->o.layouts = SplitCsv(a->layouts);
    a->o.shm_transport = !a->no_shm;
    a->o.dtype = a->precision == "bf16" ? v1::DTYPE_BF16 : v1::DTYPE_F32;
    *exit_code = RunStepBench(a->o);
  });
}

void AddKernels(CLI::App& bench, int* exit_code) {
  struct Args {
    KernelBenchOptions o;
    std::string workloads = "classifier,mlp,dot_relu_dot", layouts = "single",
                precisions = "f32,bf16";
  };
  auto a = std::make_shared<Args>();
  auto* cmd = bench.add_subcommand(
      "kernels", "GFLOP/s of the seeds' GEMMs inside a worker beside the oneDNN primitive alone");
  cmd->add_option("--workloads", a->workloads, "comma-separated")->capture_default_str();
  cmd->add_option("--layouts", a->layouts, "comma-separated")->capture_default_str();
  cmd->add_option("--mesh", a->o.mesh, "mesh whose per-worker shapes the layouts have")
      ->capture_default_str();
  cmd->add_option("--precisions", a->precisions, "comma-separated: f32, bf16")
      ->capture_default_str();
  cmd->add_option("--min-seconds", a->o.min_seconds, "time per GEMM alone")
      ->check(CLI::Range(0.0, 60.0))
      ->capture_default_str();
  cmd->add_option("--steps", a->o.steps, "whole steps timed in the worker")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  cmd->callback([a, exit_code] {
    a->o.workloads = SplitCsv(a->workloads);
    a->o.layouts = SplitCsv(a->layouts);
    a->o.precisions = SplitCsv(a->precisions);
    for (const std::string& p : a->o.precisions) {
      if (p != "f32" && p != "bf16") {
        std::fprintf(stderr, "meshrun bench kernels: --precisions: '%s'; expected f32 or bf16\n",
                     p.c_str());
        *exit_code = 2;
        return;
      }
    }
    *exit_code = RunKernelBench(a->o);
  });
}

}  // namespace

void AddBenchCommands(CLI::App& app, int* exit_code) {
  auto* bench = app.add_subcommand("bench", "benchmarks over real local clusters");
  bench->require_subcommand(1);
  AddAllReduce(*bench, exit_code);
  AddCollectivesAndTrain(*bench, exit_code);
  AddInputAndCkpt(*bench, exit_code);
  AddStep(*bench, exit_code);
  AddKernels(*bench, exit_code);
}

}  // namespace meshrun::cli
