#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/job_driver.h"

namespace meshrun {
namespace {

using ::testing::HasSubstr;

std::string Smaller(const std::string& mesh, int available, int min_workers) {
  absl::StatusOr<Mesh> m = SmallerDataMesh(*Mesh::Parse(mesh), available, min_workers);
  return m.ok() ? m->ToString() : std::string(m.status().message());
}

// The data axis shrinks to the largest size that divides it (so the global batch still divides)
// and fits the workers that rejoined; other axes keep their sizes.
TEST(SmallerDataMeshTest, ShrinksTheDataAxisToADivisorThatFits) {
  EXPECT_EQ(Smaller("data=8", 7, 4), Mesh::Parse("data=4")->ToString());
  EXPECT_EQ(Smaller("data=8", 3, 1), Mesh::Parse("data=2")->ToString());
  EXPECT_EQ(Smaller("data=6", 5, 2), Mesh::Parse("data=3")->ToString());
  EXPECT_EQ(Smaller("model=2,data=4", 7, 4), Mesh::Parse("model=2,data=2")->ToString());
  EXPECT_EQ(Smaller("x=4", 3, 2), Mesh::Parse("x=2")->ToString()) << "no data axis: the first";
  EXPECT_THAT(Smaller("data=8", 3, 4), HasSubstr("3 workers rejoined; no smaller 'data' axis"));
  EXPECT_EQ(Smaller("data=2,model=4", 7, 1), Mesh::Parse("data=1,model=4")->ToString());
  EXPECT_THAT(Smaller("data=2,model=4", 3, 1), HasSubstr("no smaller 'data' axis dividing 2"))
      << "data=1 still needs 4 workers";
}

}  // namespace
}  // namespace meshrun
