// SimplifyProgram (core/spmd/fusion.h) on a Dense layer and a max-subtracted logit as a traced step
// spells them: what it rewrites, and that the executor computes the same bits before and after.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "core/spmd/fusion.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "tests/worker/run_program.h"
#include "worker/executor.h"

namespace meshrun {
namespace {

// h = x @ w + broadcast(reshape(b)); z = h - broadcast(max(h)); out2 = broadcast(max(h)) + z,
// with the max, its reshape-free broadcast and an iota computed twice and one unused exp.
constexpr char kProgram[] = R"pb(
  program {
    buffers {
      name: "x"
      dtype: DTYPE_F32
      shape { dims: 4 dims: 3 }
    }
    buffers {
      name: "w"
      dtype: DTYPE_F32
      shape { dims: 3 dims: 5 }
    }
    buffers {
      name: "b"
      dtype: DTYPE_F32
      shape { dims: 5 }
    }
    buffers {
      name: "p"
      dtype: DTYPE_F32
      shape { dims: 4 dims: 5 }
    }
    buffers {
      name: "b2"
      dtype: DTYPE_F32
      shape { dims: 1 dims: 5 }
    }
    buffers {
      name: "bb"
      dtype: DTYPE_F32
      shape { dims: 4 dims: 5 }
    }
    buffers {
      name: "h"
      dtype: DTYPE_F32
      shape { dims: 4 dims: 5 }
    }
    buffers {
      name: "m1"
      dtype: DTYPE_F32
      shape { dims: 4 dims: 1 }
    }
    buffers {
      name: "m2"
      dtype: DTYPE_F32
      shape { dims: 4 dims: 1 }
    }
    buffers {
      name: "mb1"
      dtype: DTYPE_F32
      shape { dims: 4 dims: 5 }
    }
    buffers {
      name: "mb2"
      dtype: DTYPE_F32
      shape { dims: 4 dims: 5 }
    }
    buffers {
      name: "z"
      dtype: DTYPE_F32
      shape { dims: 4 dims: 5 }
    }
    buffers {
      name: "out2"
      dtype: DTYPE_F32
      shape { dims: 4 dims: 5 }
    }
    buffers {
      name: "unused"
      dtype: DTYPE_F32
      shape { dims: 4 dims: 5 }
    }
    functions {
      name: "main"
      ops { kind: OP_MATMUL inputs: "x" inputs: "w" outputs: "p" }
      ops { kind: OP_RESHAPE inputs: "b" outputs: "b2" }
      ops { kind: OP_BROADCAST inputs: "b2" outputs: "bb" }
      ops { kind: OP_BINARY fn: "add" inputs: "p" inputs: "bb" outputs: "h" }
      ops { kind: OP_UNARY fn: "exp" inputs: "h" outputs: "unused" }
      ops { kind: OP_REDUCE fn: "max" dims: 1 inputs: "h" outputs: "m1" }
      ops { kind: OP_BROADCAST inputs: "m1" outputs: "mb1" }
      ops { kind: OP_BINARY fn: "sub" inputs: "h" inputs: "mb1" outputs: "z" }
      ops { kind: OP_REDUCE fn: "max" dims: 1 inputs: "h" outputs: "m2" }
      ops { kind: OP_BROADCAST inputs: "m2" outputs: "mb2" }
      ops { kind: OP_BINARY fn: "add" inputs: "mb2" inputs: "z" outputs: "out2" }
    }
  }
  inputs: "x"
  inputs: "w"
  inputs: "b"
  outputs: "z"
  outputs: "out2"
)pb";

v1::ShardMapProgram Parse() {
  v1::ShardMapProgram p;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(kProgram, &p));
  return p;
}

TEST(SimplifyProgramTest, FoldsRepeatsBroadcastsBiasAndDeadOps) {
  v1::ShardMapProgram p = Parse();
  SimplifyProgram(&p);
  const auto& ops = p.program().functions(0).ops();
  std::map<int, int> kinds;
  for (const v1::Op& op : ops) ++kinds[op.kind()];
  EXPECT_EQ(kinds[v1::OP_REDUCE], 1) << "the repeated max is computed once";
  EXPECT_EQ(kinds[v1::OP_BROADCAST], 0) << "binary ops read the broadcasts' sources";
  EXPECT_EQ(kinds[v1::OP_UNARY], 0) << "the unused exp is deleted";
  ASSERT_EQ(kinds[v1::OP_MATMUL], 1);
  const v1::Op& matmul = *std::find_if(ops.begin(), ops.end(),
                                       [](const v1::Op& op) { return op.kind() == v1::OP_MATMUL; });
  ASSERT_EQ(matmul.inputs_size(), 3) << "the bias is added in the GEMM";
  EXPECT_EQ(matmul.inputs(2), "b2");
  EXPECT_EQ(matmul.outputs(0), "h");
  for (const v1::Op& op : ops) {
    if (op.kind() == v1::OP_BINARY && op.outputs(0) == "out2") {
      EXPECT_EQ(op.inputs(0), "z") << "add(broadcast(m), z) became add(z, m)";
      EXPECT_EQ(op.inputs(1), "m1");
    }
  }
  for (const v1::BufferDecl& b : p.program().buffers()) {
    EXPECT_NE(b.name(), "unused");
    EXPECT_NE(b.name(), "p") << "the product buffer is gone with the add";
    EXPECT_NE(b.name(), "mb2");
  }
}

TEST(SimplifyProgramTest, TheSimplifiedProgramComputesTheSameBits) {
  const v1::ShardMapProgram original = Parse();
  v1::ShardMapProgram simplified = original;
  SimplifyProgram(&simplified);
  const auto before = testing::RunProgramOnce(original),
             after = testing::RunProgramOnce(simplified);
  ASSERT_EQ(before.size(), 2u);
  ASSERT_EQ(after.size(), 2u);
  for (const auto& [name, values] : before) {
    const std::vector<float>& got = after.at(name);
    ASSERT_EQ(got.size(), values.size()) << name;
    EXPECT_EQ(std::memcmp(got.data(), values.data(), values.size() * sizeof(float)), 0) << name;
  }
  // The results are what they should be: z's row max is 0, out2 = z + the row max of h.
  const std::vector<float>& z = before.at("z");
  for (int r = 0; r < 4; ++r) {
    float mx = z[r * 5];
    for (int c = 1; c < 5; ++c) mx = std::max(mx, z[r * 5 + c]);
    EXPECT_EQ(mx, 0.0f) << "row " << r;
  }
}

TEST(SimplifyProgramTest, LeavesProductsReadElsewhereAndResults) {
  v1::ShardMapProgram read_twice = Parse();
  read_twice.add_outputs("p");  // the product itself is returned: no bias fusion
  SimplifyProgram(&read_twice);
  int matmul_inputs = 0;
  for (const v1::Op& op : read_twice.program().functions(0).ops())
    if (op.kind() == v1::OP_MATMUL) matmul_inputs = op.inputs_size();
  EXPECT_EQ(matmul_inputs, 2);

  v1::ShardMapProgram returned = Parse();
  returned.add_outputs("m2");  // a returned repeat keeps its own op
  SimplifyProgram(&returned);
  int reduces = 0;
  for (const v1::Op& op : returned.program().functions(0).ops())
    reduces += op.kind() == v1::OP_REDUCE;
  EXPECT_EQ(reduces, 2);
}

// A mean's 1/n broadcast to the global [8, 4] and sliced to a block twice (rows by a dynamic
// slice, then columns), as the partitioner spells a replicated constant read by a sharded
// operand, beside a static slice that cuts a dim the broadcast's source has in full.
constexpr char kSlicedBroadcasts[] = R"pb(
  program {
    buffers {
      name: "s"
      dtype: DTYPE_F32
      shape { dims: 1 dims: 1 }
    }
    buffers {
      name: "g"
      dtype: DTYPE_F32
      shape { dims: 4 dims: 2 }
    }
    buffers {
      name: "r"
      dtype: DTYPE_F32
      shape { dims: 1 dims: 6 }
    }
    buffers {
      name: "bs"
      dtype: DTYPE_F32
      shape { dims: 8 dims: 4 }
    }
    buffers {
      name: "i"
      dtype: DTYPE_I32
      shape {}
    }
    buffers {
      name: "d1"
      dtype: DTYPE_F32
      shape { dims: 4 dims: 4 }
    }
    buffers {
      name: "d2"
      dtype: DTYPE_F32
      shape { dims: 4 dims: 2 }
    }
    buffers {
      name: "scaled"
      dtype: DTYPE_F32
      shape { dims: 4 dims: 2 }
    }
    buffers {
      name: "br"
      dtype: DTYPE_F32
      shape { dims: 4 dims: 6 }
    }
    buffers {
      name: "cut"
      dtype: DTYPE_F32
      shape { dims: 2 dims: 3 }
    }
    functions {
      name: "main"
      ops { kind: OP_BROADCAST inputs: "s" outputs: "bs" }
      ops { kind: OP_FILL_VALUE value: 1 outputs: "i" }
      ops { kind: OP_DYNAMIC_SLICE dim: 0 inputs: "bs" inputs: "i" outputs: "d1" }
      ops { kind: OP_DYNAMIC_SLICE dim: 1 inputs: "d1" inputs: "i" outputs: "d2" }
      ops { kind: OP_BINARY fn: "mul" inputs: "d2" inputs: "g" outputs: "scaled" }
      ops { kind: OP_BROADCAST inputs: "r" outputs: "br" }
      ops { kind: OP_SLICE starts: 1 starts: 2 inputs: "br" outputs: "cut" }
    }
  }
  inputs: "s"
  inputs: "g"
  inputs: "r"
  outputs: "scaled"
  outputs: "cut"
)pb";

TEST(SimplifyProgramTest, SlicesOfABroadcastConstantAreThatConstantAtTheBlockShape) {
  v1::ShardMapProgram original;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(kSlicedBroadcasts, &original));
  v1::ShardMapProgram p = original;
  SimplifyProgram(&p);
  std::map<int, int> kinds;
  for (const v1::Op& op : p.program().functions(0).ops()) {
    ++kinds[op.kind()];
    if (op.kind() == v1::OP_BINARY) {
      EXPECT_EQ(op.inputs(0), "g") << "mul(slice(slice(broadcast(s))), g) became mul(g, s)";
      EXPECT_EQ(op.inputs(1), "s");
    }
  }
  EXPECT_EQ(kinds[v1::OP_DYNAMIC_SLICE], 0);
  EXPECT_EQ(kinds[v1::OP_FILL_VALUE], 0) << "the slices' start died with them";
  EXPECT_EQ(kinds[v1::OP_SLICE], 1) << "a slice that cuts r's own dim 1 stays";
  EXPECT_EQ(kinds[v1::OP_BROADCAST], 1) << "only r's broadcast is left";
  for (const v1::BufferDecl& b : p.program().buffers())
    EXPECT_NE(b.name(), "bs") << "the global broadcast is never made";

  const auto before = testing::RunProgramOnce(original), after = testing::RunProgramOnce(p);
  ASSERT_EQ(before.size(), 2u);
  ASSERT_EQ(after.size(), 2u);
  for (const auto& [name, values] : before) {
    ASSERT_EQ(after.at(name).size(), values.size()) << name;
    EXPECT_EQ(std::memcmp(after.at(name).data(), values.data(), values.size() * sizeof(float)), 0)
        << name;
  }
}

// An unrolled lax.scan as the Python SDK spells it: kSteps copies of h = relu(h @ w + b) with
// the scale 0.5 filled afresh and h scaled by it (h * 0.5 twice per step: the second a repeat
// whose readers must move to the first). One SimplifyProgram finds every repeat, bias and
// activation in its sweeps, and the program computes the same bits.
TEST(SimplifyProgramTest, AnUnrolledLoopIsSimplifiedWholeInOneCall) {
  constexpr int kSteps = 60;
  v1::ShardMapProgram p;
  v1::StepProgram* prog = p.mutable_program();
  auto decl = [&](const std::string& name, std::vector<int64_t> dims) {
    v1::BufferDecl* b = prog->add_buffers();
    b->set_name(name);
    b->set_dtype(v1::DTYPE_F32);
    for (int64_t d : dims) b->mutable_shape()->add_dims(d);
  };
  auto op = [&](v1::OpKind kind, const std::string& fn, std::vector<std::string> in,
                const std::string& out) {
    v1::Op* o = prog->mutable_functions(0)->add_ops();
    o->set_kind(kind);
    if (!fn.empty()) o->set_fn(fn);
    for (const std::string& x : in) o->add_inputs(x);
    o->add_outputs(out);
    return o;
  };
  prog->add_functions()->set_name("main");
  decl("h_0", {4, 6});
  decl("w", {6, 6});
  decl("b", {1, 6});
  for (int k = 0; k < kSteps; ++k) {
    const std::string s = "_" + std::to_string(k), h = "h" + s, next = "h_" + std::to_string(k + 1);
    for (const char* name : {"half", "p", "q", "a", "c1", "c2"}) {
      decl(name + s, std::string(name).rfind("half", 0) == 0 ? std::vector<int64_t>{1, 1}
                                                             : std::vector<int64_t>{4, 6});
    }
    decl(next, {4, 6});
    op(v1::OP_FILL_VALUE, "", {}, "half" + s)->set_value(0.5f);
    op(v1::OP_MATMUL, "", {h, "w"}, "p" + s);
    op(v1::OP_BINARY, "add", {"p" + s, "b"}, "q" + s);
    op(v1::OP_UNARY, "relu", {"q" + s}, "a" + s);
    op(v1::OP_BINARY, "mul", {"a" + s, "half" + s}, "c1" + s);
    op(v1::OP_BINARY, "mul", {"a" + s, "half" + s}, "c2" + s);
    op(v1::OP_BINARY, "add", {"c1" + s, "c2" + s}, next);
  }
  p.add_inputs("h_0");
  p.add_inputs("w");
  p.add_inputs("b");
  p.add_outputs("h_" + std::to_string(kSteps));
  v1::ShardMapProgram simplified = p;
  SimplifyProgram(&simplified);
  std::map<int, int> kinds;
  for (const v1::Op& o : simplified.program().functions(0).ops()) {
    ++kinds[o.kind()];
    if (o.kind() == v1::OP_MATMUL) {
      EXPECT_EQ(o.inputs_size(), 3) << "the bias is in every GEMM";
      EXPECT_EQ(o.fn(), "relu") << "and the relu";
    }
  }
  EXPECT_EQ(kinds[v1::OP_FILL_VALUE], 1) << "one 0.5 for every step";
  EXPECT_EQ(kinds[v1::OP_MATMUL], kSteps);
  EXPECT_EQ(kinds[v1::OP_UNARY], 0);
  EXPECT_EQ(kinds[v1::OP_BINARY], 2 * kSteps) << "one h * 0.5 per step, and the add";
  const auto positive = [](const std::string& name, Tensor& t) {  // relu passes something
    for (int64_t i = 0; i < t.num_elements(); ++i)
      t.data<float>()[i] = std::abs(t.data<float>()[i]) / (name == "w" ? 4.0f : 1.0f);
  };
  const auto before = testing::RunProgramOnce(p, positive),
             after = testing::RunProgramOnce(simplified, positive);
  const std::string out = "h_" + std::to_string(kSteps);
  ASSERT_EQ(before.count(out), 1u);
  ASSERT_EQ(after.count(out), 1u);
  EXPECT_EQ(after.at(out), before.at(out));
  const std::vector<float>& h = before.at(out);
  EXPECT_GT(*std::max_element(h.begin(), h.end()), 0.0f) << "not a chain of zeros";
}

}  // namespace
}  // namespace meshrun
