// The SPMD partitioner's per-op sharding rules on the seeds' layouts: tensor parallel (000, 003),
// data parallel and FSDP (001), and the backward pass's weight gradients.
#include "core/spmd/sharding_rules.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace meshrun {
namespace spmd {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

PartitionSpec P(std::vector<std::string> names) { return PartitionSpec::Of(std::move(names)); }
const DotDimensionNumbers kMatmul{{1}, {0}, {}, {}};  // [m, k] @ [k, n]
const DotDimensionNumbers kGradW{{0}, {0}, {}, {}};   // x^T @ dy: [b, in], [b, out] -> [in, out]

TEST(PlanDotGeneralTest, TensorParallelFirstMatmulNeedsNoCommunication) {
  const Mesh mesh = *Mesh::Parse("data=2,model=4");
  // seed 000: x ('data', None) [8, 1024] @ W1 (None, 'model') [1024, 4096]
  auto plan =
      PlanDotGeneral({8, 1024}, P({"data", ""}), {1024, 4096}, P({"", "model"}), kMatmul, mesh);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(plan->reshards, IsEmpty());
  EXPECT_EQ(plan->result, P({"data", "model"}));
  EXPECT_THAT(plan->partial_sum_axes, IsEmpty());
}

TEST(PlanDotGeneralTest, TensorParallelSecondMatmulLeavesPartialSumsOverModel) {
  const Mesh mesh = *Mesh::Parse("data=2,model=4");
  // y ('data', 'model') @ W2 ('model', None): local partial sums, then psum over 'model'.
  auto plan = PlanDotGeneral({8, 4096}, P({"data", "model"}), {4096, 1024}, P({"model", ""}),
                             kMatmul, mesh);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(plan->reshards, IsEmpty());
  EXPECT_EQ(plan->result, P({"data", ""}));
  EXPECT_THAT(plan->partial_sum_axes, ElementsAre("model"));
}

TEST(PlanDotGeneralTest, DataParallel) {
  const Mesh mesh = *Mesh::Parse("data=8");
  auto fwd =
      PlanDotGeneral({128, 784}, P({"data", ""}), {784, 512}, PartitionSpec(), kMatmul, mesh);
  EXPECT_THAT(fwd->reshards, IsEmpty());
  EXPECT_EQ(fwd->result, P({"data", ""}));
  // dW = x^T dy: contracting the batch, sharded alike on both sides: partial sums over 'data'
  // (the data-parallel gradient all-reduce).
  auto grad =
      PlanDotGeneral({128, 784}, P({"data", ""}), {128, 512}, P({"data", ""}), kGradW, mesh);
  EXPECT_THAT(grad->reshards, IsEmpty());
  EXPECT_EQ(grad->result, P({"", ""}));
  EXPECT_THAT(grad->partial_sum_axes, ElementsAre("data"));
}

TEST(PlanDotGeneralTest, FsdpGathersTheWeightBeforeUse) {
  const Mesh mesh = *Mesh::Parse("data=8");
  // x ('data', None) @ W ('data', None): 'data' already shards x's batch dim, so x cannot be
  // sliced along k; W is all_gathered over 'data'.
  auto plan =
      PlanDotGeneral({128, 784}, P({"data", ""}), {784, 512}, P({"data", ""}), kMatmul, mesh);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->reshards.size(), 1u);
  EXPECT_EQ(plan->reshards[0], (Reshard{Reshard::kAllGather, 1, 0, {"data"}}));
  EXPECT_EQ(plan->operands[1], P({"", ""}));
  EXPECT_EQ(plan->result, P({"data", ""}));
  EXPECT_THAT(plan->partial_sum_axes, IsEmpty());
  // Each device receives the 7 blocks it lacks: 7 * (98 * 512 * 4) bytes.
  EXPECT_EQ(ReshardBytesPerDevice(plan->reshards[0], {784, 512}, P({"data", ""}), mesh, 4),
            7 * 98 * 512 * 4);
}

TEST(PlanDotGeneralTest, ReplicatedOperandIsSlicedForFree) {
  const Mesh mesh = *Mesh::Parse("model=4");
  // x replicated @ W ('model', None): x is sliced along k, partial sums over 'model'.
  auto plan =
      PlanDotGeneral({8, 1024}, PartitionSpec(), {1024, 256}, P({"model", ""}), kMatmul, mesh);
  ASSERT_EQ(plan->reshards.size(), 1u);
  EXPECT_EQ(plan->reshards[0], (Reshard{Reshard::kSlice, 0, 1, {"model"}}));
  EXPECT_EQ(ReshardBytesPerDevice(plan->reshards[0], {8, 1024}, PartitionSpec(), mesh, 4), 0);
  EXPECT_EQ(plan->result, P({"", ""}));
  EXPECT_THAT(plan->partial_sum_axes, ElementsAre("model"));
}

TEST(PlanDotGeneralTest, ContractingDimsShardedDifferently) {
  const Mesh mesh = *Mesh::Parse("data=2,model=4");
  auto plan =
      PlanDotGeneral({8, 1024}, P({"", "model"}), {1024, 256}, P({"data", ""}), kMatmul, mesh);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // rhs gathered over 'data', then sliced to the lhs's 'model'.
  EXPECT_THAT(plan->reshards, ElementsAre(Reshard{Reshard::kAllGather, 1, 0, {"data"}},
                                          Reshard{Reshard::kSlice, 1, 0, {"model"}}));
  EXPECT_THAT(plan->partial_sum_axes, ElementsAre("model"));
}

TEST(PlanDotGeneralTest, AMeshAxisShardsOneResultDim) {
  const Mesh mesh = *Mesh::Parse("data=8");
  auto plan = PlanDotGeneral({64, 32}, P({"data", ""}), {32, 64}, P({"", "data"}), kMatmul, mesh);
  EXPECT_THAT(plan->reshards, ElementsAre(Reshard{Reshard::kAllGather, 1, 1, {"data"}}));
  EXPECT_EQ(plan->result, P({"data", ""}));
}

TEST(PlanDotGeneralTest, BatchDimsOfScanStackedLayers) {
  const Mesh mesh = *Mesh::Parse("layer=2,model=4");
  // [L, b, k] @ [L, k, n] batched over L: lhs sharded over 'layer', rhs sliced to match.
  const DotDimensionNumbers dn{{2}, {1}, {0}, {0}};
  auto plan =
      PlanDotGeneral({4, 8, 16}, P({"layer", "", ""}), {4, 16, 32}, P({"", "", "model"}), dn, mesh);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(plan->reshards, ElementsAre(Reshard{Reshard::kSlice, 1, 0, {"layer"}}));
  EXPECT_EQ(plan->result, P({"layer", "", "model"}));
}

TEST(PlanDotGeneralTest, RejectsBadInput) {
  const Mesh mesh = *Mesh::Parse("data=8");
  EXPECT_THAT(PlanDotGeneral({8, 16}, PartitionSpec(), {32, 4}, PartitionSpec(), kMatmul, mesh)
                  .status()
                  .message(),
              HasSubstr("differ in size"));
  EXPECT_THAT(
      PlanDotGeneral({8, 16}, PartitionSpec(), {16, 4}, PartitionSpec(), {{2}, {0}, {}, {}}, mesh)
          .status()
          .message(),
      HasSubstr("lhs contracting dim 2"));
  EXPECT_THAT(PlanDotGeneral({6, 16}, P({"data"}), {16, 4}, PartitionSpec(), kMatmul, mesh)
                  .status()
                  .message(),
              HasSubstr("lhs"));
}

TEST(PlanElementwiseTest, RhsFollowsLhs) {
  const Mesh mesh = *Mesh::Parse("data=2,model=4");
  auto same = PlanElementwise({8, 16}, P({"data", "model"}), P({"data", "model"}), mesh);
  EXPECT_THAT(same->reshards, IsEmpty());
  // A replicated bias is sliced; a transposed layout is gathered first, then sliced.
  auto bias = PlanElementwise({8, 16}, P({"data", "model"}), PartitionSpec(), mesh);
  EXPECT_THAT(bias->reshards, ElementsAre(Reshard{Reshard::kSlice, 1, 0, {"data"}},
                                          Reshard{Reshard::kSlice, 1, 1, {"model"}}));
  auto swapped = PlanElementwise({8, 16}, P({"model", "data"}), P({"data", "model"}), mesh);
  EXPECT_THAT(swapped->reshards, ElementsAre(Reshard{Reshard::kAllGather, 1, 0, {"data"}},
                                             Reshard{Reshard::kAllGather, 1, 1, {"model"}},
                                             Reshard{Reshard::kSlice, 1, 0, {"model"}},
                                             Reshard{Reshard::kSlice, 1, 1, {"data"}}));
  EXPECT_EQ(swapped->result, P({"model", "data"}));
}

TEST(PlanReduceTest, ShardedReducedDimsLeavePartialResults) {
  const Mesh mesh = *Mesh::Parse("data=2,model=4");
  // The loss mean over a batch sharded over 'data': a pmean over 'data' completes it.
  auto loss = PlanReduce({8, 16}, P({"data", "model"}), {0}, mesh);
  EXPECT_EQ(loss->result, P({"model"}));
  EXPECT_THAT(loss->partial_sum_axes, ElementsAre("data"));
  auto all = PlanReduce({8, 16}, P({"data", "model"}), {0, 1}, mesh);
  EXPECT_THAT(all->partial_sum_axes, ElementsAre("data", "model"));
  EXPECT_THAT(PlanReduce({8}, PartitionSpec(), {1}, mesh).status().message(),
              HasSubstr("reduce dim 1"));
}

TEST(PlanPartialSumTest, DataParallelGradientIsAPsum) {
  const Mesh mesh = *Mesh::Parse("data=8");
  auto plan = PlanPartialSum({784, 512}, PartitionSpec(), {"data"}, PartitionSpec(), mesh);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(plan->reductions, ElementsAre(Reduction{Reduction::kPsum, {"data"}, -1}));
  EXPECT_THAT(plan->reshards, IsEmpty());
  // Ring all-reduce: 2 (n-1)/n of the bytes.
  EXPECT_EQ(ReductionBytesPerDevice(plan->reductions[0], {784, 512}, PartitionSpec(), mesh, 4),
            2 * 7 * (784 * 512 * 4 / 8));
}

TEST(PlanPartialSumTest, FsdpGradientIsAPsumScatterIntoTheParamsLayout) {
  const Mesh mesh = *Mesh::Parse("data=8");
  auto plan = PlanPartialSum({784, 512}, PartitionSpec(), {"data"}, P({"data", ""}), mesh);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(plan->reductions, ElementsAre(Reduction{Reduction::kPsumScatter, {"data"}, 0}));
  EXPECT_THAT(plan->reshards, IsEmpty());
  EXPECT_EQ(ReductionBytesPerDevice(plan->reductions[0], {784, 512}, PartitionSpec(), mesh, 4),
            7 * (784 * 512 * 4 / 8));
}

TEST(PlanPartialSumTest, TensorParallelAndTwoD) {
  const Mesh mesh = *Mesh::Parse("data=2,model=4");
  // z ('data', None) partial over 'model' -> psum over 'model'.
  auto tp = PlanPartialSum({8, 1024}, P({"data", ""}), {"model"}, P({"data", ""}), mesh);
  EXPECT_THAT(tp->reductions, ElementsAre(Reduction{Reduction::kPsum, {"model"}, -1}));
  // A constraint ('data', 'model') on it instead: psum_scatter along dim 1.
  auto sp = PlanPartialSum({8, 1024}, P({"data", ""}), {"model"}, P({"data", "model"}), mesh);
  EXPECT_THAT(sp->reductions, ElementsAre(Reduction{Reduction::kPsumScatter, {"model"}, 1}));
  // 2-D weight gradient, partial over both axes, parameter sharded (None, 'model'):
  // reduce-scatter over 'model' along dim 1, then all-reduce over 'data'.
  auto w = PlanPartialSum({1024, 1024}, PartitionSpec(), {"data", "model"}, P({"", "model"}), mesh);
  EXPECT_THAT(w->reductions, ElementsAre(Reduction{Reduction::kPsumScatter, {"model"}, 1},
                                         Reduction{Reduction::kPsum, {"data"}, -1}));
  // Nothing partial, layout differs: reshards only.
  auto moved = PlanPartialSum({8, 1024}, P({"data", ""}), {}, PartitionSpec(), mesh);
  EXPECT_THAT(moved->reductions, IsEmpty());
  EXPECT_THAT(moved->reshards, ElementsAre(Reshard{Reshard::kAllGather, 0, 0, {"data"}}));
}

TEST(PlanPartialSumTest, RejectsInconsistentPartialAxes) {
  const Mesh mesh = *Mesh::Parse("data=2,model=4");
  EXPECT_THAT(
      PlanPartialSum({8, 16}, P({"data", ""}), {"data"}, PartitionSpec(), mesh).status().message(),
      HasSubstr("also shards"));
  EXPECT_THAT(
      PlanPartialSum({8, 16}, PartitionSpec(), {"pipe"}, PartitionSpec(), mesh).status().message(),
      HasSubstr("'pipe'"));
}

}  // namespace
}  // namespace spmd
}  // namespace meshrun
