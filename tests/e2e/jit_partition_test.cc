// JitBuilder's partitioner alone (no cluster): the layouts and collectives it derives for what
// JAX's jaxprs hold (the Python SDK's programs), and the errors for bad annotations.
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "meshrun/jit.h"

namespace meshrun {
namespace {

PartitionSpec P(std::vector<std::string> names) { return PartitionSpec::Of(std::move(names)); }

std::vector<std::string> Collectives(const JitBuilder& jit) {
  std::vector<std::string> out;
  for (const auto& c : jit.collectives()) out.push_back(c.Short());
  return out;
}

TEST(JitPartitionTest, ReportsBadAnnotations) {
  JitBuilder jit(*Mesh::Parse("data=2,model=4"));
  auto x = jit.Input(v1::DTYPE_F32, {6, 64}, P({"model", ""}));  // 6 rows over 4 devices
  jit.Output(x, PartitionSpec());
  EXPECT_THAT(std::string(jit.Build().status().message()), ::testing::HasSubstr("input 0"));
  JitBuilder jit2(*Mesh::Parse("data=2,model=4"));
  auto a = jit2.Input(v1::DTYPE_F32, {8, 64}, PartitionSpec());
  auto b = jit2.Input(v1::DTYPE_F32, {8, 32}, PartitionSpec());
  jit2.Output(jit2.Binary("add", a, b), PartitionSpec());
  EXPECT_THAT(std::string(jit2.Build().status().message()), ::testing::HasSubstr("differ"));
}

// Layouts for what JAX's jaxprs hold (the Python SDK's programs): reshapes keep a sharding of a
// group's major dim when it divides, broadcasts with no spec carry the operand's layout, and an
// element-wise op follows its sharded operand rather than gathering it.
TEST(JitPartitionTest, ReshapeBroadcastAndElementwiseFollowTheShardedOperand) {
  JitBuilder jit(*Mesh::Parse("data=2,model=4"));
  auto x = jit.Input(v1::DTYPE_F32, {8, 16}, P({"data", "model"}));
  auto split = jit.Reshape(x, {2, 4, 4, 4});  // [8] -> [2, 4]: data moves to dim 0
  EXPECT_EQ(jit.sharding(split), P({"data", "", "model"}));
  auto merged = jit.Reshape(x, {128});  // 'model' sharding a minor dim of the group: gathered
  EXPECT_EQ(jit.sharding(merged), P({"data"}));
  auto unit = jit.Reshape(x, {1, 8, 1, 16});
  EXPECT_EQ(jit.sharding(unit), P({"", "data", "", "model"}));
  auto b = jit.Input(v1::DTYPE_F32, {1, 16}, P({"", "model"}));
  auto grown = jit.BroadcastInDimPropagated(b, {8, 16}, {0, 1});
  EXPECT_EQ(jit.sharding(grown), P({"", "model"}));
  auto replicated = jit.Constant(1.0f, {8, 16});
  auto sum = jit.Add(replicated, x);  // lhs replicated: the result follows x, no gather
  EXPECT_EQ(jit.sharding(sum), P({"data", "model"}));
  jit.Output(sum, P({"data", "model"}));
  jit.Output(jit.Reshape(grown, {16, 8}), PartitionSpec());
  ASSERT_TRUE(jit.Build().ok()) << jit.Build().status();
  EXPECT_EQ(Collectives(jit),
            (std::vector<std::string>{"all_gather(model)@1", "all_gather(model)@1"}));
  JitBuilder bad(*Mesh::Parse("data=2,model=4"));
  bad.Reshape(bad.Input(v1::DTYPE_F32, {8, 16}, PartitionSpec()), {8, 15});
  EXPECT_THAT(std::string(bad.Build().status().message()), ::testing::HasSubstr("element count"));
}

// A padding block (replicated) concatenated before a batch-sharded array (lax.pad of an image, a
// convolution's input): the result keeps the batch sharding and the block is sliced locally;
// no collective moves the data.
TEST(JitPartitionTest, ConcatenateFollowsItsMostPartitionedOperand) {
  JitBuilder jit(*Mesh::Parse("data=2,model=4"));
  auto x = jit.Input(v1::DTYPE_F32, {8, 6, 4}, P({"data", "", "model"}));
  auto lo = jit.Constant(0.0f, {8, 1, 4});
  auto hi = jit.Constant(0.0f, {8, 2, 4});
  auto padded = jit.Concatenate({lo, x, hi}, 1);
  EXPECT_EQ(jit.sharding(padded), P({"data", "", "model"}));
  auto y = jit.Input(v1::DTYPE_F32, {8, 6, 4}, P({"data", "", ""}));
  auto mixed = jit.Concatenate({y, x}, 1);  // x is the more partitioned: y is sliced over 'model'
  EXPECT_EQ(jit.sharding(mixed), P({"data", "", "model"}));
  jit.Output(padded, P({"data", "", "model"}));
  ASSERT_TRUE(jit.Build().ok()) << jit.Build().status();
  EXPECT_THAT(Collectives(jit), ::testing::IsEmpty());
}

// A partial scalar plus a partial array (jnp.trace(x) + jnp.eye(n) @ x with x sharded over the
// contracted 'data'): both are partial sums over 'data', so the sum stays partial, with the
// array's shape (the scalar is broadcast), and takes one psum.
TEST(JitPartitionTest, APartialScalarPlusAPartialArrayHasTheArraysShape) {
  JitBuilder jit(*Mesh::Parse("data=2,model=4"));
  auto x = jit.Input(v1::DTYPE_F32, {8, 12}, P({"data", ""}));
  auto total = jit.Reduce("sum", x, {0, 1});                             // partial over 'data'
  auto mixed = jit.DotGeneral(jit.Constant(1.0f, {8, 8}), x, {1}, {0});  // partial over 'data'
  for (auto [a, b] : {std::pair{total, mixed}, {mixed, total}}) {
    for (const char* fn : {"add", "sub"}) {
      auto sum = jit.Binary(fn, a, b);
      EXPECT_EQ(jit.shape(sum), (Dims{8, 12})) << fn;
      jit.Output(jit.Reduce("sum", sum, {0, 1}), PartitionSpec());
    }
  }
  ASSERT_TRUE(jit.Build().ok()) << jit.Build().status();
}

// A result with no out_sharding (OutputPropagated, the Python SDK's jax.jit results) keeps the
// layout propagation gave it, as XLA lays out jax.jit's: an element-wise op of a sharded input
// stays sharded, a dot keeps its operands' non-contracted axes, and a partial sum is completed
// (one psum) and replicated. The recorded program replays to the same layouts.
TEST(JitPartitionTest, APropagatedResultKeepsItsLayoutAndAPartialSumIsCompleted) {
  JitBuilder jit(*Mesh::Parse("data=2,model=4"));
  auto s = jit.Input(v1::DTYPE_F32, {16}, P({"model"}));
  auto x = jit.Input(v1::DTYPE_F32, {8, 16}, P({"data", ""}));
  auto w = jit.Input(v1::DTYPE_F32, {16, 12}, P({"", "model"}));
  jit.OutputPropagated(jit.Binary("mul", s, jit.Constant(2.0f, {16})));
  jit.OutputPropagated(jit.DotGeneral(x, w, {1}, {0}));
  jit.OutputPropagated(jit.Reduce("sum", x, {0, 1}));  // partial over 'data'
  absl::StatusOr<v1::ShardMapProgram> built = jit.Build();
  ASSERT_TRUE(built.ok()) << built.status();
  const std::vector<PartitionSpec> want = {P({"model"}), P({"data", "model"}), PartitionSpec()};
  ASSERT_EQ(built->out_specs_size(), 3);
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(PartitionSpec::FromProto(built->out_specs(i)), want[i]) << "result " << i;
  EXPECT_THAT(Collectives(jit), ::testing::ElementsAre(::testing::StartsWith("psum(data)")));
  EXPECT_TRUE(jit.global_program().ops(jit.global_program().ops_size() - 1).propagated());
  absl::StatusOr<std::unique_ptr<JitBuilder>> replayed =
      JitBuilder::FromGlobalProgram(*Mesh::Parse("data=2,model=4"), jit.global_program());
  ASSERT_TRUE(replayed.ok()) << replayed.status();
  absl::StatusOr<v1::ShardMapProgram> rebuilt = (*replayed)->Build();
  ASSERT_TRUE(rebuilt.ok()) << rebuilt.status();
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(PartitionSpec::FromProto(rebuilt->out_specs(i)), want[i]) << "replayed result " << i;
}

}  // namespace
}  // namespace meshrun
