#include "core/sharding/shard_layout.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace meshrun {
namespace {

using ::testing::HasSubstr;

Tensor Arange(Dims dims) {
  Tensor t(v1::DTYPE_F32, std::move(dims));
  for (int64_t i = 0; i < t.num_elements(); ++i) t.data<float>()[i] = static_cast<float>(i);
  return t;
}

TEST(ShardLayoutTest, ExtractThenInsertRoundTripsEverySpec) {
  Mesh mesh = *Mesh::Parse("i=4,j=2");
  const Tensor x = Arange({8, 6});
  for (const PartitionSpec& spec :
       {PartitionSpec(), PartitionSpec::Of({"i"}), PartitionSpec::Of({"", "j"}), PartitionSpec::Of({"i", "j"}),
        PartitionSpec::Of({"j", ""}), PartitionSpec(std::vector<PartitionSpec::Entry>{{"i", "j"}})}) {
    NamedSharding s(mesh, spec);
    Tensor back(v1::DTYPE_F32, {8, 6});
    for (int r = 0; r < 8; ++r) {
      absl::StatusOr<Tensor> shard = ExtractShard(x, s, r);
      ASSERT_TRUE(shard.ok()) << spec.ToString() << ": " << shard.status();
      ASSERT_TRUE(InsertShard(*shard, s, r, back).ok());
    }
    for (int64_t i = 0; i < 48; ++i) ASSERT_EQ(back.data<float>()[i], i) << spec.ToString();
  }
}

TEST(ShardLayoutTest, ShardHoldsTheRightBlock) {
  Mesh mesh = *Mesh::Parse("i=4,j=2");
  // P('i', 'j') on [8, 6]: rank 3 = (i 1, j 1) holds rows 2..3, columns 3..5.
  absl::StatusOr<Tensor> shard = ExtractShard(Arange({8, 6}), NamedSharding(mesh, PartitionSpec::Of({"i", "j"})), 3);
  ASSERT_TRUE(shard.ok());
  EXPECT_EQ(shard->dims(), (Dims{2, 3}));
  EXPECT_EQ(shard->data<float>()[0], 2 * 6 + 3);
  EXPECT_EQ(shard->data<float>()[5], 3 * 6 + 5);
}

TEST(ShardLayoutTest, VisualizeMatchesJax) {
  Mesh mesh = *Mesh::Parse("data=2,model=4");
  absl::StatusOr<std::string> v = VisualizeSharding({8, 8}, NamedSharding(mesh, PartitionSpec::Of({"", "model"})));
  ASSERT_TRUE(v.ok());
  EXPECT_THAT(*v, HasSubstr("| CPU 0,4 | CPU 1,5 | CPU 2,6 | CPU 3,7 |"));
  Mesh eight = *Mesh::Parse("i=8");
  v = VisualizeSharding({8}, NamedSharding(eight, PartitionSpec::Of({"i"})));
  ASSERT_TRUE(v.ok());
  EXPECT_THAT(*v, HasSubstr("| CPU 0 | CPU 1 | CPU 2 | CPU 3 | CPU 4 | CPU 5 | CPU 6 | CPU 7 |"));
  v = VisualizeSharding({8}, NamedSharding(eight, PartitionSpec()));
  EXPECT_THAT(*v, HasSubstr("| CPU 0,1,2,3,4,5,6,7 |"));
  Mesh ij = *Mesh::Parse("i=4,j=2");
  v = VisualizeSharding({192, 128}, NamedSharding(ij, PartitionSpec::Of({"i", "j"})));
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*v,
            "+-------+-------+\n| CPU 0 | CPU 1 |\n+-------+-------+\n| CPU 2 | CPU 3 |\n+-------+-------+\n"
            "| CPU 4 | CPU 5 |\n+-------+-------+\n| CPU 6 | CPU 7 |\n+-------+-------+\n");
  EXPECT_EQ(VisualizeSharding({2, 2, 2}, NamedSharding(ij, PartitionSpec())).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ShardLayoutTest, BlockHoldersListReplicas) {
  Mesh mesh = *Mesh::Parse("data=2,model=4");
  auto holders = BlockHolders({8, 8}, NamedSharding(mesh, PartitionSpec::Of({"", "model"})));
  EXPECT_EQ(holders, (std::vector<std::vector<int>>{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
}

TEST(ShardLayoutTest, InsertRejectsAWrongShard) {
  Mesh mesh = *Mesh::Parse("i=2");
  Tensor global(v1::DTYPE_F32, {4});
  Tensor wrong(v1::DTYPE_F32, {3});
  EXPECT_THAT(InsertShard(wrong, NamedSharding(mesh, PartitionSpec::Of({"i"})), 0, global).message(),
              HasSubstr("shard of rank 0 is f32[3]; expected f32[2]"));
}

}  // namespace
}  // namespace meshrun
