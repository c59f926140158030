// Whole-cluster benchmarks run by `meshrun bench ...`: real coordinator and worker processes on
// this host (or, for `bench allreduce --netns`, in network namespaces of it), timed from the
// outside. Collectives go through shared memory (worker/shm_transport.h)
// unless `shm_transport` is false, when they take the loopback gRPC ring as between hosts.
#ifndef MESHRUN_BENCH_BENCH_H_
#define MESHRUN_BENCH_BENCH_H_

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace meshrun {

struct AllReduceBenchOptions {
  std::vector<int> workers = {2, 4, 8};
  std::vector<int64_t> sizes_bytes;  // empty: 4 KiB, 16 KiB, ..., 64 MiB
  int iters = 0;                     // 0: scaled to the size
  bool shm_transport = true;
  bool insecure = false;  // no TLS between the processes (to measure what TLS costs)
  // Each run for every size: "" (by size, as programs run), "ring", "recursive_doubling".
  std::vector<std::string> algorithms = {""};
  // Each worker on a host of its own (bench/netns_hosts.h: a network namespace on a bridge; the
  // gRPC transport, as between hosts; needs root), with this one-way delay added to every packet
  // a worker sends (tc netem; 0: none).
  bool netns = false;
  int64_t netem_delay_us = 0;
  // Each run with the workers' --grpc_stripes set to this (GrpcStripeOptions: the most streams
  // per peer a message is striped over) and --grpc_stripe_bytes to `grpc_stripe_bytes`; empty:
  // the workers' defaults.
  std::vector<int> grpc_stripes;
  int64_t grpc_stripe_bytes = 0;  // 0: the workers' default
  // Each run with the workers' --ring_chunk_bytes set to this (CollectiveOptions::chunk_bytes: the
  // most bytes of one message), for each striping above; empty: the workers' default.
  std::vector<int64_t> ring_chunk_bytes;
  std::string bin_dir;
};
// Prints, per worker count, message size and algorithm: p50 time per all-reduce, algbw and busbw
// (nccl-tests: busbw = algbw * 2(n-1)/n). Returns a process exit code.
int RunAllReduceBench(const AllReduceBenchOptions& options);

struct CollectivesBenchOptions {
  std::string mesh = "data=2,model=4";
  std::vector<int64_t> sizes_bytes = {4 << 10, 1 << 20, 16 << 20};
  bool shm_transport = true;
  std::string bin_dir;
};
// Prints p50 time, algbw and busbw of psum, all_gather, psum_scatter and ppermute over each axis
// of the mesh (nccl-tests' definitions). Returns a process exit code.
int RunCollectivesBench(const CollectivesBenchOptions& options);

struct TrainBenchOptions {
  std::vector<int> workers = {1, 2, 8};
  int steps = 600;
  bool insecure = false;          // no TLS between the processes (to measure what TLS costs)
  std::string precision = "f32";  // the job config's precision.compute: f32 or bf16
  std::string reduce = "f32";     // the job config's precision.reduce: f32 or bf16
  int num_minibatches = 4;        // the job config's optimizer.num_minibatches (of 128)
  bool shm_transport = true;      // false: collectives over the loopback gRPC ring
  std::string bin_dir;
};
// Prints steady-state samples/s of the main job (the seed's DPClassifier on Fashion-MNIST) for
// each worker count. Returns a process exit code.
int RunTrainBench(const TrainBenchOptions& options);

struct StepBenchOptions {
  std::vector<std::string> workloads = {"mlp", "dot_relu_dot",
                                        "classifier"};  // meshrun/workloads.h
  std::vector<std::string> layouts = {"single", "dp", "fsdp", "tp", "2d"};
  std::string mesh = "data=2,model=4";  // the "single" layout runs on one worker
  int steps = 10;                       // timed steps (after `warmup`)
  int warmup = 2;
  // Train steps per call (TrainState::Steps, Keras's steps_per_execution): 1 times each step's
  // round trip from the client; more time the steps back to back on the workers.
  int steps_per_call = 1;
  bool shm_transport = true;
  // The layers' compute dtype (meshrun/workloads.h's WorkloadOptions): f32, or bf16 for mixed
  // precision (f32 parameters and optimizer state).
  DType dtype = v1::DTYPE_F32;
  std::string bin_dir;
};
// Prints, per workload and layout: p50 step time (client-side: a call's time over its steps),
// samples/s, the first and last loss, params + optimizer state per worker and the workers' peak RSS
// (VmHWM). Returns a process exit code.
int RunStepBench(const StepBenchOptions& options);

struct KernelBenchOptions {
  std::vector<std::string> workloads = {"classifier", "mlp",
                                        "dot_relu_dot"};  // meshrun/workloads.h
  // "single" runs on one worker with every core; the others on `mesh`, a worker per device (on
  // this 2-core machine 8 workers share the cores, so their kernels wait for each other).
  std::vector<std::string> layouts = {"single"};
  std::string mesh = "data=2,model=4";
  std::vector<std::string> precisions = {"f32", "bf16"};
  double min_seconds = 0.1;  // each GEMM timed alone
  int steps = 50;            // whole steps timed in the worker
  std::string bin_dir;
};
// Prints, per workload, layout, precision and GEMM signature of its partitioned train step
// (per-worker shapes, MatmulShapeLabel; runs per step), the GFLOP/s worker 0 reaches with it
// while running whole steps (its kernel histogram, labelled by shape) beside the same oneDNN
// primitive run alone in this process with the worker's threads, and their ratio; then every
// GEMM of one step, in the worker and alone. TLS off. Returns a process exit code.
int RunKernelBench(const KernelBenchOptions& options);

struct CkptBenchOptions {
  std::string workload =
      "mlp";  // seed 000's TrainState: 4 x 2 x 1024 x 1024 params + Adam, ~100 MB
  std::string layout = "dp";
  std::string mesh = "data=8";
  std::string dir;  // empty: a directory under the system temp dir
  int steps = 5;    // for the reference step time
  int repeats = 2;
  std::string bin_dir;
};
// Prints save and restore time and aggregate GB/s (restore from the page cache), and how long an
// async save blocks the step loop, in seconds and in step times. Returns a process exit code.
int RunCkptBench(const CkptBenchOptions& options);

struct InputBenchOptions {
  std::vector<int> workers = {1, 2, 8};
  int steps = 2000;
  int warmup = 20;
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
};
// Prints the steps/s and samples/s the main job's input pipeline (core/data/input_pipeline.h)
// delivers alone to one rank for each worker count, with and without prefetching, and the bytes
// it reads per step: the rate a step can consume without waiting for its batch. Returns a
// process exit code.
int RunInputBench(const InputBenchOptions& options);

}  // namespace meshrun

#endif  // MESHRUN_BENCH_BENCH_H_
