#include "tests/testutil/cluster.h"

#include <unistd.h>

#include <random>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace meshrun::testing {

std::unique_ptr<LocalCluster> StartCluster(const std::string& mesh, const std::string& tag) {
  LocalClusterOptions o;
  o.mesh = mesh;
  o.log_dir = absl::StrCat(::testing::TempDir(), "/meshrun-", tag, "-", mesh, "-", getpid());
  auto c = LocalCluster::Start(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

Tensor NormalTensor(Dims dims, uint32_t seed) {
  Tensor t(v1::DTYPE_F32, std::move(dims));
  std::mt19937 rng(seed);
  std::normal_distribution<float> d;
  for (int64_t i = 0; i < t.num_elements(); ++i) t.data<float>()[i] = d(rng);
  return t;
}

}  // namespace meshrun::testing
