// Runs a per-shard program's "main" once in an Executor, for the program-rewrite tests
// (SimplifyProgram, FuseElementwise) that compare a program's results before and after.
#ifndef MESHRUN_TESTS_WORKER_RUN_PROGRAM_H_
#define MESHRUN_TESTS_WORKER_RUN_PROGRAM_H_

#include <algorithm>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "worker/executor.h"

namespace meshrun {
namespace testing {

// Binds every argument of `p` to a tensor of its declared shape filled with a fixed
// pseudo-random sequence in (-1.5, 0.5), then passed to `adjust(name, tensor)` (e.g. to keep a
// second moment non-negative), runs "main" and returns the results by name.
inline std::map<std::string, std::vector<float>> RunProgramOnce(
    const v1::ShardMapProgram& p,
    const std::function<void(const std::string&, Tensor&)>& adjust = nullptr) {
  absl::StatusOr<std::unique_ptr<Executor>> ex = Executor::Create(p.program(), Executor::Options{});
  EXPECT_TRUE(ex.ok()) << ex.status();
  if (!ex.ok()) return {};
  std::map<std::string, Tensor> args;
  float v = 0.37f;
  for (const v1::BufferDecl& b : p.program().buffers()) {
    if (std::find(p.inputs().begin(), p.inputs().end(), b.name()) == p.inputs().end()) continue;
    Tensor t(v1::DTYPE_F32, Dims(b.shape().dims().begin(), b.shape().dims().end()));
    for (int64_t i = 0; i < t.num_elements(); ++i) {
      v = v * 3.7f - static_cast<float>(static_cast<int>(v * 3.7f)) - 0.5f;  // in (-1.5, 0.5)
      t.data<float>()[i] = v;
    }
    if (adjust) adjust(b.name(), t);
    args.emplace(b.name(), std::move(t));
  }
  for (const auto& [name, t] : args) EXPECT_TRUE((*ex)->BindInput(name, t).ok()) << name;
  EXPECT_TRUE((*ex)->Run("main", RunContext{}).ok());
  std::map<std::string, std::vector<float>> out;
  for (const std::string& name : p.outputs()) {
    absl::StatusOr<Tensor> t = (*ex)->TakeOutput(name);
    EXPECT_TRUE(t.ok()) << name;
    if (t.ok()) out[name].assign(t->data<float>(), t->data<float>() + t->num_elements());
  }
  return out;
}

}  // namespace testing
}  // namespace meshrun

#endif  // MESHRUN_TESTS_WORKER_RUN_PROGRAM_H_
