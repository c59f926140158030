// The fused element-wise kernel compiled (fused_elementwise_jit.h) against the same kernel
// interpreted (CreateFusedElementwise's compile = false): bitwise the same results for every fn
// (a NaN for a NaN, whatever its payload),
// with one-element operands on either side, NaNs, infinities and signed zeros, lengths that are
// no multiple of a vector, in-place updates and ranges. Without AVX-512 the compiled loop does
// not exist and the comparisons are skipped.
#include "worker/kernels/fused_elementwise_jit.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "worker/kernels/kernel.h"

namespace meshrun {
namespace {

bool HasAvx512() { return __builtin_cpu_supports("avx512f"); }

// n values: random normals, with every special (and equal pairs) scattered among them.
Tensor Values(int64_t n, uint32_t seed) {
  Tensor t(v1::DTYPE_F32, {n});
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  const float inf = std::numeric_limits<float>::infinity();
  const float specials[] = {0.0f, -0.0f, inf, -inf, std::nanf(""), -std::nanf("7"), 1.0f, -1.0f};
  for (int64_t i = 0; i < n; ++i) {
    t.data<float>()[i] = gen() % 4 == 0 ? specials[gen() % 8] : normal(gen);
  }
  return t;
}

Tensor One(float v) {
  Tensor t(v1::DTYPE_F32, {1});
  t.data<float>()[0] = v;
  return t;
}

// Runs the kernel compiled and interpreted; expects the same bits in every output.
void ExpectSameBits(const std::vector<FusedInstruction>& ops, const std::vector<Tensor>& inputs,
                    const std::vector<int>& output_instrs, const std::string& what) {
  int64_t n = 1;
  for (const Tensor& t : inputs) n = std::max(n, t.num_elements());
  std::vector<const Tensor*> in;
  for (const Tensor& t : inputs) in.push_back(&t);
  std::vector<Tensor> compiled, interpreted;
  std::vector<Tensor*> compiled_out, interpreted_out;
  for (size_t o = 0; o < output_instrs.size(); ++o) {
    compiled.emplace_back(v1::DTYPE_F32, Dims{n});
    interpreted.emplace_back(v1::DTYPE_F32, Dims{n});
  }
  for (size_t o = 0; o < output_instrs.size(); ++o) {
    compiled_out.push_back(&compiled[o]);
    interpreted_out.push_back(&interpreted[o]);
  }
  auto a = CreateFusedElementwise(ops, in, output_instrs, compiled_out, /*compile=*/true);
  auto b = CreateFusedElementwise(ops, in, output_instrs, interpreted_out, /*compile=*/false);
  ASSERT_TRUE(a.ok() && b.ok()) << what << ": " << a.status() << " " << b.status();
  ASSERT_TRUE((*a)->Run().ok() && (*b)->Run().ok()) << what;
  for (size_t o = 0; o < output_instrs.size(); ++o) {
    for (int64_t i = 0; i < n; ++i) {
      const float u = compiled[o].data<float>()[i], v = interpreted[o].data<float>()[i];
      if (std::isnan(u) && std::isnan(v)) continue;  // which NaN payload: the operand order's
      uint32_t x, y;
      std::memcpy(&x, &u, 4);
      std::memcpy(&y, &v, 4);
      ASSERT_EQ(x, y) << what << ", output " << o << ", element " << i << ": "
                      << compiled[o].data<float>()[i] << " vs " << interpreted[o].data<float>()[i];
    }
  }
}

TEST(FusedElementwiseJitTest, EveryFnGivesTheInterpretersBits) {
  if (!HasAvx512()) GTEST_SKIP() << "no AVX-512F: the kernel is interpreted";
  const int64_t n = 1000 + 7;  // a tail past the last whole vector
  const Tensor x = Values(n, 1), y = Values(n, 2), z = Values(n, 3);
  // y drawn from x in places, so that equal operands (and +0 against -0) are compared.
  Tensor y_like_x = y;
  for (int64_t i = 0; i < n; i += 3) y_like_x.data<float>()[i] = x.data<float>()[i];
  for (int64_t i = 1; i < n; i += 9) y_like_x.data<float>()[i] = -x.data<float>()[i];
  for (const char* fn :
       {"add", "sub", "mul", "div", "max", "min", "eq", "ne", "lt", "le", "gt", "ge"}) {
    ExpectSameBits({{fn, {0, 1}}}, {x, y_like_x}, {0}, fn);
    ExpectSameBits({{fn, {0, 1}}}, {One(-0.0f), x}, {0}, std::string(fn) + " with x one value");
    ExpectSameBits({{fn, {0, 1}}}, {x, One(std::nanf(""))}, {0}, std::string(fn) + " with NaN y");
    ExpectSameBits({{fn, {0, 1}}}, {x, One(0.5f)}, {0}, std::string(fn) + " with y one value");
  }
  for (const char* fn : {"neg", "abs", "square", "sqrt"}) ExpectSameBits({{fn, {0}}}, {x}, {0}, fn);
  ExpectSameBits({{"select", {0, 1, 2}}}, {x, y, z}, {0}, "select");
  ExpectSameBits({{"select", {0, 1, 2}}}, {x, One(2.0f), z}, {0}, "select of a one-value y");
}

// Adam's moments, bias corrections and update (optax.adam's jaxpr, as cluster.jit fuses it).
std::vector<FusedInstruction> AdamOps() {
  // Inputs 0..11: g, mu, nu, p, b1, 1 - b1, b2, 1 - b2, 1 - b1^t, 1 - b2^t, eps, -lr.
  return {{"mul", {1, 4}},   {"mul", {0, 5}},   {"add", {12, 13}},                     // 14: mu
          {"square", {0}},   {"mul", {2, 6}},   {"mul", {15, 7}},  {"add", {16, 17}},  // 18: nu
          {"div", {14, 8}},  {"div", {18, 9}},  {"sqrt", {20}},    {"add", {21, 10}},
          {"div", {19, 22}}, {"mul", {23, 11}}, {"add", {3, 24}}};  // 25: p
}

TEST(FusedElementwiseJitTest, AnInPlaceAdamStepOverRangesGivesTheInterpretersBits) {
  if (!HasAvx512()) GTEST_SKIP() << "no AVX-512F: the kernel is interpreted";
  const int64_t n = 5000 + 3;
  std::vector<Tensor> state[2];  // g, mu, nu, p for each way of running
  for (auto& s : state) {
    s = {Values(n, 4), Values(n, 5), Values(n, 6), Values(n, 7)};
    for (int64_t i = 0; i < n; ++i) s[2].data<float>()[i] = std::abs(s[2].data<float>()[i]);
  }
  const std::vector<Tensor> scalars = {One(0.9f),   One(0.1f),   One(0.999f), One(0.001f),
                                       One(0.271f), One(0.003f), One(1e-8f),  One(-1e-3f)};
  const Tensor reduced = Values(n, 8);  // the all-reduced gradient, read from other memory
  for (int way = 0; way < 2; ++way) {
    std::vector<Tensor>& s = state[way];
    std::vector<const Tensor*> in = {&s[0], &s[1], &s[2], &s[3]};
    for (const Tensor& t : scalars) in.push_back(&t);
    auto k = CreateFusedElementwiseRange(AdamOps(), in, {2, 6, 13}, {&s[1], &s[2], &s[3]},
                                         /*compile=*/way == 0);
    ASSERT_TRUE(k.ok()) << k.status();
    for (int step = 0; step < 3; ++step) {  // ranges as a reduce-update calls them, odd lengths
      for (int64_t at = 0; at < n;) {
        const int64_t len = std::min<int64_t>(n - at, 1000 + 17 * step);
        ASSERT_TRUE((*k)->RunRange(at, len, reduced.data<float>() + at).ok());
        at += len;
      }
    }
  }
  for (int t = 1; t < 4; ++t) {
    for (int64_t i = 0; i < n; ++i) {
      const float u = state[0][t].data<float>()[i], v = state[1][t].data<float>()[i];
      if (std::isnan(u) && std::isnan(v)) continue;
      ASSERT_EQ(std::memcmp(&u, &v, 4), 0) << "state " << t << ", element " << i;
    }
  }
  // And the step changed the parameters (the comparison is not of two untouched copies).
  const Tensor p0 = Values(n, 7);
  EXPECT_NE(std::memcmp(state[0][3].raw(), p0.raw(), n * sizeof(float)), 0);
}

TEST(FusedElementwiseJitTest, OpsNeedingMoreRegistersThanThereAreAreInterpreted) {
  // 40 one-element inputs all live until the last op: more than zmm0..zmm31.
  std::vector<fused::Instr> chain;
  std::vector<bool> is_scalar(41, true), in_place(41, false);
  is_scalar[0] = false;
  for (int k = 0; k < 40; ++k) chain.push_back({fused::Fn::kMul, 0, 1 + k});  // x * s_k
  for (int k = 1; k < 40; ++k) chain.push_back({fused::Fn::kAdd, 41 + k - 1, 41 + k});
  EXPECT_EQ(FusedElementwiseJit::Create(chain, is_scalar, in_place, {78}), nullptr);
  if (!HasAvx512()) return;
  chain.resize(1);
  EXPECT_NE(FusedElementwiseJit::Create(chain, {false, true}, {false, false}, {0}), nullptr);
  // The kernel of those ops still runs, interpreted: its result is the interpreter's.
  std::vector<FusedInstruction> ops;
  std::vector<Tensor> inputs = {Values(100, 9)};
  for (int k = 0; k < 40; ++k) {
    ops.push_back({"mul", {0, 1 + k}});
    inputs.push_back(One(0.5f + k));
  }
  for (int k = 1; k < 40; ++k) ops.push_back({"add", {41 + k - 1, 41 + k}});
  ExpectSameBits(ops, inputs, {78}, "40 live one-element inputs");
}

}  // namespace
}  // namespace meshrun
