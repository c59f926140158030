// FuseElementwise (core/spmd/fusion.h) on an optimizer-like update chain: what it fuses and moves,
// and that the executor computes the same bits before and after; the fused kernel's checks.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "core/float_ops.h"
#include "core/spmd/fusion.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "tests/worker/run_program.h"
#include "worker/executor.h"
#include "worker/kernels/kernel.h"

namespace meshrun {
namespace {

// Adam's moments and update on [3, 700] blocks (2100 elements: not a multiple of the kernel's
// block), with one-element b1 and lr, fills for 1 and eps, a one-element op (1 - b1) in the
// middle, and a comparison and a max among the results.
constexpr char kProgram[] = R"pb(
  program {
    buffers {
      name: "p"
      dtype: DTYPE_F32
      shape { dims: 3 dims: 700 }
    }
    buffers {
      name: "g"
      dtype: DTYPE_F32
      shape { dims: 3 dims: 700 }
    }
    buffers {
      name: "mu"
      dtype: DTYPE_F32
      shape { dims: 3 dims: 700 }
    }
    buffers {
      name: "nu"
      dtype: DTYPE_F32
      shape { dims: 3 dims: 700 }
    }
    buffers {
      name: "b1"
      dtype: DTYPE_F32
      shape { dims: 1 dims: 1 }
    }
    buffers {
      name: "lr"
      dtype: DTYPE_F32
      shape { dims: 1 dims: 1 }
    }
    buffers {
      name: "one"
      dtype: DTYPE_F32
      shape { dims: 1 dims: 1 }
    }
    buffers {
      name: "eps"
      dtype: DTYPE_F32
      shape { dims: 1 dims: 1 }
    }
    buffers {
      name: "omb1"
      dtype: DTYPE_F32
      shape { dims: 1 dims: 1 }
    }
    buffers {
      name: "m1"
      dtype: DTYPE_F32
      shape { dims: 3 dims: 700 }
    }
    buffers {
      name: "m2"
      dtype: DTYPE_F32
      shape { dims: 3 dims: 700 }
    }
    buffers {
      name: "mu2"
      dtype: DTYPE_F32
      shape { dims: 3 dims: 700 }
    }
    buffers {
      name: "gg"
      dtype: DTYPE_F32
      shape { dims: 3 dims: 700 }
    }
    buffers {
      name: "n1"
      dtype: DTYPE_F32
      shape { dims: 3 dims: 700 }
    }
    buffers {
      name: "nu2"
      dtype: DTYPE_F32
      shape { dims: 3 dims: 700 }
    }
    buffers {
      name: "s"
      dtype: DTYPE_F32
      shape { dims: 3 dims: 700 }
    }
    buffers {
      name: "den"
      dtype: DTYPE_F32
      shape { dims: 3 dims: 700 }
    }
    buffers {
      name: "upd"
      dtype: DTYPE_F32
      shape { dims: 3 dims: 700 }
    }
    buffers {
      name: "step"
      dtype: DTYPE_F32
      shape { dims: 3 dims: 700 }
    }
    buffers {
      name: "p2"
      dtype: DTYPE_F32
      shape { dims: 3 dims: 700 }
    }
    buffers {
      name: "cmp"
      dtype: DTYPE_F32
      shape { dims: 3 dims: 700 }
    }
    buffers {
      name: "mx"
      dtype: DTYPE_F32
      shape { dims: 3 dims: 700 }
    }
    functions {
      name: "main"
      ops { kind: OP_FILL_VALUE outputs: "one" value: 1 }
      ops { kind: OP_BINARY inputs: "mu" inputs: "b1" outputs: "m1" fn: "mul" }
      ops { kind: OP_BINARY inputs: "one" inputs: "b1" outputs: "omb1" fn: "sub" }
      ops { kind: OP_BINARY inputs: "g" inputs: "omb1" outputs: "m2" fn: "mul" }
      ops { kind: OP_BINARY inputs: "m1" inputs: "m2" outputs: "mu2" fn: "add" }
      ops { kind: OP_UNARY inputs: "g" outputs: "gg" fn: "square" }
      ops { kind: OP_BINARY inputs: "nu" inputs: "b1" outputs: "n1" fn: "mul" }
      ops { kind: OP_BINARY inputs: "n1" inputs: "gg" outputs: "nu2" fn: "add" }
      ops { kind: OP_UNARY inputs: "nu2" outputs: "s" fn: "sqrt" }
      ops { kind: OP_FILL_VALUE outputs: "eps" value: 1e-8 }
      ops { kind: OP_BINARY inputs: "s" inputs: "eps" outputs: "den" fn: "add" }
      ops { kind: OP_BINARY inputs: "mu2" inputs: "den" outputs: "upd" fn: "div" }
      ops { kind: OP_BINARY inputs: "upd" inputs: "lr" outputs: "step" fn: "mul" }
      ops { kind: OP_BINARY inputs: "p" inputs: "step" outputs: "p2" fn: "sub" }
      ops { kind: OP_BINARY inputs: "p2" inputs: "p" outputs: "cmp" fn: "gt" }
      ops { kind: OP_BINARY inputs: "upd" inputs: "g" outputs: "mx" fn: "max" }
    }
  }
  inputs: "p"
  inputs: "g"
  inputs: "mu"
  inputs: "nu"
  inputs: "b1"
  inputs: "lr"
  outputs: "mu2"
  outputs: "nu2"
  outputs: "p2"
  outputs: "cmp"
  outputs: "mx"
)pb";

v1::ShardMapProgram Parse() {
  v1::ShardMapProgram p;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(kProgram, &p));
  return p;
}

// Adam's state: b1 0.9, lr 0.01, nu >= 0.
std::map<std::string, std::vector<float>> RunOnce(const v1::ShardMapProgram& p) {
  return testing::RunProgramOnce(p, [](const std::string& name, Tensor& t) {
    for (int64_t i = 0; i < t.num_elements(); ++i) {
      float& x = t.data<float>()[i];
      if (name == "nu") x = x * x;
      if (name == "b1") x = 0.9f;
      if (name == "lr") x = 0.01f;
    }
  });
}

TEST(FuseElementwiseTest, AnUpdateChainBecomesOnePass) {
  v1::ShardMapProgram p = Parse();
  FuseElementwise(&p);
  const auto& ops = p.program().functions(0).ops();
  ASSERT_EQ(ops.size(), 4) << p.DebugString();
  EXPECT_EQ(ops[0].kind(), v1::OP_FILL_VALUE);
  EXPECT_EQ(ops[1].kind(), v1::OP_FILL_VALUE) << "fills move to the run's front";
  EXPECT_EQ(ops[2].kind(), v1::OP_BINARY) << "the one-element 1 - b1 runs before the group";
  EXPECT_EQ(ops[2].outputs(0), "omb1");
  const v1::Op& fused = ops[3];
  ASSERT_EQ(fused.kind(), v1::OP_FUSED_ELEMENTWISE);
  EXPECT_EQ(fused.fused_size(), 13);
  EXPECT_THAT(std::vector<std::string>(fused.outputs().begin(), fused.outputs().end()),
              ::testing::ElementsAre("mu2", "nu2", "p2", "cmp", "mx"));
  for (const v1::BufferDecl& b : p.program().buffers()) {
    for (const char* gone : {"m1", "m2", "gg", "n1", "s", "den", "upd", "step"})
      EXPECT_NE(b.name(), gone) << "an intermediate read only inside the group keeps no buffer";
  }
}

TEST(FuseElementwiseTest, TheFusedProgramComputesTheSameBits) {
  const v1::ShardMapProgram original = Parse();
  v1::ShardMapProgram fused = original;
  FuseElementwise(&fused);
  const auto before = RunOnce(original), after = RunOnce(fused);
  ASSERT_EQ(before.size(), 5u);
  for (const auto& [name, values] : before) {
    const std::vector<float>& got = after.at(name);
    ASSERT_EQ(got.size(), values.size()) << name;
    EXPECT_EQ(std::memcmp(got.data(), values.data(), values.size() * sizeof(float)), 0) << name;
  }
  for (const auto& [name, values] : after) {
    for (float x : values)
      ASSERT_TRUE(std::isfinite(x)) << name << ": the inputs are a valid state";
  }
  for (float c : after.at("cmp")) EXPECT_TRUE(c == 0.0f || c == 1.0f);
}

TEST(FuseElementwiseTest, ResultsWrittenTwiceOrArgumentsAreLeftAlone) {
  v1::ShardMapProgram p = Parse();
  // m1 written a second time: the ops writing it stay separate.
  v1::Op* again = p.mutable_program()->mutable_functions(0)->add_ops();
  again->set_kind(v1::OP_BINARY);
  again->set_fn("add");
  again->add_inputs("g");
  again->add_inputs("g");
  again->add_outputs("m1");
  FuseElementwise(&p);
  int writers_of_m1 = 0;
  for (const v1::Op& op : p.program().functions(0).ops())
    for (const std::string& o : op.outputs()) writers_of_m1 += o == "m1";
  EXPECT_EQ(writers_of_m1, 2);
}

// Inserts before op `at` of the chain a psum over "data" of `x` into `y` (new [3, 700] buffers
// where not declared).
void InsertPsum(v1::ShardMapProgram* p, int at, const std::string& x, const std::string& y) {
  for (const std::string& name : {x, y}) {
    bool declared = false;
    for (const v1::BufferDecl& b : p->program().buffers()) declared |= b.name() == name;
    if (declared) continue;
    v1::BufferDecl* b = p->mutable_program()->add_buffers();
    b->set_name(name);
    b->set_dtype(v1::DTYPE_F32);
    b->mutable_shape()->add_dims(3);
    b->mutable_shape()->add_dims(700);
  }
  auto* ops = p->mutable_program()->mutable_functions(0)->mutable_ops();
  v1::Op psum;
  psum.set_kind(v1::OP_PSUM);
  psum.add_inputs(x);
  psum.add_outputs(y);
  psum.add_axis_names("data");
  *ops->Add() = psum;
  for (int i = ops->size() - 1; i > at; --i) ops->SwapElements(i, i - 1);
}

TEST(FuseElementwiseTest, AnAllReduceInTheChainRunsBeforeItWhenIndependent) {
  // The all-reduce of another parameter's gradient between mu's and nu's updates: it moves to
  // the front and the chain is still one pass.
  v1::ShardMapProgram p = Parse();
  InsertPsum(&p, 5, "h", "hs");
  FuseElementwise(&p);
  const auto& ops = p.program().functions(0).ops();
  ASSERT_EQ(ops.size(), 5) << p.DebugString();
  EXPECT_EQ(ops[0].kind(), v1::OP_PSUM);
  EXPECT_EQ(ops[4].kind(), v1::OP_FUSED_ELEMENTWISE);
  EXPECT_EQ(ops[4].fused_size(), 13);

  // One that reads a result of the chain so far (mu2), or that overwrites an argument the chain
  // reads (g), stays where it is and splits the chain.
  for (const auto& [x, y] : {std::pair<std::string, std::string>{"mu2", "hs"}, {"h", "g"}}) {
    v1::ShardMapProgram q = Parse();
    InsertPsum(&q, 5, x, y);
    FuseElementwise(&q);
    const auto& split = q.program().functions(0).ops();
    int fused = 0, psum_at = -1;
    for (int i = 0; i < split.size(); ++i) {
      fused += split[i].kind() == v1::OP_FUSED_ELEMENTWISE;
      if (split[i].kind() == v1::OP_PSUM) psum_at = i;
    }
    EXPECT_EQ(fused, 2) << x << " -> " << y << ": " << q.DebugString();
    EXPECT_GT(psum_at, 0) << x << " -> " << y;
  }
}

TEST(FusedElementwiseKernelTest, RefusesBadOpsArgsAndShapes) {
  Tensor a(v1::DTYPE_F32, {4, 3}), b(v1::DTYPE_F32, {4, 3}), c(v1::DTYPE_F32, {3, 4}),
      out(v1::DTYPE_F32, {4, 3});
  auto msg = [&](std::vector<FusedInstruction> ops, std::vector<const Tensor*> in) {
    return std::string(CreateFusedElementwise(ops, in, {0}, {&out}).status().message());
  };
  EXPECT_THAT(msg({{"exp", {0}}}, {&a}), ::testing::HasSubstr("fn 'exp'"));
  EXPECT_THAT(msg({{"add", {0}}}, {&a}), ::testing::HasSubstr("1 args"));
  EXPECT_THAT(msg({{"add", {0, 2}}}, {&a, &b}), ::testing::HasSubstr("arg 2"));
  EXPECT_THAT(msg({{"add", {0, 1}}}, {&a, &c}), ::testing::HasSubstr("input 1"));
  EXPECT_TRUE(CreateFusedElementwise({{"add", {0, 1}}}, {&a, &b}, {0}, {&out}).ok());
}

TEST(FusedElementwiseKernelTest, SelectTakesEitherOperandExactlyWhateverTheOther) {
  // jnp.where(mask, x, -inf) and a NaN in the branch not taken: no arithmetic blend.
  const int n = 300;  // more than one block
  Tensor pred(v1::DTYPE_F32, {n}), a(v1::DTYPE_F32, {n}), b(v1::DTYPE_F32, {1}),
      out(v1::DTYPE_F32, {n});
  b.data<float>()[0] = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < n; ++i) {
    pred.data<float>()[i] = i % 3 == 0 ? 1.0f : 0.0f;
    a.data<float>()[i] = i % 5 == 0 ? std::numeric_limits<float>::quiet_NaN() : 0.5f * i;
  }
  auto k = CreateFusedElementwise({{"select", {0, 1, 2}}}, {&pred, &a, &b}, {0}, {&out});
  ASSERT_TRUE(k.ok()) << k.status();
  ASSERT_TRUE((*k)->Run().ok());
  for (int i = 0; i < n; ++i) {
    const float got = out.data<float>()[i];
    if (i % 3 == 0) {
      EXPECT_TRUE(std::isinf(got) && got < 0) << i;
    } else if (i % 5 == 0) {
      EXPECT_TRUE(std::isnan(got)) << i;
    } else {
      EXPECT_EQ(got, 0.5f * i) << i;
    }
  }
}

// Every two-operand fn with a one-element operand on the left, on the right, on both or neither,
// over sizes around the kernel's 256-element block, whole (Run) and over a range whose input 0
// comes from elsewhere (RunRange): the same bits as the fn applied element by element, NaN, inf
// and signed zeros included.
TEST(FusedElementwiseKernelTest, OneElementOperandsGiveTheElementwiseBits) {
  const std::map<std::string, float (*)(float, float)> fns = {
      {"add", [](float a, float b) { return a + b; }},
      {"sub", [](float a, float b) { return a - b; }},
      {"mul", [](float a, float b) { return a * b; }},
      {"div", [](float a, float b) { return a / b; }},
      {"max", &NanPropagatingMax},
      {"min", &NanPropagatingMin},
      {"eq", [](float a, float b) { return a == b ? 1.0f : 0.0f; }},
      {"ne", [](float a, float b) { return a != b ? 1.0f : 0.0f; }},
      {"lt", [](float a, float b) { return a < b ? 1.0f : 0.0f; }},
      {"le", [](float a, float b) { return a <= b ? 1.0f : 0.0f; }},
      {"gt", [](float a, float b) { return a > b ? 1.0f : 0.0f; }},
      {"ge", [](float a, float b) { return a >= b ? 1.0f : 0.0f; }}};
  const float kSpecial[] = {0.0f,
                            -0.0f,
                            1.0f,
                            -3.5f,
                            1e-40f,
                            3e38f,
                            std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN()};
  auto value = [&](int i, int salt) {
    return i % 7 == 0 ? kSpecial[(i / 7 + salt) % 8] : 0.37f * (i - 50 * salt) + 0.01f * salt;
  };
  auto same = [](float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; };
  for (const int n : {1, 7, 255, 256, 257, 1000}) {
    for (const auto& [fn, ref] : fns) {
      for (int scalars = 0; scalars < 4; ++scalars) {  // bit 0: x has one element; bit 1: y
        SCOPED_TRACE(::testing::Message() << fn << " n=" << n << " scalars=" << scalars);
        Tensor x(v1::DTYPE_F32, {(scalars & 1) ? 1 : n}), y(v1::DTYPE_F32, {(scalars & 2) ? 1 : n});
        for (int64_t i = 0; i < x.num_elements(); ++i) x.data<float>()[i] = value(i + 3, 1);
        for (int64_t i = 0; i < y.num_elements(); ++i) y.data<float>()[i] = value(i, 2);
        // The fn, then the fn of its result and y again: a result row as operand.
        Tensor out(v1::DTYPE_F32, {n}), again(v1::DTYPE_F32, {n});
        if (n != 1 && scalars == 3) continue;  // no operand of the outputs' shape
        auto k =
            CreateFusedElementwise({{fn, {0, 1}}, {fn, {2, 1}}}, {&x, &y}, {0, 1}, {&out, &again});
        ASSERT_TRUE(k.ok()) << k.status();
        ASSERT_TRUE((*k)->Run().ok());
        int wrong = 0;
        for (int i = 0; i < n; ++i) {
          const float xi = x.data<float>()[(scalars & 1) ? 0 : i];
          const float yi = y.data<float>()[(scalars & 2) ? 0 : i];
          wrong += !same(out.data<float>()[i], ref(xi, yi));
          wrong += !same(again.data<float>()[i], ref(ref(xi, yi), yi));
        }
        EXPECT_EQ(wrong, 0);
        if ((scalars & 1) || n < 3) continue;  // RunRange takes input 0 of the outputs' shape
        std::vector<float> elsewhere(n);
        for (int i = 0; i < n; ++i) elsewhere[i] = value(i, 5);
        auto range = CreateFusedElementwiseRange({{fn, {0, 1}}}, {&x, &y}, {0}, {&out});
        ASSERT_TRUE(range.ok()) << range.status();
        const int64_t begin = n / 3, len = n - n / 3 - 1;
        ASSERT_TRUE((*range)->RunRange(begin, len, elsewhere.data()).ok());
        for (int64_t i = begin; i < begin + len; ++i) {
          const float yi = y.data<float>()[(scalars & 2) ? 0 : i];
          wrong += !same(out.data<float>()[i], ref(elsewhere[i - begin], yi));
        }
        EXPECT_EQ(wrong, 0);
      }
    }
  }
}

}  // namespace
}  // namespace meshrun
