#include "server/straggler_ledger.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace meshrun {
namespace {

void Arrive(v1::RunShardMapResponse& r, int run, int index, const std::string& op,
            const std::string& axes, int64_t micros) {
  v1::CollectiveArrival* a = r.add_arrivals();
  a->set_run(run);
  a->set_index(index);
  a->set_op(op);
  a->set_axes(axes);
  a->set_unix_micros(micros);
}

// On data=2,model=2 (rank = 2 * data + model), a psum over data runs in groups {0, 2} and
// {1, 3}; one over (data, model) in one group of 4. Each group's skew is its last arrival minus
// its first, and the late rank the last to arrive.
TEST(StragglerLedgerTest, SkewPerCollectiveAndGroup) {
  const Mesh mesh = *Mesh::Parse("data=2,model=2");
  std::vector<v1::RunShardMapResponse> responses(4);
  const int64_t t0 = 1'700'000'000'000'000;
  const int64_t psum[4] = {t0, t0 + 100, t0 + 2500, t0 + 400};  // rank 2 is 2.5 ms late
  for (int r = 0; r < 4; ++r) Arrive(responses[r], 0, 0, "psum", "data", psum[r]);
  const int64_t gather[4] = {t0 + 9000, t0 + 9000, t0 + 9000, t0 + 12000};
  for (int r = 0; r < 4; ++r) Arrive(responses[r], 0, 1, "all_gather", "data,model", gather[r]);
  Arrive(responses[1], 1, 0, "psum", "data", t0 + 20000);  // alone: no skew to measure
  Arrive(responses[0], 0, 2, "psum", "pipeline", t0);      // not an axis of this mesh
  Arrive(responses[2], 0, 2, "psum", "pipeline", t0 + 5);
  std::vector<CollectiveSkew> skews = ArrivalSkews(mesh, responses);
  ASSERT_EQ(skews.size(), 3u);
  // Ordered by (run, index, the group's lowest rank).
  EXPECT_EQ(skews[0].op, "psum");
  EXPECT_EQ(skews[0].axes, "data");
  EXPECT_DOUBLE_EQ(skews[0].seconds, 2.5e-3);
  EXPECT_EQ(skews[0].late_rank, 2);
  EXPECT_DOUBLE_EQ(skews[1].seconds, 300e-6);  // ranks 1 and 3
  EXPECT_EQ(skews[1].late_rank, 3);
  EXPECT_EQ(skews[2].op, "all_gather");
  EXPECT_DOUBLE_EQ(skews[2].seconds, 3e-3);
  EXPECT_EQ(skews[2].late_rank, 3);
}

}  // namespace
}  // namespace meshrun
