// Logical axis rules and the FSDP layout rule, against the seeds' printed results
// (shared/seeds/000: logical_to_mesh of the scan-stacked MLP; 001: shard_params).
#include "core/sharding/logical_axes.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace meshrun {
namespace {

using ::testing::HasSubstr;

LogicalAxisRules Rules(absl::string_view text) { return *ParseLogicalAxisRules(text); }
Mesh MeshOf(absl::string_view text) { return *Mesh::Parse(text); }
PartitionSpec Spec(std::vector<PartitionSpec::Entry> entries) {
  return PartitionSpec(std::move(entries));
}

TEST(LogicalAxisRulesTest, ParsesNoneAndTuples) {
  auto rules = ParseLogicalAxisRules("batch=data, hidden=model, embed=, heads=data+model");
  ASSERT_TRUE(rules.ok()) << rules.status();
  EXPECT_EQ(*rules, (LogicalAxisRules{{"batch", {"data"}},
                                      {"hidden", {"model"}},
                                      {"embed", {}},
                                      {"heads", {"data", "model"}}}));
  EXPECT_EQ(
      LogicalAxisRulesToString(*rules),
      "(('batch', 'data'), ('hidden', 'model'), ('embed', None), ('heads', ('data', 'model')))");
  EXPECT_TRUE(ParseLogicalAxisRules("")->empty());
}

TEST(LogicalAxisRulesTest, RejectsMalformedRulesNamingThem) {
  auto s = ParseLogicalAxisRules("batch=data,hidden");
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(s.status().message(), HasSubstr("'hidden'"));
  EXPECT_THAT(ParseLogicalAxisRules("=data").status().message(), HasSubstr("'=data'"));
  EXPECT_THAT(ParseLogicalAxisRules("x=data+").status().message(), HasSubstr("empty mesh axis"));
}

TEST(LogicalAxisRulesTest, ValidatesMeshAxes) {
  EXPECT_TRUE(
      ValidateLogicalAxisRules(Rules("batch=data,hidden=model"), MeshOf("data=2,model=4")).ok());
  auto s = ValidateLogicalAxisRules(Rules("batch=data,hidden=tensor"), MeshOf("data=2,model=4"));
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("'tensor'"));
  EXPECT_THAT(s.message(), HasSubstr("('hidden', 'tensor')"));
}

// shared/seeds/000: rules (('batch', 'data'), ('hidden', 'model')) turn the scan-stacked MLP's
// W1 ('layer', 'embed', 'hidden') and W2 ('layer', 'hidden', 'embed') into the specs of the
// non-logical version; the input ('batch', 'embed') into P('data', None).
TEST(LogicalToMeshTest, SeedMlpRules) {
  const LogicalAxisRules rules = Rules("batch=data,hidden=model");
  EXPECT_EQ(LogicalToMesh({"layer", "embed", "hidden"}, rules)->ToString(),
            "PartitionSpec(None, None, 'model')");
  EXPECT_EQ(LogicalToMesh({"layer", "hidden", "embed"}, rules)->ToString(),
            "PartitionSpec(None, 'model', None)");
  EXPECT_EQ(LogicalToMesh({"batch", "embed"}, rules)->ToString(), "PartitionSpec('data', None)");
  // Changing the rules, not the model: FSDP-style embed over data.
  EXPECT_EQ(
      LogicalToMesh({"layer", "embed", "hidden"}, Rules("embed=data,hidden=model"))->ToString(),
      "PartitionSpec(None, 'data', 'model')");
}

TEST(LogicalToMeshTest, EarlierRulesWinAndAMeshAxisShardsOneDim) {
  // 'data' is taken by 'batch' (the first rule), so 'embed' falls through to its next rule.
  const LogicalAxisRules rules = Rules("batch=data,embed=data,embed=model");
  EXPECT_EQ(*LogicalToMesh({"batch", "embed"}, rules), Spec({{"data"}, {"model"}}));
  // Priority is by rule order, not by dim order.
  EXPECT_EQ(*LogicalToMesh({"embed", "batch"}, Rules("batch=data,embed=data")),
            Spec({{}, {"data"}}));
  // A tuple rule blocks each of its axes.
  EXPECT_EQ(*LogicalToMesh({"batch", "hidden"}, Rules("batch=data+model,hidden=model")),
            Spec({{"data", "model"}, {}}));
  // A rule pinning a name to None keeps it replicated even if a later rule would shard it.
  EXPECT_EQ(*LogicalToMesh({"embed"}, Rules("embed=,embed=data")), Spec({{}}));
  // Unannotated dims ("") and names without rules are None.
  EXPECT_EQ(*LogicalToMesh({"", "vocab"}, Rules("batch=data")), Spec({{}, {}}));
}

TEST(LogicalToMeshTest, RejectsDuplicateLogicalNames) {
  auto s = LogicalToMesh({"embed", "embed"}, Rules("embed=data"));
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(s.status().message(), HasSubstr("'embed' occurs more than once"));
}

// shared/seeds/001's FSDP config: min_weight_size 2**4 on an 8-way 'data' axis, the classifier
// Dense(784 -> 512), Dense(512 -> 10).
TEST(FsdpShardTest, SeedClassifierLayout) {
  const Mesh mesh = MeshOf("data=8");
  const int64_t min_size = 1 << 4;
  auto k1 = FsdpShard({784, 512}, PartitionSpec(), mesh, "data", min_size);
  ASSERT_TRUE(k1.ok());
  EXPECT_EQ(k1->dim, 0);  // largest dim, divisible by 8
  EXPECT_EQ(k1->spec, Spec({{"data"}, {}}));
  EXPECT_EQ(FsdpShard({512}, PartitionSpec(), mesh, "data", min_size)->spec, Spec({{"data"}}));
  EXPECT_EQ(FsdpShard({512, 10}, PartitionSpec(), mesh, "data", min_size)->dim, 0);
  auto b2 = FsdpShard({10}, PartitionSpec(), mesh, "data", min_size);
  EXPECT_EQ(b2->dim, -1);  // 10 <= 2**4 elements: left replicated
  EXPECT_THAT(b2->reason, HasSubstr("too small"));
  auto odd = FsdpShard({20}, PartitionSpec(), mesh, "data", min_size);
  EXPECT_EQ(odd->dim, -1);  // big enough, but 20 is not divisible by 8
  EXPECT_THAT(odd->reason, HasSubstr("divisible by the 'data' axis size 8"));
}

TEST(FsdpShardTest, FollowsTheSeedsRule) {
  const Mesh mesh = MeshOf("data=4,model=2");
  // Default min_weight_size 2**18: a 512x512 (262144 elements) parameter stays whole.
  auto small = FsdpShard({512, 512}, PartitionSpec(), mesh, "data");
  EXPECT_EQ(small->dim, -1);
  EXPECT_THAT(small->reason, HasSubstr("too small"));
  // Ties go to the later dim (numpy argsort(shape)[::-1]).
  EXPECT_EQ(FsdpShard({1024, 1024}, PartitionSpec(), mesh, "data")->dim, 1);
  // The largest dim is not divisible: the next largest that is.
  EXPECT_EQ(FsdpShard({1026, 1024}, PartitionSpec(), mesh, "data")->dim, 1);
  // A dim already sharded (over 'model') is skipped; the result keeps it.
  auto tp = FsdpShard({4, 1024, 1024}, Spec({{}, {}, {"model"}}), mesh, "data");
  EXPECT_EQ(tp->dim, 1);
  EXPECT_EQ(tp->spec, Spec({{}, {"data"}, {"model"}}));
  // Already over 'data': unchanged.
  auto again = FsdpShard({1024, 1024}, Spec({{"data"}}), mesh, "data");
  EXPECT_EQ(again->dim, -1);
  EXPECT_EQ(again->spec, Spec({{"data"}}));
  EXPECT_THAT(again->reason, HasSubstr("already"));
  EXPECT_THAT(FsdpShard({8}, PartitionSpec(), mesh, "fsdp").status().message(),
              HasSubstr("'fsdp'"));
}

}  // namespace
}  // namespace meshrun
