// `meshrun bench kernels`: the GEMMs of the seeds' partitioned train steps, timed inside a worker
// while it runs whole steps (its meshrun_kernel_duration_seconds histogram, labelled by shape
// with --kernel_shape_labels) beside the same oneDNN primitive run alone in this process with the
// worker's thread count (benchdnn's way: one primitive, warm, over the same buffers), f32 and
// bf16.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "bench/bench.h"
#include "bench/collective_timer.h"
#include "core/array_ops.h"
#include "core/port/denormal.h"
#include "core/port/http.h"
#include "meshrun/client.h"
#include "meshrun/local_cluster.h"
#include "meshrun/workloads.h"
#include "worker/executor.h"
#include "worker/kernels/kernel.h"

namespace meshrun {
namespace {

// One GEMM of a step program: its operands' and result's declarations and its attributes.
struct Gemm {
  v1::Op op;                          // inputs a, b[, bias], output c (renamed)
  std::vector<v1::BufferDecl> decls;  // a, b[, bias], c
  int per_step = 0;                   // how many of the step's matmuls have this signature
  double flops = 0;                   // of one run
  std::string shape;                  // "[8,1024]x[1024,256] tb +bias relu acc"
};

Dims DimsOf(const v1::BufferDecl& b) {
  return Dims(b.shape().dims().begin(), b.shape().dims().end());
}

// The step's matmuls by signature, in first-seen order.
std::vector<Gemm> StepGemms(const v1::ShardMapProgram& step) {
  std::map<std::string, const v1::BufferDecl*> decls;
  for (const v1::BufferDecl& b : step.program().buffers()) decls[b.name()] = &b;
  std::vector<Gemm> out;
  std::map<std::string, size_t> seen;
  for (const v1::Op& op : step.program().functions(0).ops()) {
    if (op.kind() != v1::OP_MATMUL) continue;
    Gemm g;
    g.op = op;
    const char* names[] = {"a", "b", "bias"};
    for (int i = 0; i < op.inputs_size(); ++i) {
      v1::BufferDecl d = *decls.at(op.inputs(i));
      d.set_name(names[i]);
      d.clear_sharding();
      g.op.set_inputs(i, names[i]);
      g.decls.push_back(d);
    }
    v1::BufferDecl c = *decls.at(op.outputs(0));
    c.set_name("c");
    c.clear_sharding();
    g.op.set_outputs(0, "c");
    g.decls.push_back(c);
    const Dims a = DimsOf(g.decls[0]), cd = DimsOf(c);
    const int64_t k = a.size() == 3 ? a[2] : (op.transpose_a() ? a[0] : a[1]);
    g.flops = 2.0 * k;
    for (int64_t d : cd) g.flops *= d;
    g.shape = MatmulShapeLabel(op, a, DimsOf(g.decls[1]), g.decls[0].dtype(), c.dtype());
    auto [it, inserted] = seen.emplace(g.shape, out.size());
    if (inserted) out.push_back(std::move(g));
    ++out[it->second].per_step;
  }
  return out;
}

Tensor RandomTensor(const v1::BufferDecl& d, uint32_t seed) {
  Tensor f(v1::DTYPE_F32, DimsOf(d));
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (int64_t i = 0; i < f.num_elements(); ++i) f.data<float>()[i] = dist(rng);
  if (d.dtype() == v1::DTYPE_F32) return f;
  Tensor t = Tensor::Uninitialized(d.dtype(), f.dims());
  Convert(f, t);
  return t;
}

// Seconds per run of the GEMM as a oneDNN primitive in this process: hot (run after run over the
// same buffers, as benchdnn does by default), with the cores' L2 caches flushed before each run,
// and with every cache flushed (benchdnn's --cold-cache idea): the flushes are oneDNN passes over
// 32 MiB (L2) or twice the last-level cache (at most 1 GiB) on every thread, untimed. Warm-up runs,
// then runs until `min_seconds` of GEMM time (at least 10; at most 200 L2-cold and 10 cold ones).
struct Standalone {
  double hot = 0, l2_cold = 0, cold = 0;
};

// The two cache flushes, made once per bench: each reads one buffer and writes the other.
class Flushes {
 public:
  static absl::StatusOr<std::unique_ptr<Flushes>> Create(int64_t llc_bytes) {
    const int64_t big = std::min(int64_t{1} << 29, std::max(int64_t{16} << 20, llc_bytes)) / 4;
    auto f = std::unique_ptr<Flushes>(new Flushes(big));
    absl::StatusOr<std::unique_ptr<Kernel>> l2 = CreateUnary("neg", f->l2_in_, f->l2_out_);
    if (!l2.ok()) return l2.status();
    absl::StatusOr<std::unique_ptr<Kernel>> all = CreateUnary("neg", f->all_in_, f->all_out_);
    if (!all.ok()) return all.status();
    f->l2 = *std::move(l2);
    f->all = *std::move(all);
    return f;
  }
  std::unique_ptr<Kernel> l2, all;  // 2 x 16 MiB; 2 x the LLC (at most 2 x 512 MiB)

 private:
  explicit Flushes(int64_t big)
      : l2_in_(v1::DTYPE_F32, {int64_t{4} << 20}),
        l2_out_(v1::DTYPE_F32, {int64_t{4} << 20}),
        all_in_(v1::DTYPE_F32, {big}),
        all_out_(v1::DTYPE_F32, {big}) {}
  Tensor l2_in_, l2_out_, all_in_, all_out_;
};

absl::StatusOr<Standalone> StandaloneSeconds(const Gemm& g, double min_seconds,
                                             const Flushes& flushes) {
  std::vector<Tensor> in;
  for (size_t i = 0; i + 1 < g.decls.size(); ++i) in.push_back(RandomTensor(g.decls[i], 7 + i));
  Tensor c = RandomTensor(g.decls.back(), 3);
  absl::StatusOr<std::unique_ptr<Kernel>> k =
      CreateMatmul(in[0], in[1], in.size() == 3 ? &in[2] : nullptr, c, MatmulOptionsOf(g.op));
  if (!k.ok()) return k.status();
  for (int i = 0; i < 5; ++i) {
    if (absl::Status s = (*k)->Run(); !s.ok()) return s;
  }
  Standalone out;
  Kernel* l2 = flushes.l2.get();
  for (Kernel* flush : {static_cast<Kernel*>(nullptr), l2, flushes.all.get()}) {
    // Flushed runs: 10 to 200 behind an L2 flush, 10 behind a full one (each a pass over GiBs).
    const int max_runs = flush == nullptr ? INT_MAX : flush == l2 ? 200 : 10;
    int runs = 0;
    double elapsed = 0;
    while (runs < 10 || (elapsed < min_seconds && runs < max_runs)) {
      if (flush != nullptr) {
        if (absl::Status s = flush->Run(); !s.ok()) return s;
      }
      const auto t0 = std::chrono::steady_clock::now();
      if (absl::Status s = (*k)->Run(); !s.ok()) return s;
      elapsed += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      ++runs;
    }
    (flush == nullptr ? out.hot : flush == l2 ? out.l2_cold : out.cold) = elapsed / runs;
  }
  return out;
}

// The worker's matmul histograms by shape label: total seconds and count so far.
using KernelTimes = std::map<std::string, std::pair<double, double>>;
absl::StatusOr<KernelTimes> WorkerMatmulTimes(const std::string& metrics_address) {
  const std::string text = HttpGet(metrics_address, "/metrics");
  KernelTimes times;
  std::istringstream lines(text);
  std::string line;
  const std::string key = "meshrun_kernel_duration_seconds_";
  while (std::getline(lines, line)) {
    const size_t shape = line.find("shape=\"");
    if (line.rfind(key, 0) != 0 || line.find("kernel=\"matmul\"") == std::string::npos ||
        shape == std::string::npos) {
      continue;
    }
    const size_t end = line.find('"', shape + 7);
    const std::string label = line.substr(shape + 7, end - shape - 7);
    const double v = std::stod(line.substr(line.rfind(' ') + 1));
    if (line.rfind(key + "sum", 0) == 0) times[label].first = v;
    if (line.rfind(key + "count", 0) == 0) times[label].second = v;
  }
  if (times.empty()) {
    return absl::UnavailableError(
        absl::StrCat("no matmul histogram by shape at http://", metrics_address, "/metrics (",
                     text.size(), " bytes; is the worker's --kernel_shape_labels on?)"));
  }
  return times;
}

// Each GEMM signature's seconds and runs over `steps` whole steps on rank 0, the step's batch put
// once. An untimed call of the same steps comes first: a worker's first steps of a program fault
// in the memory its arena grows to (the seed MLP's [1024,1024] weight-gradient GEMMs took 13 ms
// each over steps 2-7, against 0.5 ms after, by DNNL_VERBOSE), which is start-up, not the kernel.
absl::StatusOr<KernelTimes> StepKernelTimes(Client& client, const TrainStep& step,
                                            const std::vector<Tensor>& batch, int steps) {
  absl::StatusOr<v1::GetStatusResponse> st = client.GetStatus();
  if (!st.ok()) return st.status();
  std::string metrics;
  for (const auto& w : st->workers())
    if (w.peer().rank() == 0) metrics = w.peer().metrics_address();
  absl::StatusOr<TrainState> state = TrainState::Init(&client, &step);
  if (!state.ok()) return state.status();
  std::vector<std::string> ids;
  for (size_t i = 0; i < batch.size(); ++i) {
    absl::StatusOr<v1::ArrayInfo> a = client.Put(batch[i], step.batch[i].spec);
    if (!a.ok()) return a.status();
    ids.push_back(a->id());
  }
  if (absl::StatusOr<std::vector<float>> warm =
          state->Steps(std::vector<std::vector<std::string>>(steps, ids));
      !warm.ok()) {
    return warm.status();
  }
  absl::StatusOr<KernelTimes> before = WorkerMatmulTimes(metrics);
  if (!before.ok()) return before.status();
  absl::StatusOr<std::vector<float>> losses =
      state->Steps(std::vector<std::vector<std::string>>(steps, ids));
  if (!losses.ok()) return losses.status();
  absl::StatusOr<KernelTimes> after = WorkerMatmulTimes(metrics);
  if (!after.ok()) return after.status();
  state->Delete().IgnoreError();
  for (const std::string& id : ids) client.Delete(id).IgnoreError();
  for (auto& [label, t] : *after) {
    t.first -= (*before)[label].first;
    t.second -= (*before)[label].second;
  }
  return after;
}

int Fail(const absl::Status& s, const std::string& what) {
  std::fprintf(stderr, "meshrun bench kernels: %s: %s\n", what.c_str(),
               std::string(s.message()).c_str());
  return 1;
}

}  // namespace

int RunKernelBench(const KernelBenchOptions& o) {
  FlushDenormalsToZero();  // as the workers do
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  absl::StatusOr<std::unique_ptr<Flushes>> flushes =
      Flushes::Create(2 * std::max<int64_t>(sysconf(_SC_LEVEL3_CACHE_SIZE), 32 << 20));
  if (!flushes.ok()) return Fail(flushes.status(), "cache flushes");
  // Every standalone time first, before any worker exists: a worker's OpenMP threads spin for a
  // while after each kernel and would take the cores from this process's.
  struct Case {
    std::string workload, layout, precision, mesh;
    Workload w;
    TrainStep step;
    int threads = 1;  // each worker's oneDNN threads, as LocalCluster gives them
    std::vector<Gemm> gemms;
    std::vector<Standalone> alone;  // seconds per run
  };
  std::vector<Case> cases;
  for (const std::string& precision : o.precisions) {
    const DType dtype = precision == "bf16" ? v1::DTYPE_BF16 : v1::DTYPE_F32;
    for (const std::string& name : o.workloads) {
      absl::StatusOr<Workload> w = SeedWorkload(name, {dtype});
      if (!w.ok()) return Fail(w.status(), name);
      for (const std::string& layout : o.layouts) {
        absl::StatusOr<nn::ShardingConfig> sharding = LayoutSharding(layout);
        if (!sharding.ok()) return Fail(sharding.status(), layout);
        const std::string mesh_text = layout == "single" ? "data=1" : o.mesh;
        absl::StatusOr<Mesh> mesh = Mesh::Parse(mesh_text);
        if (!mesh.ok()) return Fail(mesh.status(), mesh_text);
        absl::StatusOr<TrainStep> step = BuildTrainStep(*mesh, *sharding, w->optimizer, w->batch,
                                                        w->loss, 0, w->num_minibatches);
        if (!step.ok()) return Fail(step.status(), absl::StrCat(name, " ", layout));
        Case c{name, layout, precision, mesh_text, *w, *std::move(step), 1, {}, {}};
        c.threads = std::max(1, cores / c.step.mesh.size());
        SetComputeThreads(c.threads);
        c.gemms = StepGemms(c.step.step);
        for (const Gemm& g : c.gemms) {
          absl::StatusOr<Standalone> alone = StandaloneSeconds(g, o.min_seconds, **flushes);
          if (!alone.ok()) return Fail(alone.status(), g.shape);
          c.alone.push_back(*alone);
        }
        cases.push_back(std::move(c));
      }
    }
  }
  const char* wait = std::getenv("OMP_WAIT_POLICY");
  std::printf(
      "# GEMMs of the seeds' partitioned train steps: GFLOP/s inside worker 0 over %d whole steps "
      "(its kernel histogram by shape) beside the same oneDNN primitive alone in this process "
      "(OMP_WAIT_POLICY=%s): hot, with the L2 caches flushed before each run, and with every "
      "cache flushed; GFLOP/s, and the worker's over each; %d cores\n",
      o.steps, wait != nullptr ? wait : "unset", cores);
  std::printf("%-13s %-7s %-5s %7s %-46s %5s %8s %8s %8s %8s %6s %6s %6s\n", "workload", "layout",
              "dtype", "threads", "op(a) x op(b)", "/step", "worker", "hot", "L2-cold", "cold",
              "/hot", "/L2", "/cold");
  for (const Case& c : cases) {
    auto cluster = StartBenchCluster(c.mesh, o.bin_dir, c.threads, true, true, nullptr,
                                     {"--kernel_shape_labels"});
    if (cluster == nullptr) return 1;
    auto client = Client::Connect(cluster->coordinator_address());
    if (!client.ok()) return Fail(client.status(), "connect");
    absl::StatusOr<std::vector<Tensor>> batch = SeedWorkloadBatch(c.w);
    if (!batch.ok()) return Fail(batch.status(), c.workload);
    absl::StatusOr<KernelTimes> times = StepKernelTimes(**client, c.step, *batch, o.steps);
    if (!times.ok()) return Fail(times.status(), absl::StrCat(c.workload, " ", c.layout));
    double in_step = 0;
    Standalone step;  // per step
    for (size_t i = 0; i < c.gemms.size(); ++i) {
      const Gemm& g = c.gemms[i];
      const auto [seconds, runs] = (*times)[g.shape];
      if (runs <= 0) return Fail(absl::NotFoundError("no runs in the worker"), g.shape);
      const double in = seconds / runs;  // per run
      const Standalone& a = c.alone[i];
      in_step += seconds / o.steps;
      step.hot += a.hot * g.per_step;
      step.l2_cold += a.l2_cold * g.per_step;
      step.cold += a.cold * g.per_step;
      std::printf("%-13s %-7s %-5s %7d %-46s %5.0f %8.1f %8.1f %8.1f %8.1f %5.2fx %5.2fx %5.2fx\n",
                  c.workload.c_str(), c.layout.c_str(), c.precision.c_str(), c.threads,
                  g.shape.c_str(), runs / o.steps, g.flops / in / 1e9, g.flops / a.hot / 1e9,
                  g.flops / a.l2_cold / 1e9, g.flops / a.cold / 1e9, a.hot / in, a.l2_cold / in,
                  a.cold / in);
    }
    std::printf(
        "%-13s %-7s %-5s %7d %-46s %5s %6.2fms %6.2fms %6.2fms %6.2fms %5.2fx %5.2fx %5.2fx\n",
        c.workload.c_str(), c.layout.c_str(), c.precision.c_str(), c.threads,
        "every GEMM of one step", "", in_step * 1e3, step.hot * 1e3, step.l2_cold * 1e3,
        step.cold * 1e3, step.hot / in_step, step.l2_cold / in_step, step.cold / in_step);
    std::fflush(stdout);
    cluster->Stop().IgnoreError();
  }
  return 0;
}

}  // namespace meshrun
