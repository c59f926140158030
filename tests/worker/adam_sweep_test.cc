// A model's Adam updates joined into one sweep over its parameters (Executor::JoinAdamUpdates):
// the same bits as each parameter's own update, and joined only where that is safe.
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/collectives/in_process_transport.h"
#include "core/optim/adamw.h"
#include "core/sharding/mesh.h"
#include "gtest/gtest.h"
#include "worker/executor.h"

namespace meshrun {
namespace {

struct Param {
  std::string name;
  int64_t size;
  float learning_rate = 1e-3f;
};

void Declare(v1::StepProgram* program, const std::string& name, int64_t size) {
  v1::BufferDecl* b = program->add_buffers();
  b->set_name(name);
  b->set_dtype(v1::DTYPE_F32);
  if (size >= 0) b->mutable_shape()->add_dims(size);
}

// One OP_ADAM_UPDATE per parameter, in order, all of step "step"; `between` puts an OP_UNARY
// (abs of the first gradient) after the first update; `grad_of` names each update's gradient
// (default: its own "g_<name>").
v1::StepProgram AdamProgram(const std::vector<Param>& params, bool between = false,
                            const std::vector<std::string>& grad_of = {}) {
  v1::StepProgram program;
  Declare(&program, "step", -1);
  Declare(&program, "abs_g", params[0].size);
  v1::Function* f = program.add_functions();
  f->set_name("main");
  for (size_t k = 0; k < params.size(); ++k) {
    const Param& p = params[k];
    for (const char* prefix : {"p_", "g_", "mu_", "nu_", "new_p_", "new_mu_", "new_nu_"})
      Declare(&program, absl::StrCat(prefix, p.name), p.size);
    v1::Op* op = f->add_ops();
    op->set_kind(v1::OP_ADAM_UPDATE);
    for (const std::string& in : {"p_" + p.name, grad_of.empty() ? "g_" + p.name : grad_of[k],
                                  "mu_" + p.name, "nu_" + p.name, std::string("step")}) {
      op->add_inputs(in);
    }
    for (const char* prefix : {"new_p_", "new_mu_", "new_nu_"})
      op->add_outputs(absl::StrCat(prefix, p.name));
    op->mutable_adamw()->set_learning_rate(p.learning_rate);
    op->mutable_adamw()->set_b1(0.9f);
    op->mutable_adamw()->set_b2(0.999f);
    op->mutable_adamw()->set_eps(1e-8f);
    op->mutable_adamw()->set_weight_decay(1e-4f);
    if (between && k == 0) {
      v1::Op* abs = f->add_ops();
      abs->set_kind(v1::OP_UNARY);
      abs->set_fn("abs");
      abs->add_inputs("g_" + p.name);
      abs->add_outputs("abs_g");
    }
  }
  return program;
}

std::vector<float> Filled(int64_t n, float scale, float offset, uint32_t seed) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) {
    seed = seed * 1664525u + 1013904223u;
    v[i] = offset + scale * (static_cast<float>(seed >> 8) / 16777216.0f - 0.5f);
  }
  return v;
}

bool SameBits(const float* a, const std::vector<float>& b) {
  return std::memcmp(a, b.data(), b.size() * sizeof(float)) == 0;
}

// Runs `program` on fixed values (step 4, so the bias corrections are not 1) and checks each
// parameter's results against core/optim's AdamWUpdate, bit for bit. Returns the executor's
// adam_sweeps().
int RunAndCheck(const v1::StepProgram& program, const std::vector<Param>& params, bool donate,
                const std::string& dependent = "",
                const Executor::Options& options = Executor::Options{}) {
  absl::StatusOr<std::unique_ptr<Executor>> ex = Executor::Create(program, options);
  EXPECT_TRUE(ex.ok()) << ex.status();
  if (!ex.ok()) return -1;
  Tensor step(v1::DTYPE_F32, {});
  step.data<float>()[0] = 3.0f;
  EXPECT_TRUE((*ex)->BindInput("step", step).ok());
  std::vector<Tensor> bound;
  for (size_t k = 0; k < params.size(); ++k) {
    const Param& p = params[k];
    const uint32_t seed = static_cast<uint32_t>(k * 4);
    const std::vector<std::vector<float>> values = {
        Filled(p.size, 2.0f, 0.0f, seed), Filled(p.size, 0.02f, 0.0f, seed + 1),
        Filled(p.size, 0.002f, 0.0f, seed + 2), Filled(p.size, 1e-5f, 1e-5f, seed + 3)};
    int j = 0;
    for (const char* prefix : {"p_", "g_", "mu_", "nu_"}) {
      Tensor t(v1::DTYPE_F32, {p.size});
      std::copy(values[j].begin(), values[j].end(), t.data<float>());
      ++j;
      std::string name = absl::StrCat(prefix, p.name);
      if (name == "g_" + p.name && (*ex)->buffer("partial_" + p.name) != nullptr) {
        // The gradient is a rider's sum of partial_<name> (over a group of one): zeros until
        // the rider writes it.
        EXPECT_TRUE((*ex)->BindInput(name, Tensor(v1::DTYPE_F32, {p.size})).ok());
        name = "partial_" + p.name;
      }
      EXPECT_TRUE((*ex)->BindInput(name, t, donate).ok());
      bound.push_back(std::move(t));
    }
  }
  Tensor loss(v1::DTYPE_F32, {3});
  for (int k = 0; k < 3; ++k) loss.data<float>()[k] = 0.25f * static_cast<float>(k + 1);
  if ((*ex)->buffer("loss") != nullptr) {
    EXPECT_TRUE((*ex)->BindInput("loss", loss).ok());
  }
  absl::Status ran = (*ex)->Run("main", RunContext{});
  EXPECT_TRUE(ran.ok()) << ran;
  for (size_t k = 0; k < params.size(); ++k) {
    const Param& p = params[k];
    const uint32_t seed = static_cast<uint32_t>(k * 4);
    std::vector<float> param = Filled(p.size, 2.0f, 0.0f, seed);
    // The dependent update's gradient is the first update's new parameter, as the executor
    // computed it (checked bit for bit just before).
    std::vector<float> grad = Filled(p.size, 0.02f, 0.0f, seed + 1);
    if (p.name == dependent) {
      const float* first = (*ex)->buffer("new_p_" + params[0].name)->data<float>();
      grad.assign(first, first + p.size);
    }
    std::vector<float> mu = Filled(p.size, 0.002f, 0.0f, seed + 2);
    std::vector<float> nu = Filled(p.size, 1e-5f, 1e-5f, seed + 3);
    AdamWHyperParams hp;
    hp.learning_rate = p.learning_rate;
    AdamWUpdate(hp, 4, param.data(), grad.data(), mu.data(), nu.data(), p.size);
    EXPECT_TRUE(SameBits((*ex)->buffer("new_p_" + p.name)->data<float>(), param)) << p.name;
    EXPECT_TRUE(SameBits((*ex)->buffer("new_mu_" + p.name)->data<float>(), mu)) << p.name;
    EXPECT_TRUE(SameBits((*ex)->buffer("new_nu_" + p.name)->data<float>(), nu)) << p.name;
  }
  if (const Tensor* summed = (*ex)->buffer("loss_sum")) {
    EXPECT_EQ(std::vector<float>(summed->data<float>(), summed->data<float>() + 3),
              std::vector<float>({0.25f, 0.5f, 0.75f}))
        << "a rider's sum over a group of one is its operand";
  }
  return (*ex)->adam_sweeps();
}

// The main job's four parameters (784-512-10) and sizes that are not multiples of the vector
// width or of the sweep's block.
const std::vector<Param> kModel = {
    {"w1", 784 * 512}, {"b1", 512}, {"w2", 5120}, {"b2", 10}, {"odd", kAdamWSweepBlock + 7},
    {"one", 1}};

TEST(AdamSweepTest, ConsecutiveUpdatesRunAsOneSweepWithEachUpdatesBits) {
  for (bool donate : {false, true}) {
    SCOPED_TRACE(donate ? "donated" : "kept");
    EXPECT_EQ(RunAndCheck(AdamProgram(kModel), kModel, donate), 1);
  }
}

TEST(AdamSweepTest, AnOpBetweenOrOtherHyperParametersSplitTheSweep) {
  EXPECT_EQ(RunAndCheck(AdamProgram(kModel, /*between=*/true), kModel, false), 1)
      << "the first update alone, then the other five as one sweep";
  std::vector<Param> two_rates = kModel;
  two_rates[2].learning_rate = 1e-2f;
  two_rates[3].learning_rate = 1e-2f;
  EXPECT_EQ(RunAndCheck(AdamProgram(two_rates), two_rates, false), 3) << "w1+b1, w2+b2 and odd+one";
}

// As in the main job's step on one worker: the first update sums its gradient over "data" (a
// group of one) with the loss and the second's gradient riding along (fn "sum:ss"); the second
// reduces nothing and reads that rider's sum. Both are one sweep.
TEST(AdamSweepTest, AnUpdateOverAGroupOfOneWithRidersJoinsTheSweep) {
  const std::vector<Param> params(kModel.begin(), kModel.begin() + 2);
  v1::StepProgram program = AdamProgram(params);
  Declare(&program, "loss", 3);
  Declare(&program, "loss_sum", 3);
  v1::Op* first = program.mutable_functions(0)->mutable_ops(0);
  first->add_axis_names("data");
  first->set_fn("sum:ss");
  first->add_inputs("loss");
  first->add_inputs("partial_b1");
  first->add_outputs("loss_sum");
  first->add_outputs("g_b1");
  Declare(&program, "partial_b1", 512);
  absl::StatusOr<Mesh> mesh = Mesh::Parse("data=1");
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  std::vector<std::unique_ptr<Transport>> transports = CreateInProcessTransports(1);
  Executor::Options options;
  options.mesh = &*mesh;
  options.transport = transports[0].get();
  EXPECT_EQ(RunAndCheck(program, params, false, "", options), 1);
}

// An update with no other to join (a model of one parameter, or one split off by another op)
// is a sweep of its own, shared out over the compute threads once it is large enough
// (kAdamWSweepParallelMin), with AdamWUpdate's bits: not counted as a joined sweep.
TEST(AdamSweepTest, ALoneUpdateLargeEnoughToShareOutHasAdamWUpdatesBits) {
  const std::vector<Param> params = {{"w", 2 * kAdamWSweepParallelMin + 13}};
  for (bool donate : {false, true}) {
    SCOPED_TRACE(donate ? "donated" : "kept");
    EXPECT_EQ(RunAndCheck(AdamProgram(params), params, donate), 0);
  }
}

TEST(AdamSweepTest, AnUpdateReadingAnEarlierUpdatesResultIsLeftAfterIt) {
  const std::vector<Param> params = {{"a", 3000}, {"b", 3000}};
  // b's gradient is a's new parameter: b must run after a, not beside it in a sweep.
  EXPECT_EQ(RunAndCheck(AdamProgram(params, false, {"g_a", "new_p_a"}), params, false, "b"), 0);
}

// The f32 step counter a request carries becomes the update's count only when it is one: NaN,
// a negative counter or one past int64 are refused by value (the coordinator's fuzz target
// found the cast of 7e22 undefined).
TEST(AdamSweepTest, AStepCounterThatIsNoCountIsRefusedByValue) {
  Tensor step(v1::DTYPE_F32, {});
  for (float good : {0.0f, 3.0f, 4.5f, 1e9f}) {
    step.data<float>()[0] = good;
    absl::StatusOr<int64_t> count = AdamWCount(step);
    ASSERT_TRUE(count.ok()) << good << ": " << count.status();
    EXPECT_EQ(*count, static_cast<int64_t>(good) + 1);
  }
  for (float bad : {std::nanf(""), -1.0f, 7.00624e+22f, std::numeric_limits<float>::infinity()}) {
    step.data<float>()[0] = bad;
    absl::StatusOr<int64_t> count = AdamWCount(step);
    ASSERT_FALSE(count.ok()) << bad;
    EXPECT_NE(std::string(count.status().message()).find("step counter is"), std::string::npos)
        << count.status();
  }
}

}  // namespace
}  // namespace meshrun
