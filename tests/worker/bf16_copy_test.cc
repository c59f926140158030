// The bf16 compute copies of master weights (Tensor::bf16_copy, Executor's Bf16Copy): an Adam
// update whose parameter the program converts to bf16 writes its new parameter in bf16 too, and
// the next step's convert reads that copy instead of converting again, with the same bits.
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/collectives/in_process_transport.h"
#include "core/collectives/reduce_kernels.h"
#include "gtest/gtest.h"
#include "tests/worker/two_ranks.h"
#include "worker/executor.h"

namespace meshrun {
namespace {

constexpr int64_t kN = 1000;  // not a multiple of any vector width

// w converted to bf16 (w16) and back (seen, which shows what the convert gave), then w's Adam
// update; over `axes` ("" for none: a local update). `second`: b, another parameter updated
// right after w (the two local updates then run as one sweep). Function 'other' only takes
// abs(gw).
v1::StepProgram Program(const std::string& axes, bool second = false) {
  std::string text;
  auto decl = [&](const std::string& name, const char* dtype, int64_t n) {
    text += absl::StrCat("buffers { name: '", name, "' dtype: ", dtype, " shape { ",
                         n < 0 ? "" : absl::StrCat("dims: ", n), " } }");
  };
  decl("step", "DTYPE_F32", -1);
  std::string ops;
  const std::string adamw = "adamw { learning_rate: 0.01 b1: 0.9 b2: 0.999 eps: 1e-8 }";
  for (const std::string p : {"w", "b"}) {
    if (p == "b" && !second) break;
    const int64_t n = p == "w" ? kN : 37;
    for (const std::string prefix : {"", "g", "mu", "nu", "new_", "new_mu", "new_nu", "seen_"})
      decl(prefix + p, "DTYPE_F32", n);
    decl(p + "16", "DTYPE_BF16", n);
    ops += absl::StrCat("ops { kind: OP_CONVERT inputs: '", p, "' outputs: '", p, "16' } ",
                        "ops { kind: OP_CONVERT inputs: '", p, "16' outputs: 'seen_", p, "' } ");
  }
  for (const std::string p : {"w", "b"}) {
    if (p == "b" && !second) break;
    ops += absl::StrCat("ops { kind: OP_ADAM_UPDATE inputs: '", p, "' inputs: 'g", p,
                        "' inputs: 'mu", p, "' inputs: 'nu", p, "' inputs: 'step' outputs: 'new_",
                        p, "' outputs: 'new_mu", p, "' outputs: 'new_nu", p, "' ", adamw,
                        axes.empty() ? "" : absl::StrCat(" axis_names: '", axes, "' fn: 'sum'"),
                        " } ");
  }
  decl("absg", "DTYPE_F32", kN);
  text += absl::StrCat("functions { name: 'main' ", ops, "} functions { name: 'other' ",
                       "ops { kind: OP_UNARY fn: 'abs' inputs: 'gw' outputs: 'absg' } }");
  return ParseText(text);
}

Tensor Filled(int64_t n, float scale, int seed) {
  Tensor t(v1::DTYPE_F32, {n});
  for (int64_t i = 0; i < n; ++i)
    t.data<float>()[i] = scale * static_cast<float>((i * 7919 + seed * 104729) % 2001 - 1000);
  return t;
}

std::vector<uint16_t> Rounded(const Tensor& t) {
  std::vector<uint16_t> r(t.num_elements());
  F32ToBf16(t.data<float>(), r.data(), t.num_elements());
  return r;
}

// Whether `t` carries a bf16 copy with F32ToBf16's bits of its values.
::testing::AssertionResult HasExactCopy(const Tensor& t) {
  if (t.bf16_copy() == nullptr) return ::testing::AssertionFailure() << "no bf16 copy";
  const Tensor& c = *t.bf16_copy();
  if (c.dtype() != v1::DTYPE_BF16 || c.dims() != t.dims())
    return ::testing::AssertionFailure() << "copy of " << DTypeName(c.dtype());
  const std::vector<uint16_t> want = Rounded(t);
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    if (c.data<uint16_t>()[i] != want[i])
      return ::testing::AssertionFailure() << "element " << i << " of the copy differs";
  }
  return ::testing::AssertionSuccess();
}

bool SameBits(const Tensor& a, const Tensor& b) {
  return a.size_bytes() == b.size_bytes() && std::memcmp(a.raw(), b.raw(), a.size_bytes()) == 0;
}

// One rank's training state, carried from step to step as a worker's shard store carries it.
struct State {
  std::map<std::string, Tensor> arrays;  // w, muw, nuw (and b's)
};

const char* const kParams[] = {"w", "b"};

// Binds `s` (donated, as a step's train state is) and the step's gradients, runs 'main' and
// takes the new state; returns seen_w. `strip`: the params lose their copies before binding.
Tensor Step(Executor& ex, State& s, int step, int rank, bool strip) {
  Tensor t(v1::DTYPE_F32, {});
  t.data<float>()[0] = static_cast<float>(step);
  EXPECT_TRUE(ex.BindInput("step", t).ok());
  for (const std::string p : kParams) {
    if (ex.buffer(p) == nullptr) continue;
    if (strip) s.arrays[p].set_bf16_copy(nullptr);
    const int64_t n = ex.buffer(p)->num_elements();
    EXPECT_TRUE(ex.BindInput("g" + p, Filled(n, 1e-3f * (rank + 1), step + 5)).ok());
    for (const std::string k : {"", "mu", "nu"})
      EXPECT_TRUE(ex.BindInput(k + p, std::move(s.arrays[k + p]), /*donated=*/true).ok());
  }
  s.arrays.clear();
  const absl::Status ran = ex.Run("main", RunContext{});
  EXPECT_TRUE(ran.ok()) << ran;
  for (const std::string p : kParams) {
    if (ex.buffer(p) == nullptr) continue;
    for (const std::string k : {"", "mu", "nu"}) s.arrays[k + p] = *ex.TakeOutput("new_" + k + p);
  }
  return *ex.TakeOutput("seen_w");
}

State Initial(const Executor& ex) {
  State s;
  for (const std::string p : kParams) {
    Tensor* b = const_cast<Executor&>(ex).buffer(p);
    if (b == nullptr) continue;
    s.arrays[p] = Filled(b->num_elements(), 1e-3f, 1);
    s.arrays["mu" + p] = Tensor(v1::DTYPE_F32, b->dims());
    s.arrays["nu" + p] = Tensor(v1::DTYPE_F32, b->dims());
  }
  return s;
}

Executor::Options LocalOptions() {
  Executor::Options o;
  o.results = {"new_w", "new_muw", "new_nuw", "seen_w", "new_b", "new_mub", "new_nub"};
  return o;
}

// Three steps: each new param carries its exact copy, the convert of the next step gives the
// conversion's bits, and the whole run is bit for bit the run whose params carry no copies. With
// one update alone (AdamWSweep of one segment) and two joined into one sweep.
TEST(Bf16CopyTest, LocalUpdatesWriteExactCopiesAndTheNextStepMatchesARunWithout) {
  for (const bool second : {false, true}) {
    SCOPED_TRACE(second ? "two updates, one sweep" : "one update");
    const v1::StepProgram program = Program("", second);
    auto with = Executor::Create(program, LocalOptions());
    auto without = Executor::Create(program, LocalOptions());
    ASSERT_TRUE(with.ok()) << with.status();
    ASSERT_TRUE(without.ok()) << without.status();
    State a = Initial(**with), b = Initial(**without);
    for (int step = 0; step < 3; ++step) {
      const Tensor w = a.arrays["w"];  // (a copy: the step consumes a's)
      const Tensor seen_a = Step(**with, a, step, 0, /*strip=*/false);
      const Tensor seen_b = Step(**without, b, step, 0, /*strip=*/true);
      std::vector<uint16_t> want = Rounded(w);
      for (int64_t i = 0; i < kN; ++i)
        ASSERT_EQ(seen_a.data<float>()[i], Bf16ToF32(want[i])) << "step " << step << " " << i;
      EXPECT_TRUE(SameBits(seen_a, seen_b)) << "step " << step;
      for (const std::string p : {"w", "muw", "nuw"})
        EXPECT_TRUE(SameBits(a.arrays[p], b.arrays[p])) << p << " at step " << step;
      EXPECT_TRUE(HasExactCopy(a.arrays["w"])) << "step " << step;
      if (second) {
        EXPECT_TRUE(HasExactCopy(a.arrays["b"])) << "step " << step;
      }
      EXPECT_EQ(a.arrays["muw"].bf16_copy(), nullptr) << "only the param is converted";
      // The donated param's memory now holds the new one: its buffer dropped the copy.
      EXPECT_EQ((*with)->buffer("w")->bf16_copy(), nullptr);
    }
    if (second) {
      EXPECT_EQ((*with)->adam_sweeps(), 1);
    }
  }
}

// The convert reads the copy rather than converting: a param carrying another array's copy
// (against Tensor::set_bf16_copy's contract, to see which one is read) shows that copy, and the
// same values without one show their own conversion.
TEST(Bf16CopyTest, TheConvertReadsTheCopyWhenThereIsOne) {
  auto ex = Executor::Create(Program(""), LocalOptions());
  ASSERT_TRUE(ex.ok()) << ex.status();
  State s = Initial(**ex);
  const Tensor w = s.arrays["w"];
  Tensor other = Filled(kN, 0.5f, 9);
  auto copy = std::make_shared<Tensor>(v1::DTYPE_BF16, Dims{kN});
  F32ToBf16(other.data<float>(), copy->data<uint16_t>(), kN);
  s.arrays["w"].set_bf16_copy(copy);
  Tensor seen = Step(**ex, s, 0, 0, /*strip=*/false);
  for (int64_t i = 0; i < kN; ++i)
    ASSERT_EQ(seen.data<float>()[i], Bf16ToF32(copy->data<uint16_t>()[i])) << i;
  s.arrays["w"] = w;  // no copy
  seen = Step(**ex, s, 1, 0, /*strip=*/false);
  const std::vector<uint16_t> want = Rounded(w);
  for (int64_t i = 0; i < kN; ++i) ASSERT_EQ(seen.data<float>()[i], Bf16ToF32(want[i])) << i;
}

// A copy is handed out only with the values the last run's update wrote: after a run of a
// function without the update, the param output has none. A convert whose bf16 result is
// handed out reads no copy, so no update writes one.
TEST(Bf16CopyTest, NoCopyWithoutTheUpdateOrWhenTheConvertedArrayIsAResult) {
  auto ex = Executor::Create(Program(""), LocalOptions());
  ASSERT_TRUE(ex.ok()) << ex.status();
  State s = Initial(**ex);
  Step(**ex, s, 0, 0, false);
  EXPECT_TRUE(HasExactCopy(s.arrays["w"]));
  ASSERT_TRUE((*ex)->Run("other", RunContext{}).ok());
  absl::StatusOr<Tensor> after = (*ex)->TakeOutput("new_w");
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->bf16_copy(), nullptr);

  Executor::Options o = LocalOptions();
  o.results.push_back("w16");
  auto handed = Executor::Create(Program(""), o);
  ASSERT_TRUE(handed.ok()) << handed.status();
  State t = Initial(**handed);
  Step(**handed, t, 0, 0, false);
  EXPECT_EQ(t.arrays["w"].bf16_copy(), nullptr);
}

// Two ranks updating over 'data', each the owner of one segment: every rank's copy holds every
// element (the other's segment written by its owner), on the single-copy path and the ring, and
// the second step's convert gives the conversion's bits.
TEST(Bf16CopyTest, FusedUpdatesWriteEveryMembersWholeCopy) {
  for (const size_t direct_min_bytes : {size_t{64}, size_t{0}}) {
    SCOPED_TRACE(direct_min_bytes ? "single-copy" : "ring");
    const Mesh mesh = *Mesh::Parse("data=2");
    std::vector<std::unique_ptr<Transport>> transports = CreateInProcessTransports(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        Executor::Options o = LocalOptions();
        o.mesh = &mesh;
        o.rank = r;
        o.transport = transports[r].get();
        o.collectives.direct_min_bytes = direct_min_bytes;
        auto ex = Executor::Create(Program("data"), o);
        ASSERT_TRUE(ex.ok()) << ex.status();
        State s = Initial(**ex);
        for (int step = 0; step < 3; ++step) {
          const Tensor w = s.arrays["w"];
          const Tensor seen = Step(**ex, s, step, r, false);
          const std::vector<uint16_t> want = Rounded(w);
          for (int64_t i = 0; i < kN; ++i) {
            ASSERT_EQ(seen.data<float>()[i], Bf16ToF32(want[i]))
                << "rank " << r << " step " << step << " element " << i;
          }
          EXPECT_TRUE(HasExactCopy(s.arrays["w"])) << "rank " << r << " step " << step;
        }
      });
    }
    for (std::thread& t : threads) t.join();
  }
}

// A stacked param (4 layers of kRow elements, as nn.scan stacks a layer's weights) whose layer 2
// is sliced out and reshaped, then converted (as an indexed, scanned layer casts its weight);
// and its column block [0, 100) of every layer, which is not contiguous, converted too. Then
// the stacked param's Adam update.
constexpr int64_t kLayers = 4, kRow = 250;

v1::StepProgram StackedProgram() {
  std::string text;
  auto decl = [&](const std::string& name, const char* dtype, const std::string& dims) {
    text += absl::StrCat("buffers { name: '", name, "' dtype: ", dtype, " shape { ", dims, " } }");
  };
  const std::string stacked = absl::StrCat("dims: ", kLayers, " dims: ", kRow);
  decl("step", "DTYPE_F32", "");
  for (const std::string name : {"w", "gw", "muw", "nuw", "new_w", "new_muw", "new_nuw"})
    decl(name, "DTYPE_F32", stacked);
  decl("layer", "DTYPE_F32", absl::StrCat("dims: 1 dims: ", kRow));
  decl("kernel", "DTYPE_F32", absl::StrCat("dims: ", kRow));
  decl("kernel16", "DTYPE_BF16", absl::StrCat("dims: ", kRow));
  decl("seen_w", "DTYPE_F32", absl::StrCat("dims: ", kRow));
  decl("cols", "DTYPE_F32", absl::StrCat("dims: ", kLayers, " dims: 100"));
  decl("cols16", "DTYPE_BF16", absl::StrCat("dims: ", kLayers, " dims: 100"));
  text += R"pb(
    functions {
      name: "main"
      ops { kind: OP_SLICE inputs: "w" outputs: "layer" starts: 2 starts: 0 }
      ops { kind: OP_RESHAPE inputs: "layer" outputs: "kernel" }
      ops { kind: OP_CONVERT inputs: "kernel" outputs: "kernel16" }
      ops { kind: OP_CONVERT inputs: "kernel16" outputs: "seen_w" }
      ops { kind: OP_SLICE inputs: "w" outputs: "cols" starts: 0 starts: 0 }
      ops { kind: OP_CONVERT inputs: "cols" outputs: "cols16" }
      ops {
        kind: OP_ADAM_UPDATE
        inputs: "w"
        inputs: "gw"
        inputs: "muw"
        inputs: "nuw"
        inputs: "step"
        outputs: "new_w"
        outputs: "new_muw"
        outputs: "new_nuw"
        adamw { learning_rate: 0.01 b1: 0.9 b2: 0.999 eps: 1e-8 }
      }
    })pb";
  return ParseText(text);
}

Tensor Stacked(float scale, int seed) {
  const Tensor flat = Filled(kLayers * kRow, scale, seed);
  Tensor t(v1::DTYPE_F32, {kLayers, kRow});
  std::memcpy(t.raw(), flat.raw(), flat.size_bytes());
  return t;
}

// Runs one step of StackedProgram over `s`; returns seen_w and, through `cols`, cols16.
Tensor StackedStep(Executor& ex, State& s, int step, Tensor* cols) {
  Tensor t(v1::DTYPE_F32, {});
  t.data<float>()[0] = static_cast<float>(step);
  EXPECT_TRUE(ex.BindInput("step", t).ok());
  EXPECT_TRUE(ex.BindInput("gw", Stacked(1e-3f, step + 5)).ok());
  for (const std::string k : {"w", "muw", "nuw"})
    EXPECT_TRUE(ex.BindInput(k, std::move(s.arrays[k]), /*donated=*/true).ok());
  s.arrays.clear();
  const absl::Status ran = ex.Run("main", RunContext{});
  EXPECT_TRUE(ran.ok()) << ran;
  for (const std::string k : {"w", "muw", "nuw"}) s.arrays[k] = *ex.TakeOutput("new_" + k);
  *cols = *ex.TakeOutput("cols16");
  return *ex.TakeOutput("seen_w");
}

// The convert of the sliced layer reads that layer's block of the stacked param's copy: with
// another array's copy attached (to see which one is read) it shows the copy's layer 2; over
// three steps of real copies every array has the bits of a run without copies; the columns,
// not a contiguous block, are converted from the param each time.
TEST(Bf16CopyTest, AConvertOfASlicedLayerReadsThatLayersBlockOfTheCopy) {
  Executor::Options o;
  o.results = {"new_w", "new_muw", "new_nuw", "seen_w", "cols16"};
  auto with = Executor::Create(StackedProgram(), o);
  auto without = Executor::Create(StackedProgram(), o);
  ASSERT_TRUE(with.ok()) << with.status();
  ASSERT_TRUE(without.ok()) << without.status();
  auto initial = [] {
    State s;
    s.arrays["w"] = Stacked(1e-3f, 1);
    s.arrays["muw"] = Tensor(v1::DTYPE_F32, {kLayers, kRow});
    s.arrays["nuw"] = Tensor(v1::DTYPE_F32, {kLayers, kRow});
    return s;
  };
  State a = initial(), b = initial();
  Tensor cols_a, cols_b;
  {
    State fake = initial();
    const Tensor other = Stacked(0.5f, 9);
    auto copy = std::make_shared<Tensor>(v1::DTYPE_BF16, Dims{kLayers, kRow});
    F32ToBf16(other.data<float>(), copy->data<uint16_t>(), kLayers * kRow);
    fake.arrays["w"].set_bf16_copy(copy);
    const Tensor seen = StackedStep(**with, fake, 0, &cols_a);
    for (int64_t i = 0; i < kRow; ++i) {
      ASSERT_EQ(seen.data<float>()[i], Bf16ToF32(copy->data<uint16_t>()[2 * kRow + i])) << i;
    }
    const std::vector<uint16_t> want = Rounded(initial().arrays["w"]);
    for (int64_t l = 0; l < kLayers; ++l) {
      for (int64_t c = 0; c < 100; ++c) {
        ASSERT_EQ(cols_a.data<uint16_t>()[l * 100 + c], want[l * kRow + c]) << l << ", " << c;
      }
    }
  }
  for (int step = 0; step < 3; ++step) {
    const Tensor w = a.arrays["w"];
    const Tensor seen_a = StackedStep(**with, a, step, &cols_a);
    b.arrays["w"].set_bf16_copy(nullptr);
    const Tensor seen_b = StackedStep(**without, b, step, &cols_b);
    const std::vector<uint16_t> want = Rounded(w);
    for (int64_t i = 0; i < kRow; ++i)
      ASSERT_EQ(seen_a.data<float>()[i], Bf16ToF32(want[2 * kRow + i])) << "step " << step;
    EXPECT_TRUE(SameBits(seen_a, seen_b)) << "step " << step;
    EXPECT_TRUE(SameBits(cols_a, cols_b)) << "step " << step;
    for (const std::string k : {"w", "muw", "nuw"})
      EXPECT_TRUE(SameBits(a.arrays[k], b.arrays[k])) << k << " at step " << step;
    EXPECT_TRUE(HasExactCopy(a.arrays["w"])) << "step " << step;
  }
}

}  // namespace
}  // namespace meshrun
