#include <string>

#include "absl/strings/str_cat.h"
#include "core/spmd/fusion.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"

namespace meshrun {
namespace {

using ::testing::ElementsAre;

// An SGD step on a parameter replicated over "data": g, this device's partial gradient (it
// reads the batch, sharded over "data"), is summed over "data", then w' = w - lr * gs. `w_spec`:
// w's in_spec; `extra`: ops between the psum and the update; `update_reads`: the update's third
// input (the learning rate `lr` unless a test says otherwise).
v1::ShardMapProgram Sgd(const std::string& w_spec = "", const std::string& extra = "",
                        const std::string& update_reads = "lr") {
  std::string buffers;
  for (const char* name : {"x", "g", "gs", "w", "w2", "u"}) {
    buffers += absl::StrCat("buffers { name: '", name, "' dtype: DTYPE_F32 shape { dims: 8 } }");
  }
  for (const char* name : {"lr", "i", "l", "ls"})
    buffers += absl::StrCat("buffers { name: '", name, "' dtype: DTYPE_F32 shape {} }");
  const std::string text = absl::StrCat(
      "program { ", buffers, " functions { name: 'main' ",
      "ops { kind: OP_UNARY fn: 'square' inputs: 'x' outputs: 'g' } ",
      "ops { kind: OP_PSUM inputs: 'g' outputs: 'gs' axis_names: 'data' } ", extra,
      "ops { kind: OP_FUSED_ELEMENTWISE inputs: 'w' inputs: 'gs' inputs: '", update_reads,
      "' fused { fn: 'mul' args: 1 args: 2 } fused { fn: 'sub' args: 0 args: 3 } ",
      "fused_outputs: 1 outputs: 'w2' } } } ",
      "inputs: 'x' inputs: 'w' inputs: 'lr' outputs: 'w2' ",
      "in_specs { entries { axis_names: 'data' } } in_specs { ", w_spec, " } in_specs { } ",
      "out_specs { }");
  v1::ShardMapProgram p;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &p)) << text;
  return p;
}

// A fused op computing u = g * g (varying over "data") and l = lr * lr (replicated).
std::string SquaresOfGAndLr() {
  return "ops { kind: OP_FUSED_ELEMENTWISE inputs: 'g' inputs: 'lr' fused { fn: 'square' args: 0 "
         "} fused { fn: 'square' args: 1 } fused_outputs: 0 fused_outputs: 1 outputs: 'u' "
         "outputs: 'l' } ";
}

const v1::Op* FindKind(const v1::ShardMapProgram& p, v1::OpKind kind) {
  for (const v1::Op& op : p.program().functions(0).ops()) {
    if (op.kind() == kind) return &op;
  }
  return nullptr;
}

TEST(FuseReductionsIntoUpdatesTest, APsumReadOnlyByAnUpdateOfReplicatedValuesJoinsIt) {
  v1::ShardMapProgram p = Sgd();
  FuseReductionsIntoUpdates(&p);
  const auto& ops = p.program().functions(0).ops();
  ASSERT_EQ(ops.size(), 2);
  EXPECT_EQ(FindKind(p, v1::OP_PSUM), nullptr);
  const v1::Op& update = ops[1];
  EXPECT_EQ(update.kind(), v1::OP_FUSED_ELEMENTWISE);
  EXPECT_THAT(update.inputs(), ElementsAre("g", "w", "lr"));  // the partial first
  EXPECT_THAT(update.axis_names(), ElementsAre("data"));
  EXPECT_EQ(update.fn(), "sum");
  EXPECT_THAT(update.fused(0).args(), ElementsAre(0, 2));  // gs * lr
  EXPECT_THAT(update.fused(1).args(), ElementsAre(1, 3));  // w - (gs * lr)
  for (const v1::BufferDecl& b : p.program().buffers()) EXPECT_NE(b.name(), "gs");

  // A pmean becomes fn "mean"; a replicated value computed from a psum is still replicated.
  v1::ShardMapProgram mean =
      Sgd("", "ops { kind: OP_PMEAN inputs: 'x' outputs: 'u' axis_names: 'data' } ", "u");
  mean.mutable_program()->mutable_functions(0)->mutable_ops(1)->set_kind(v1::OP_PMEAN);
  FuseReductionsIntoUpdates(&mean);
  const v1::Op* fused = FindKind(mean, v1::OP_FUSED_ELEMENTWISE);
  ASSERT_NE(fused, nullptr);
  EXPECT_EQ(fused->fn(), "mean");
  EXPECT_THAT(fused->inputs(), ElementsAre("g", "w", "u"));

  // A view of the partial (a concatenation's operand, a reshape) that nothing writes is no
  // obstacle: the partial's memory keeps its value up to the update.
  v1::ShardMapProgram viewed = Sgd("", "ops { kind: OP_RESHAPE inputs: 'g' outputs: 'u' } ");
  FuseReductionsIntoUpdates(&viewed);
  EXPECT_EQ(FindKind(viewed, v1::OP_PSUM), nullptr);

  // An output of a fused op that reads the partial is replicated when its instructions do not
  // read it (optax's chains compute several states in one op).
  v1::ShardMapProgram per_output = Sgd("", SquaresOfGAndLr(), "l");
  FuseReductionsIntoUpdates(&per_output);
  EXPECT_EQ(FindKind(per_output, v1::OP_PSUM), nullptr);
}

TEST(FuseReductionsIntoUpdatesTest, LeavesReductionsAnUpdateCannotTakeOver) {
  const struct {
    const char* why;
    v1::ShardMapProgram program;
  } cases[] = {
      {"w differs over data", Sgd("entries { axis_names: 'data' }")},
      {"the update reads a value made from axis_index",
       Sgd("",
           "ops { kind: OP_AXIS_INDEX outputs: 'i' axis_names: 'data' } "
           "ops { kind: OP_CONVERT inputs: 'i' outputs: 'l' } ",
           "l")},
      {"the update reads the partial itself", Sgd("", "", "g")},
      {"the update reads a fused result of the partial", Sgd("", SquaresOfGAndLr(), "u")},
      {"the sum is read by another op too",
       Sgd("", "ops { kind: OP_UNARY fn: 'neg' inputs: 'gs' outputs: 'u' } ")},
      {"the partial is written again in between",
       Sgd("", "ops { kind: OP_UNARY fn: 'neg' inputs: 'x' outputs: 'g' } ")},
      {"a view of the partial is written in between",
       Sgd("",
           "ops { kind: OP_RESHAPE inputs: 'g' outputs: 'u' } "
           "ops { kind: OP_UNARY fn: 'neg' inputs: 'x' outputs: 'u' } ")},
      {"the sum has a view", Sgd("", "ops { kind: OP_RESHAPE inputs: 'gs' outputs: 'u' } ")},
  };
  for (const auto& c : cases) {
    v1::ShardMapProgram p = c.program;
    FuseReductionsIntoUpdates(&p);
    EXPECT_NE(FindKind(p, v1::OP_PSUM), nullptr) << c.why;
    const v1::Op* update = FindKind(p, v1::OP_FUSED_ELEMENTWISE);
    ASSERT_NE(update, nullptr) << c.why;
    EXPECT_EQ(update->axis_names_size(), 0) << c.why;
  }
}

}  // namespace
}  // namespace meshrun
