// Helpers for end-to-end tests: local clusters with per-test log directories, random tensors.
#ifndef MESHRUN_TESTS_TESTUTIL_CLUSTER_H_
#define MESHRUN_TESTS_TESTUTIL_CLUSTER_H_

#include <memory>
#include <string>

#include "core/tensor.h"
#include "meshrun/local_cluster.h"

namespace meshrun::testing {

// A cluster for `mesh` whose logs go under the test temp dir, named after `tag`; null (with a
// test failure recorded) if it does not start.
std::unique_ptr<LocalCluster> StartCluster(const std::string& mesh, const std::string& tag);

// f32 standard normal samples from std::mt19937(seed).
Tensor NormalTensor(Dims dims, uint32_t seed);

}  // namespace meshrun::testing

#endif  // MESHRUN_TESTS_TESTUTIL_CLUSTER_H_
