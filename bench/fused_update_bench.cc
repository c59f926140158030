// Google Benchmark: one Adam step over n f32 elements, in place, as the two update paths run it.
//   BM_FusedElementwiseAdam/n/loop: optax.adam's element-wise ops (scale_by_adam's moments
//     and bias corrections, scale(-lr), apply_updates) as one OP_FUSED_ELEMENTWISE kernel, the
//     path a jaxpr-derived update takes (cluster.jit); called over 64 KiB chunks as a
//     reduce-update does, with the reduced gradient chunk in cache. loop 0: the interpreter;
//     1: the loop the kernel compiles (fused_elementwise_jit.h: AVX-512, which divides by the
//     bias corrections' reciprocals with an FMA correction, or AVX2 without it); 2: the AVX2
//     loop even where AVX-512 exists.
//   BM_AdamWKernel: the same step through core/optim's AdamWUpdate, the path OP_ADAM_UPDATE
//     takes (the C++ SDK's optimizer).
// Both read the gradient, parameter and moments and write the parameter and moments; the
// interpreter also passes through its scratch rows, once per op; the compiled loop and
// AdamWUpdate hold their intermediates in registers.
//   BM_AdamWEachParam / BM_AdamWSweep: the main job's model (784-512-10: four parameters, 407,050
//     elements) updated one AdamWUpdate per parameter, as before the executor joined them, and
//     as one AdamWSweep over all four on the OpenMP team (OMP_NUM_THREADS; all cores by default).
//   BM_SumTwoPartials/n/fused: the reduction a single-copy all-reduce + update does before the
//     update, of two members' partial gradients, 64 KiB chunk by chunk into a scratch chunk:
//     fused 0 copies the first partial and adds the second in (memcpy, then AddInto), fused 1
//     adds both in one pass (Add); the same bits.
// Run: OMP_NUM_THREADS=1 build/bin/fused_update_bench   (items_per_second: elements per second;
// one thread, as each worker of a local cluster computes)
#include <algorithm>
#include <cstring>
#include <vector>

#include "benchmark/benchmark.h"
#include "core/collectives/reduce_kernels.h"
#include "core/optim/adamw.h"
#include "core/tensor.h"
#include "worker/kernels/kernel.h"

namespace meshrun {
namespace {

constexpr int64_t kChunk = 16384;  // elements per RunRange call: 64 KiB of f32

struct State {
  explicit State(int64_t n)
      : g(v1::DTYPE_F32, {n}),
        p(v1::DTYPE_F32, {n}),
        mu(v1::DTYPE_F32, {n}),
        nu(v1::DTYPE_F32, {n}),
        reduced(kChunk, 0.01f) {
    for (int64_t i = 0; i < n; ++i) {
      g.data<float>()[i] = 0.001f * static_cast<float>(i % 97);
      p.data<float>()[i] = 0.5f;
      mu.data<float>()[i] = 0.0f;
      nu.data<float>()[i] = 0.0f;
    }
  }
  Tensor g, p, mu, nu;
  std::vector<float> reduced;
};

Tensor Scalar(float v) {
  Tensor t(v1::DTYPE_F32, {1});
  t.data<float>()[0] = v;
  return t;
}

// bench.range(1): 0 runs the interpreter, 1 the compiled loop, 2 the AVX2 loop.
void BM_FusedElementwiseAdam(benchmark::State& bench) {
  const int64_t n = bench.range(0);
  const FusedLoop loop = bench.range(1) == 0   ? FusedLoop::kInterpreted
                         : bench.range(1) == 1 ? FusedLoop::kCompiled
                                               : FusedLoop::kAvx2;
  State s(n);
  Tensor b1 = Scalar(0.9f), omb1 = Scalar(0.1f), b2 = Scalar(0.999f), omb2 = Scalar(0.001f),
         bc1 = Scalar(0.1f), bc2 = Scalar(0.001f), eps = Scalar(1e-8f), neg_lr = Scalar(-1e-3f);
  // Inputs 0..11: g, mu, nu, p, b1, 1 - b1, b2, 1 - b2, 1 - b1^t, 1 - b2^t, eps, -lr.
  const std::vector<const Tensor*> inputs = {&s.g, &s.mu, &s.nu, &s.p, &b1,  &omb1,
                                             &b2,  &omb2, &bc1,  &bc2, &eps, &neg_lr};
  const std::vector<FusedInstruction> ops = {
      {"mul", {1, 4}},   {"mul", {0, 5}},   {"add", {12, 13}},                     // 14: mu
      {"square", {0}},   {"mul", {2, 6}},   {"mul", {15, 7}},  {"add", {16, 17}},  // 18: nu
      {"div", {14, 8}},  {"div", {18, 9}},  {"sqrt", {20}},    {"add", {21, 10}},
      {"div", {19, 22}}, {"mul", {23, 11}}, {"add", {3, 24}}};  // 25: p
  auto kernel = CreateFusedElementwiseRange(ops, inputs, {2, 6, 13}, {&s.mu, &s.nu, &s.p}, loop);
  if (!kernel.ok()) {
    bench.SkipWithError(std::string(kernel.status().message()).c_str());
    return;
  }
  for (auto _ : bench) {
    for (int64_t b = 0; b < n; b += kChunk) {
      if (!(*kernel)->RunRange(b, std::min(kChunk, n - b), s.reduced.data()).ok()) {
        bench.SkipWithError("RunRange failed");
        return;
      }
    }
  }
  bench.SetItemsProcessed(bench.iterations() * n);
}

void BM_AdamWKernel(benchmark::State& bench) {
  const int64_t n = bench.range(0);
  State s(n);
  AdamWHyperParams hp;
  hp.weight_decay = 0.0f;  // optax.adam
  for (auto _ : bench) {
    for (int64_t b = 0; b < n; b += kChunk) {
      const int64_t len = std::min(kChunk, n - b);
      float* p = s.p.data<float>() + b;
      float* mu = s.mu.data<float>() + b;
      float* nu = s.nu.data<float>() + b;
      AdamWUpdate(hp, 1, p, s.reduced.data(), mu, nu, p, mu, nu, len);
    }
  }
  bench.SetItemsProcessed(bench.iterations() * n);
}

// The main job's parameters: w1 784x512, b1 512, w2 512x10, b2 10.
const std::vector<int64_t> kModelSizes = {784 * 512, 512, 5120, 10};

struct ModelState {
  ModelState() {
    for (int64_t n : kModelSizes) params.emplace_back(n);
  }
  std::vector<State> params;
  int64_t elements() const {
    int64_t total = 0;
    for (int64_t n : kModelSizes) total += n;
    return total;
  }
};

void BM_AdamWEachParam(benchmark::State& bench) {
  ModelState m;
  AdamWHyperParams hp;
  for (auto _ : bench) {
    for (State& s : m.params) {
      const int64_t n = s.p.num_elements();
      AdamWUpdate(hp, 1, s.p.data<float>(), s.g.data<float>(), s.mu.data<float>(),
                  s.nu.data<float>(), n);
    }
  }
  bench.SetItemsProcessed(bench.iterations() * m.elements());
}

void BM_AdamWSweep(benchmark::State& bench) {
  ModelState m;
  AdamWHyperParams hp;
  std::vector<AdamWSegment> segments;
  for (State& s : m.params) {
    float *p = s.p.data<float>(), *mu = s.mu.data<float>(), *nu = s.nu.data<float>();
    segments.push_back({p, s.g.data<float>(), mu, nu, p, mu, nu, s.p.num_elements()});
  }
  for (auto _ : bench) AdamWSweep(hp, 1, segments);
  bench.SetItemsProcessed(bench.iterations() * m.elements());
}

BENCHMARK(BM_AdamWEachParam)->UseRealTime();
BENCHMARK(BM_AdamWSweep)->UseRealTime();

void BM_SumTwoPartials(benchmark::State& bench) {
  const int64_t n = bench.range(0);
  const bool fused = bench.range(1) != 0;
  std::vector<float> a(n, 0.25f), b(n, 0.5f), scratch(kChunk);
  for (auto _ : bench) {
    for (int64_t c = 0; c < n; c += kChunk) {
      const int64_t len = std::min(kChunk, n - c);
      if (fused) {
        Add(v1::DTYPE_F32, scratch.data(), a.data() + c, b.data() + c, len);
      } else {
        std::memcpy(scratch.data(), a.data() + c, len * sizeof(float));
        AddInto(v1::DTYPE_F32, scratch.data(), b.data() + c, len);
      }
      benchmark::DoNotOptimize(scratch.data());
    }
  }
  bench.SetItemsProcessed(bench.iterations() * n);
}

BENCHMARK(BM_SumTwoPartials)->ArgsProduct({{1 << 18, 1 << 22}, {0, 1}});

// 256 Ki elements stay in L2; 4 Mi elements (64 MiB of state) stream from memory.
BENCHMARK(BM_FusedElementwiseAdam)->ArgsProduct({{1 << 18, 1 << 22}, {0, 1, 2}});
BENCHMARK(BM_AdamWKernel)->Arg(1 << 18)->Arg(1 << 22);

}  // namespace
}  // namespace meshrun

BENCHMARK_MAIN();
