// The fused element-wise kernel compiled (fused_elementwise_jit.h), for AVX-512 and for AVX2,
// against the same kernel interpreted (FusedLoop::kInterpreted): bitwise the same results for
// every fn (a NaN for a NaN, whatever its payload), with one-element operands on either side,
// NaNs, infinities and signed zeros, lengths that are no multiple of a vector, in-place updates
// and ranges. An instruction set the CPU lacks is skipped (the kernel interprets there).
#include "worker/kernels/fused_elementwise_jit.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "core/collectives/reduce_kernels.h"
#include "gtest/gtest.h"
#include "worker/kernels/kernel.h"

namespace meshrun {
namespace {

bool Avx512() { return __builtin_cpu_supports("avx512f"); }

// The compiled loops this CPU runs: kCompiled is AVX-512's where it has it.
std::vector<FusedLoop> CompiledLoops() {
  std::vector<FusedLoop> loops;
  if (__builtin_cpu_supports("avx2")) loops.push_back(FusedLoop::kAvx2);
  if (__builtin_cpu_supports("avx512f")) loops.push_back(FusedLoop::kCompiled);
  return loops;
}

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

// Runs the kernel through each compiled loop and interpreted; expects the same bits in every
// output.
void ExpectSameBits(const std::vector<FusedInstruction>& ops, const std::vector<Tensor>& inputs,
                    const std::vector<int>& output_instrs, const std::string& what) {
  int64_t n = 1;
  for (const Tensor& t : inputs) n = std::max(n, t.num_elements());
  std::vector<const Tensor*> in;
  for (const Tensor& t : inputs) in.push_back(&t);
  auto run = [&](FusedLoop loop) {
    std::vector<Tensor> out(output_instrs.size(), Tensor(v1::DTYPE_F32, {n}));
    std::vector<Tensor*> out_ptrs;
    for (Tensor& t : out) out_ptrs.push_back(&t);
    auto k = CreateFusedElementwise(ops, in, output_instrs, out_ptrs, loop);
    EXPECT_TRUE(k.ok()) << what << ": " << k.status();
    if (k.ok()) {
      EXPECT_TRUE((*k)->Run().ok()) << what;
    }
    return out;
  };
  const std::vector<Tensor> interpreted = run(FusedLoop::kInterpreted);
  for (FusedLoop loop : CompiledLoops()) {
    const std::vector<Tensor> compiled = run(loop);
    const char* isa = loop == FusedLoop::kAvx2 ? "AVX2" : "AVX-512";
    for (size_t o = 0; o < output_instrs.size(); ++o) {
      for (int64_t i = 0; i < n; ++i) {
        const float u = compiled[o].data<float>()[i], v = interpreted[o].data<float>()[i];
        if (std::isnan(u) && std::isnan(v)) continue;  // which NaN payload: the operand order's
        uint32_t x, y;
        std::memcpy(&x, &u, 4);
        std::memcpy(&y, &v, 4);
        ASSERT_EQ(x, y) << what << " (" << isa << "), output " << o << ", element " << i << ": "
                        << u << " vs " << v;
      }
    }
  }
}

TEST(FusedElementwiseJitTest, EveryFnGivesTheInterpretersBits) {
  if (CompiledLoops().empty()) GTEST_SKIP() << "no AVX2: the kernel is interpreted";
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

// round_bf16 through every loop, and through its own unary kernel and RoundToBf16's array
// form: exactly the bits of converting to bf16 and back (F32ToBf16 then Bf16ToF32), NaNs
// included (each becomes the quiet NaN of its sign, as the conversion gives), ties to even both
// ways, the largest finite floats rounding to infinity, subnormals, and a tail past the last
// vector.
TEST(FusedElementwiseJitTest, RoundBf16GivesTheBitsOfAConvertToBf16AndBack) {
  const int64_t n = 4096 + 13;
  Tensor x(v1::DTYPE_F32, {n});
  std::mt19937 gen(11);
  const uint32_t specials[] = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u,
                               0x7f800001u, 0xffc01234u, 0x7fffffffu, 0x7f7fffffu, 0xff7fffffu,
                               0x7f7f7fffu, 0x7f7f8000u, 0x3f808000u, 0x3f818000u, 0x3f80ffffu,
                               0x00008000u, 0x00018000u, 0x807fffffu, 0x00000001u, 0x3f800000u};
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = i < 20 ? specials[i] : (i % 3 == 0 ? specials[gen() % 20] : gen());
    std::memcpy(&x.data<float>()[i], &bits, 4);
  }
  std::vector<uint32_t> want(n);
  for (int64_t i = 0; i < n; ++i) {
    const float r = Bf16ToF32(F32ToBf16(x.data<float>()[i]));
    std::memcpy(&want[i], &r, 4);
  }
  std::vector<uint32_t> want_twice(n);  // rounded, negated, rounded
  for (int64_t i = 0; i < n; ++i) {
    const float r = Bf16ToF32(F32ToBf16(-Bf16ToF32(F32ToBf16(x.data<float>()[i]))));
    std::memcpy(&want_twice[i], &r, 4);
  }
  auto wrong = [&](const Tensor& got, const std::vector<uint32_t>& bits) {
    int bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      uint32_t g;
      std::memcpy(&g, &got.data<float>()[i], 4);
      bad += g != bits[i];
    }
    return bad;
  };
  std::vector<FusedLoop> loops = CompiledLoops();
  loops.push_back(FusedLoop::kInterpreted);
  for (FusedLoop loop : loops) {
    SCOPED_TRACE(static_cast<int>(loop));
    // Rounded, then its negation rounded again (a result row as operand: no bits move).
    Tensor once(v1::DTYPE_F32, {n}), twice(v1::DTYPE_F32, {n});
    auto k = CreateFusedElementwise({{"round_bf16", {0}}, {"neg", {1}}, {"round_bf16", {2}}}, {&x},
                                    {0, 2}, {&once, &twice}, loop);
    ASSERT_TRUE(k.ok()) << k.status();
    ASSERT_TRUE((*k)->Run().ok());
    EXPECT_EQ(wrong(once, want), 0);
    EXPECT_EQ(wrong(twice, want_twice), 0);
  }
  Tensor unary(v1::DTYPE_F32, {n}), in_place = x;
  auto k = CreateUnary("round_bf16", x, unary);
  ASSERT_TRUE(k.ok()) << k.status();
  ASSERT_TRUE((*k)->Run().ok());
  EXPECT_EQ(wrong(unary, want), 0);
  RoundToBf16(in_place.data<float>(), in_place.data<float>(), n);
  EXPECT_EQ(wrong(in_place, want), 0);
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
  if (CompiledLoops().empty()) GTEST_SKIP() << "no AVX2: the kernel is interpreted";
  const int64_t n = 5000 + 3;
  const std::vector<Tensor> scalars = {One(0.9f),   One(0.1f),   One(0.999f), One(0.001f),
                                       One(0.271f), One(0.003f), One(1e-8f),  One(-1e-3f)};
  const Tensor reduced = Values(n, 8);  // the all-reduced gradient, read from other memory
  // g, mu, nu, p after three steps run through `loop`.
  auto steps = [&](FusedLoop loop) {
    std::vector<Tensor> s = {Values(n, 4), Values(n, 5), Values(n, 6), Values(n, 7)};
    for (int64_t i = 0; i < n; ++i) s[2].data<float>()[i] = std::abs(s[2].data<float>()[i]);
    std::vector<const Tensor*> in = {&s[0], &s[1], &s[2], &s[3]};
    for (const Tensor& t : scalars) in.push_back(&t);
    auto k = CreateFusedElementwiseRange(AdamOps(), in, {2, 6, 13}, {&s[1], &s[2], &s[3]}, loop);
    EXPECT_TRUE(k.ok()) << k.status();
    for (int step = 0; k.ok() && step < 3; ++step) {  // ranges as a reduce-update calls them
      for (int64_t at = 0; at < n;) {
        const int64_t len = std::min<int64_t>(n - at, 1000 + 17 * step);
        EXPECT_TRUE((*k)->RunRange(at, len, reduced.data<float>() + at).ok());
        at += len;
      }
    }
    return s;
  };
  // The kernel compiles these ops for every instruction set the CPU has (else the comparisons
  // below would be of the interpreter with itself).
  const std::map<std::string, fused::Fn> fns = {{"mul", fused::Fn::kMul},
                                                {"add", fused::Fn::kAdd},
                                                {"div", fused::Fn::kDiv},
                                                {"square", fused::Fn::kSquare},
                                                {"sqrt", fused::Fn::kSqrt}};
  std::vector<fused::Instr> instrs;
  for (const FusedInstruction& op : AdamOps()) {
    const int a = op.args[0], b = op.args.size() > 1 ? op.args[1] : a;
    instrs.push_back({fns.at(op.fn), a, b, a});
  }
  std::vector<bool> is_scalar(12, true), in_place(12, false);
  for (int r = 0; r < 4; ++r) is_scalar[r] = false;
  in_place[1] = in_place[2] = in_place[3] = true;
  for (FusedLoop loop : CompiledLoops()) {
    const auto isa = loop == FusedLoop::kAvx2 ? FusedElementwiseJit::Isa::kAvx2
                                              : FusedElementwiseJit::Isa::kBest;
    auto jit = FusedElementwiseJit::Create(instrs, is_scalar, in_place, {2, 6, 13}, isa);
    ASSERT_NE(jit, nullptr);
    EXPECT_EQ(jit->DividesByReciprocals(), isa == FusedElementwiseJit::Isa::kBest && Avx512());
  }
  const std::vector<Tensor> interpreted = steps(FusedLoop::kInterpreted);
  // The steps changed the parameters (the comparisons are not of untouched copies).
  const Tensor p0 = Values(n, 7);
  EXPECT_NE(std::memcmp(interpreted[3].raw(), p0.raw(), n * sizeof(float)), 0);
  for (FusedLoop loop : CompiledLoops()) {
    const std::vector<Tensor> compiled = steps(loop);
    for (int t = 1; t < 4; ++t) {
      for (int64_t i = 0; i < n; ++i) {
        const float u = compiled[t].data<float>()[i], v = interpreted[t].data<float>()[i];
        if (std::isnan(u) && std::isnan(v)) continue;
        ASSERT_EQ(std::memcmp(&u, &v, 4), 0) << (loop == FusedLoop::kAvx2 ? "AVX2" : "AVX-512")
                                             << " state " << t << ", element " << i;
      }
    }
  }
}

// The executor binds a donated argument's memory to the result that replaces it from run to run
// (Tensor::ShareMemory): the kernel compiles a loop for the outputs updating their inputs in
// place once that happens, and its results stay the interpreter's.
TEST(FusedElementwiseJitTest, OutputsReboundOntoInputsBetweenRunsGiveTheInterpretersBits) {
  const int64_t n = 300 + 5;
  const std::vector<FusedInstruction> ops = {{"mul", {0, 1}}, {"add", {2, 0}}};  // x * s + x
  auto run = [&](FusedLoop loop) {
    Tensor x = Values(n, 11), s = One(1.5f), y(v1::DTYPE_F32, {n});
    std::vector<Tensor> seen;
    auto k = CreateFusedElementwise(ops, {&x, &s}, {1}, {&y}, loop);
    EXPECT_TRUE(k.ok()) << k.status();
    if (!k.ok()) return seen;
    EXPECT_TRUE((*k)->Run().ok());  // y apart from x
    seen.push_back(y);
    y.ShareMemory(x, 0);  // y is x, updated in place
    EXPECT_TRUE((*k)->Run().ok());
    EXPECT_TRUE((*k)->Run().ok());
    seen.push_back(x);
    return seen;
  };
  const std::vector<Tensor> interpreted = run(FusedLoop::kInterpreted);
  for (FusedLoop loop : CompiledLoops()) {
    const std::vector<Tensor> compiled = run(loop);
    ASSERT_EQ(compiled.size(), interpreted.size());
    for (size_t i = 0; i < compiled.size(); ++i) {
      for (int64_t j = 0; j < compiled[i].num_elements(); ++j) {
        const float u = compiled[i].data<float>()[j], v = interpreted[i].data<float>()[j];
        if (std::isnan(u) && std::isnan(v)) continue;
        ASSERT_EQ(std::memcmp(&u, &v, 4), 0) << "run " << i << ", element " << j;
      }
    }
  }
}

// Dividends for a division by one value: runs of 16 (a vector) with exponents in [-64, 63],
// which the AVX-512 loop divides without vdivps, and every eighth run of uniformly drawn bits
// (every exponent: subnormals, infinities and NaNs among them, which it hands to vdivps); in
// places the edges of that range, zeros of both signs and significands of all ones.
std::vector<float> Dividends(int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<float> v(n);
  const float edges[] = {0x1p-64f,
                         0x1p64f,
                         std::nextafter(0x1p-64f, 0.0f),
                         std::nextafter(0x1p64f, 1e30f),
                         0.0f,
                         1.0f,
                         0x1.fffffep0f,
                         0x1.fffffep63f};
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits = gen();
    if (i / 16 % 8 != 7) bits = (bits & 0x807fffffu) | ((63 + gen() % 128) << 23);
    std::memcpy(&v[i], &bits, 4);
    if (i % 97 == 0) v[i] = (i / 97 / 8 % 2 ? -1 : 1) * edges[i / 97 % 8];  // both signs of each
  }
  return v;
}

// x / s for a one-value s runs without the divider in the AVX-512 loop where s is in
// [2^-32, 2^32] (FusedElementwiseJit::DividesByReciprocals): its quotients are still vdivps's,
// correctly rounded, for dividends of every exponent, and for divisors outside that range (which
// the loop dividing by vdivps takes).
TEST(FusedElementwiseJitTest, ADivisionByAOneValueInputIsCorrectlyRoundedForEveryDividend) {
  if (CompiledLoops().empty()) GTEST_SKIP() << "no AVX2: the kernel is interpreted";
  const std::vector<fused::Instr> div = {{fused::Fn::kDiv, 0, 1}};
  for (auto isa : {FusedElementwiseJit::Isa::kBest, FusedElementwiseJit::Isa::kAvx2}) {
    auto jit = FusedElementwiseJit::Create(div, {false, true}, {false, false}, {0}, isa);
    ASSERT_NE(jit, nullptr);
    EXPECT_EQ(jit->DividesByReciprocals(), isa == FusedElementwiseJit::Isa::kBest && Avx512());
  }
  std::mt19937 gen(5);
  std::vector<float> divisors = {1.0f,     -1.0f,   3.0f,   0.1f,  0x1.fffffep0f, -0x1.000002p0f,
                                 0x1p-32f, 0x1p32f, 0.271f, 1e-8f, 0.001f,        7.0f};
  for (int k = 0; k < 20; ++k)  // random significands, exponents in [-32, 32]
    divisors.push_back(std::ldexp(1.0f + (gen() & 0x7fffff) * 0x1p-23f, int(gen() % 65) - 32));
  const float inf = std::numeric_limits<float>::infinity();
  for (float s : {0.0f, -0.0f, inf, -inf, std::nanf(""), 0x1p-33f, 0x1p33f, 1e-40f})
    divisors.push_back(s);  // outside the range: vdivps
  const int64_t n = (1 << 18) + 5;
  const std::vector<float> x = Dividends(n, 6);
  Tensor xt(v1::DTYPE_F32, {n});
  std::memcpy(xt.raw(), x.data(), n * sizeof(float));
  for (FusedLoop loop : CompiledLoops()) {
    for (float s : divisors) {
      const Tensor st = One(s);
      Tensor q(v1::DTYPE_F32, {n});
      auto k = CreateFusedElementwise({{"div", {0, 1}}}, {&xt, &st}, {0}, {&q}, loop);
      ASSERT_TRUE(k.ok()) << k.status();
      ASSERT_TRUE((*k)->Run().ok());
      for (int64_t i = 0; i < n; ++i) {
        const float want = x[i] / s, got = q.data<float>()[i];
        if (std::isnan(want) && std::isnan(got)) continue;
        ASSERT_EQ(std::memcmp(&want, &got, 4), 0)
            << (loop == FusedLoop::kAvx2 ? "AVX2 " : "AVX-512 ") << std::hexfloat << x[i] << " / "
            << s << ": " << got << ", not " << want;
      }
    }
  }
}

TEST(FusedElementwiseJitTest, OpsNeedingMoreRegistersThanThereAreAreInterpreted) {
  // 40 one-element inputs all live until the last op: more than zmm0..zmm31.
  std::vector<fused::Instr> chain;
  std::vector<bool> is_scalar(41, true), in_place(41, false);
  is_scalar[0] = false;
  for (int k = 0; k < 40; ++k) chain.push_back({fused::Fn::kMul, 0, 1 + k});  // x * s_k
  for (int k = 1; k < 40; ++k) chain.push_back({fused::Fn::kAdd, 41 + k - 1, 41 + k});
  for (auto isa : {FusedElementwiseJit::Isa::kBest, FusedElementwiseJit::Isa::kAvx2})
    EXPECT_EQ(FusedElementwiseJit::Create(chain, is_scalar, in_place, {78}, isa), nullptr);
  if (CompiledLoops().empty()) return;
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
