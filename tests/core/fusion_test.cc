#include "core/spmd/fusion.h"

#include <string>

#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"

namespace meshrun {
namespace {

v1::ShardMapProgram Parse(const char* text) {
  v1::ShardMapProgram p;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &p));
  return p;
}

// g = x1^T-ish products summed over two minibatches, then read by one more op.
constexpr char kAccumulation[] = R"pb(
  program {
    functions {
      name: "main"
      ops { kind: OP_MATMUL inputs: "x1" inputs: "dy1" outputs: "g1" }
      ops { kind: OP_MATMUL inputs: "x2" inputs: "dy2" outputs: "g2" }
      ops { kind: OP_BINARY fn: "add" inputs: "g1" inputs: "g2" outputs: "g" }
      ops { kind: OP_UNARY fn: "neg" inputs: "g" outputs: "out" }
    }
  }
  inputs: "x1"
  inputs: "dy1"
  inputs: "x2"
  inputs: "dy2"
  outputs: "out"
)pb";

TEST(FuseGradientAccumulationTest, TheSecondProductIsAddedInTheGemmsEpilogue) {
  v1::ShardMapProgram p = Parse(kAccumulation);
  FuseGradientAccumulation(&p);
  const auto& ops = p.program().functions(0).ops();
  ASSERT_EQ(ops.size(), 3);
  EXPECT_EQ(ops[1].kind(), v1::OP_MATMUL);
  EXPECT_TRUE(ops[1].accumulate());
  EXPECT_EQ(ops[1].outputs(0), "g1");  // accumulates into the first product
  EXPECT_EQ(ops[2].inputs(0), "g1");   // the sum's reader reads the accumulator
}

// The sum over four minibatches as a train step traces it: ((g1 + g2) + g3) + g4.
TEST(FuseGradientAccumulationTest, AChainOfSumsBecomesOneAccumulator) {
  v1::ShardMapProgram p;
  v1::Function* f = p.mutable_program()->add_functions();
  f->set_name("main");
  std::string sum = "g1";
  for (int k = 1; k <= 4; ++k) {
    const std::string x = "x" + std::to_string(k), dy = "dy" + std::to_string(k);
    p.add_inputs(x);
    p.add_inputs(dy);
    v1::Op* mm = f->add_ops();
    mm->set_kind(v1::OP_MATMUL);
    mm->add_inputs(x);
    mm->add_inputs(dy);
    mm->add_outputs("g" + std::to_string(k));
    if (k == 1) continue;
    v1::Op* add = f->add_ops();
    add->set_kind(v1::OP_BINARY);
    add->set_fn("add");
    add->add_inputs(sum);
    add->add_inputs("g" + std::to_string(k));
    sum = "s" + std::to_string(k);
    add->add_outputs(sum);
  }
  v1::Op* neg = f->add_ops();
  neg->set_kind(v1::OP_UNARY);
  neg->set_fn("neg");
  neg->add_inputs(sum);
  neg->add_outputs("out");
  p.add_outputs("out");
  FuseGradientAccumulation(&p);
  const auto& ops = p.program().functions(0).ops();
  ASSERT_EQ(ops.size(), 5);
  EXPECT_FALSE(ops[0].accumulate());
  for (int k = 1; k < 4; ++k) {
    EXPECT_EQ(ops[k].kind(), v1::OP_MATMUL);
    EXPECT_TRUE(ops[k].accumulate()) << k;
    EXPECT_EQ(ops[k].outputs(0), "g1") << k;
  }
  EXPECT_EQ(ops[4].inputs(0), "g1");
}

TEST(FuseGradientAccumulationTest, LeavesSumsWhoseOperandsAreReadElsewhereOrAreResults) {
  v1::ShardMapProgram read_twice = Parse(kAccumulation);
  auto* extra = read_twice.mutable_program()->mutable_functions(0)->add_ops();
  extra->set_kind(v1::OP_UNARY);
  extra->set_fn("neg");
  extra->add_inputs("g1");  // g1 is still needed as it was
  extra->add_outputs("out2");
  FuseGradientAccumulation(&read_twice);
  EXPECT_EQ(read_twice.program().functions(0).ops_size(), 5);

  v1::ShardMapProgram result = Parse(kAccumulation);
  result.add_outputs("g2");  // the product itself is returned
  FuseGradientAccumulation(&result);
  EXPECT_EQ(result.program().functions(0).ops_size(), 4);

  v1::ShardMapProgram argument = Parse(kAccumulation);
  argument.mutable_program()->mutable_functions(0)->mutable_ops(0)->set_outputs(0, "x1");
  argument.mutable_program()->mutable_functions(0)->mutable_ops(2)->set_inputs(0, "x1");
  FuseGradientAccumulation(&argument);  // never accumulate into an argument
  EXPECT_EQ(argument.program().functions(0).ops_size(), 4);
}

}  // namespace
}  // namespace meshrun
