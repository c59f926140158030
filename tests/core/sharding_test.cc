#include "core/sharding/mesh.h"
#include "core/sharding/named_sharding.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace meshrun {
namespace {

using ::testing::HasSubstr;

TEST(MeshTest, RowMajorLayoutLikeCreateDeviceMesh) {
  absl::StatusOr<Mesh> mesh = Mesh::Parse("data=2,model=4");
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  EXPECT_EQ(mesh->size(), 8);
  EXPECT_EQ(mesh->Coords(6), (std::vector<int>{1, 2}));
  EXPECT_EQ(mesh->RankOf({1, 2}), 6);
  EXPECT_EQ(mesh->AxisGroup(6, 0), (std::vector<int>{2, 6}));
  EXPECT_EQ(mesh->AxisGroup(6, 1), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(mesh->ToString(), "Mesh('data': 2, 'model': 4)");
}

TEST(MeshTest, RejectsBadAxes) {
  EXPECT_THAT(Mesh::Parse("data=2,data=4").status().message(), HasSubstr("'data' appears twice"));
  EXPECT_THAT(Mesh::Parse("data=0").status().message(), HasSubstr("size 0"));
  EXPECT_THAT(Mesh::Parse("data").status().message(), HasSubstr("expected NAME=SIZE"));
  // A worker process per device: at most 4096 (a local cluster of 99999 would fork them all),
  // and a product past int's range is refused, not wrapped.
  EXPECT_TRUE(Mesh::Parse("data=64,model=64").ok());
  EXPECT_THAT(Mesh::Parse("data=99999").status().message(),
              HasSubstr("mesh data=99999 has more than 4096 devices"));
  EXPECT_FALSE(Mesh::Parse("data=65536,model=65536,x=2").ok());
  v1::Mesh proto;  // off the wire, too
  for (const char* axis : {"a", "b", "c"}) {
    v1::MeshAxis* a = proto.add_axes();
    a->set_name(axis);
    a->set_size(2000);
  }
  EXPECT_FALSE(Mesh::FromProto(proto).ok());
}

TEST(NamedShardingTest, ShardsBlocksAndReplicas) {
  Mesh mesh = *Mesh::Parse("data=2,model=4");
  NamedSharding s(mesh, PartitionSpec::Of({"", "model"}));
  ASSERT_TRUE(s.Validate({6, 8}).ok());
  EXPECT_EQ(s.ShardDims({6, 8}), (Dims{6, 2}));
  // Ranks 1 and 5 differ only on 'data', which the spec does not name: same block.
  EXPECT_EQ(s.ShardOffsets({6, 8}, 1), (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(s.ShardOffsets({6, 8}, 5), (std::vector<int64_t>{0, 2}));
  NamedSharding both(mesh, PartitionSpec(std::vector<PartitionSpec::Entry>{{"data", "model"}}));
  EXPECT_EQ(both.ShardOffsets({16}, 6), (std::vector<int64_t>{12}));
  EXPECT_EQ(both.spec().ToString(), "PartitionSpec(('data', 'model'))");
}

TEST(NamedShardingTest, ValidateNamesTheProblem) {
  Mesh mesh = *Mesh::Parse("data=4");
  EXPECT_EQ(
      NamedSharding(mesh, PartitionSpec::Of({"data", ""})).Validate({6, 4}).message(),
      "PartitionSpec('data', None) does not fit shape [6, 4]: dim 0 (6) is not divisible by 4 (the "
      "product of its mesh axes)");
  EXPECT_THAT(NamedSharding(mesh, PartitionSpec::Of({"model"})).Validate({8}).message(),
              HasSubstr("names axis 'model' which is not in Mesh('data': 4)"));
  EXPECT_THAT(NamedSharding(mesh, PartitionSpec::Of({"data", "data"})).Validate({8, 8}).message(),
              HasSubstr("uses mesh axis 'data' more than once"));
  EXPECT_THAT(NamedSharding(mesh, PartitionSpec::Of({"data", ""})).Validate({8}).message(),
              HasSubstr("has 2 entries but shape [8] has only 1 dims"));
}

TEST(PartitionSpecTest, TrailingNonesAreEqual) {
  EXPECT_EQ(PartitionSpec::Of({"model"}), PartitionSpec::Of({"model", ""}));
  EXPECT_NE(PartitionSpec::Of({"model"}), PartitionSpec::Of({"", "model"}));
  EXPECT_EQ(PartitionSpec::FromProto(PartitionSpec::Of({"a", ""}).ToProto()),
            PartitionSpec::Of({"a"}));
}

}  // namespace
}  // namespace meshrun

namespace meshrun {
namespace {

TEST(MeshTest, GroupsForEverySubsetOfAxes) {
  Mesh mesh = *Mesh::Parse("data=2,model=4");
  EXPECT_EQ(mesh.AxisSubsets(), (std::vector<std::vector<int>>{{0}, {1}, {0, 1}}));
  EXPECT_EQ(mesh.GroupsOver({0}), (std::vector<std::vector<int>>{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(mesh.GroupsOver({1}), (std::vector<std::vector<int>>{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(mesh.GroupsOver({0, 1}), (std::vector<std::vector<int>>{{0, 1, 2, 3, 4, 5, 6, 7}}));
  // ('model', 'data'): model major.
  EXPECT_EQ(mesh.AxesGroup(5, {1, 0}), (std::vector<int>{0, 4, 1, 5, 2, 6, 3, 7}));
}

}  // namespace
}  // namespace meshrun
