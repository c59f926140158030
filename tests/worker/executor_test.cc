// Executor arguments and results without copies: a read-only input aliases the caller's array, an
// input the program writes is copied (the caller's array is never modified), and a taken output
// keeps its values when the executor runs again.
#include "worker/executor.h"

#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/array_ops.h"
#include "core/collectives/in_process_transport.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"

namespace meshrun {
namespace {

using ::testing::ElementsAre;
using ::testing::FloatNear;
using ::testing::HasSubstr;

// y = x @ w; acc += x @ w (a GEMM with beta 1 writes acc, so acc is not read-only).
constexpr char kProgram[] = R"pb(
  buffers {
    name: "x"
    dtype: DTYPE_F32
    shape { dims: 2 dims: 3 }
  }
  buffers {
    name: "w"
    dtype: DTYPE_F32
    shape { dims: 3 dims: 2 }
  }
  buffers {
    name: "y"
    dtype: DTYPE_F32
    shape { dims: 2 dims: 2 }
  }
  buffers {
    name: "acc"
    dtype: DTYPE_F32
    shape { dims: 2 dims: 2 }
  }
  functions {
    name: "main"
    ops { kind: OP_MATMUL inputs: "x" inputs: "w" outputs: "y" }
    ops { kind: OP_MATMUL inputs: "x" inputs: "w" outputs: "acc" accumulate: true }
  }
)pb";

Tensor Matrix(int64_t rows, int64_t cols, std::vector<float> values) {
  Tensor t(v1::DTYPE_F32, {rows, cols});
  std::copy(values.begin(), values.end(), t.data<float>());
  return t;
}

std::vector<float> Values(const Tensor& t) {
  return {t.data<float>(), t.data<float>() + t.num_elements()};
}

std::unique_ptr<Executor> Compile() {
  v1::StepProgram program;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(kProgram, &program));
  absl::StatusOr<std::unique_ptr<Executor>> ex = Executor::Create(program, Executor::Options{});
  EXPECT_TRUE(ex.ok()) << ex.status();
  return ex.ok() ? *std::move(ex) : nullptr;
}

TEST(ExecutorBindingTest, ReadOnlyInputsAliasWrittenInputsAreCopiedOutputsSurviveTheNextRun) {
  std::unique_ptr<Executor> ex = Compile();
  ASSERT_NE(ex, nullptr);
  const Tensor x1 = Matrix(2, 3, {1, 2, 3, 4, 5, 6});
  const Tensor w = Matrix(3, 2, {1, 0, 0, 1, 1, 1});
  const Tensor acc = Matrix(2, 2, {100, 200, 300, 400});
  ASSERT_TRUE(ex->BindInput("x", x1).ok());
  ASSERT_TRUE(ex->BindInput("w", w).ok());
  ASSERT_TRUE(ex->BindInput("acc", acc).ok());
  EXPECT_EQ(ex->buffer("x")->raw(), x1.raw()) << "a read-only input is not copied";
  EXPECT_NE(ex->buffer("acc")->raw(), acc.raw()) << "an input the program writes is copied";

  ASSERT_TRUE(ex->Run("main", RunContext{}).ok());
  absl::StatusOr<Tensor> y1 = ex->TakeOutput("y");
  absl::StatusOr<Tensor> acc1 = ex->TakeOutput("acc");
  ASSERT_TRUE(y1.ok() && acc1.ok());
  EXPECT_EQ(y1->raw(), ex->buffer("y")->raw()) << "a result is handed out without a copy";
  EXPECT_THAT(Values(*y1), ElementsAre(4, 5, 10, 11));
  EXPECT_THAT(Values(*acc1), ElementsAre(104, 205, 310, 411));
  EXPECT_THAT(Values(acc), ElementsAre(100, 200, 300, 400))
      << "the caller's array is never written";

  const Tensor x2 = Matrix(2, 3, {0, 0, 1, 0, 0, 2});
  ASSERT_TRUE(ex->BindInput("x", x2).ok());
  ASSERT_TRUE(ex->BindInput("acc", *acc1).ok());
  ASSERT_TRUE(ex->Run("main", RunContext{}).ok());
  absl::StatusOr<Tensor> y2 = ex->TakeOutput("y");
  absl::StatusOr<Tensor> acc2 = ex->TakeOutput("acc");
  ASSERT_TRUE(y2.ok() && acc2.ok());
  EXPECT_THAT(Values(*y2), ElementsAre(1, 1, 2, 2));
  EXPECT_THAT(Values(*acc2), ElementsAre(105, 206, 312, 413));
  EXPECT_THAT(Values(*y1), ElementsAre(4, 5, 10, 11)) << "the first run's result kept its values";
  EXPECT_THAT(Values(*acc1), ElementsAre(104, 205, 310, 411));
  EXPECT_THAT(Values(x1), ElementsAre(1, 2, 3, 4, 5, 6));
}

TEST(ExecutorBindingTest, AnInputNeverBoundReadsAsZerosAndOneWrittenThroughBufferKeepsItsValues) {
  // The executor leaves an input's own memory unwritten until it is used unbound: w here is
  // written through buffer(), x never bound (it must read as zeros, not as whatever the
  // allocator handed back: memory of the same size is dirtied and freed first), then both bound.
  for (int round = 0; round < 2; ++round) {
    std::vector<void*> dirty;
    for (int i = 0; i < 16; ++i) {
      dirty.push_back(std::aligned_alloc(64, 64));
      std::memset(dirty.back(), 0x41, 64);  // 12.06 as floats
    }
    for (void* p : dirty) std::free(p);
    std::unique_ptr<Executor> ex = Compile();
    ASSERT_NE(ex, nullptr);
    if (round == 0) {
      ASSERT_TRUE(ex->Run("main", RunContext{}).ok());
      EXPECT_THAT(Values(*ex->buffer("y")), ElementsAre(0, 0, 0, 0)) << "x and w read as zeros";
      continue;
    }
    Tensor* w = ex->buffer("w");
    ASSERT_NE(w, nullptr);
    EXPECT_THAT(Values(*w), ElementsAre(0, 0, 0, 0, 0, 0));
    std::fill_n(w->data<float>(), 6, 1.0f);
    ASSERT_TRUE(ex->Run("main", RunContext{}).ok());
    EXPECT_THAT(Values(*ex->buffer("y")), ElementsAre(0, 0, 0, 0)) << "x reads as zeros";
    ASSERT_TRUE(ex->BindInput("x", Matrix(2, 3, {1, 2, 3, 4, 5, 6})).ok());
    ASSERT_TRUE(ex->Run("main", RunContext{}).ok());
    EXPECT_THAT(Values(*ex->buffer("y")), ElementsAre(6, 6, 15, 15)) << "w kept what was written";
  }
}

TEST(ExecutorBindingTest, AnArgumentOfAnotherShapeOrAnUnknownBufferIsRefused) {
  std::unique_ptr<Executor> ex = Compile();
  ASSERT_NE(ex, nullptr);
  absl::Status s = ex->BindInput("x", Matrix(3, 2, {1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("input 'x' is f32[3, 2] but the program expects f32[2, 3]"));
  EXPECT_THAT(ex->BindInput("z", Matrix(2, 3, {})).message(), HasSubstr("no input buffer 'z'"));
  EXPECT_THAT(ex->TakeOutput("z").status().message(), HasSubstr("no output buffer 'z'"));
}

// layer = stacked[i] (a dynamic slice, as a scan over stacked layers reads its parameters), then a
// reshape and a matmul; `before` reshapes `a` before an op adds `b` into `a` (eye @ b + a).
constexpr char kViewProgram[] = R"pb(
  buffers {
    name: "stacked"
    dtype: DTYPE_F32
    shape { dims: 4 dims: 2 dims: 3 }
  }
  buffers {
    name: "i"
    dtype: DTYPE_I32
    shape {}
  }
  buffers {
    name: "layer"
    dtype: DTYPE_F32
    shape { dims: 1 dims: 2 dims: 3 }
  }
  buffers {
    name: "kernel"
    dtype: DTYPE_F32
    shape { dims: 2 dims: 3 }
  }
  buffers {
    name: "x"
    dtype: DTYPE_F32
    shape { dims: 1 dims: 2 }
  }
  buffers {
    name: "y"
    dtype: DTYPE_F32
    shape { dims: 1 dims: 3 }
  }
  buffers {
    name: "a"
    dtype: DTYPE_F32
    shape { dims: 2 dims: 3 }
  }
  buffers {
    name: "b"
    dtype: DTYPE_F32
    shape { dims: 2 dims: 3 }
  }
  buffers {
    name: "before"
    dtype: DTYPE_F32
    shape { dims: 6 }
  }
  buffers {
    name: "eye"
    dtype: DTYPE_F32
    shape { dims: 2 dims: 2 }
  }
  functions {
    name: "main"
    ops { kind: OP_DYNAMIC_SLICE inputs: "stacked" inputs: "i" outputs: "layer" dim: 0 }
    ops { kind: OP_RESHAPE inputs: "layer" outputs: "kernel" }
    ops { kind: OP_MATMUL inputs: "x" inputs: "kernel" outputs: "y" }
    ops { kind: OP_RESHAPE inputs: "a" outputs: "before" }
    ops { kind: OP_MATMUL inputs: "eye" inputs: "b" outputs: "a" accumulate: true }
  }
)pb";

TEST(ExecutorBindingTest, SlicesAndReshapesAreViewsUnlessTheirInputIsWrittenLater) {
  v1::StepProgram program;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(kViewProgram, &program));
  absl::StatusOr<std::unique_ptr<Executor>> ex = Executor::Create(program, Executor::Options{});
  ASSERT_TRUE(ex.ok()) << ex.status();
  Tensor stacked(v1::DTYPE_F32, {4, 2, 3});
  for (int64_t k = 0; k < stacked.num_elements(); ++k)
    stacked.data<float>()[k] = static_cast<float>(k);
  Tensor i(v1::DTYPE_I32, {});
  i.data<int32_t>()[0] = 2;
  ASSERT_TRUE((*ex)->BindInput("stacked", stacked).ok());
  ASSERT_TRUE((*ex)->BindInput("i", i).ok());
  ASSERT_TRUE((*ex)->BindInput("x", Matrix(1, 2, {1, 10})).ok());
  ASSERT_TRUE((*ex)->BindInput("a", Matrix(2, 3, {1, 2, 3, 4, 5, 6})).ok());
  ASSERT_TRUE((*ex)->BindInput("b", Matrix(2, 3, {1, 1, 1, 1, 1, 1})).ok());
  ASSERT_TRUE((*ex)->BindInput("eye", Matrix(2, 2, {1, 0, 0, 1})).ok());
  ASSERT_TRUE((*ex)->Run("main", RunContext{}).ok());

  // stacked[2] is elements 12..17: [[12, 13, 14], [15, 16, 17]]; x @ it = [162, 173, 184].
  EXPECT_EQ((*ex)->buffer("kernel")->raw(), stacked.data<float>() + 12)
      << "slice and reshape without copies";
  EXPECT_THAT(Values(*(*ex)->TakeOutput("y")), ElementsAre(162, 173, 184));
  EXPECT_NE((*ex)->buffer("before")->raw(), (*ex)->buffer("a")->raw())
      << "a is written after the reshape";
  EXPECT_THAT(Values(*(*ex)->TakeOutput("before")), ElementsAre(1, 2, 3, 4, 5, 6));
  EXPECT_THAT(Values(*(*ex)->TakeOutput("a")), ElementsAre(2, 3, 4, 5, 6, 7));

  Tensor past_the_end(v1::DTYPE_I32, {});
  past_the_end.data<int32_t>()[0] = 4;
  ASSERT_TRUE((*ex)->BindInput("i", past_the_end).ok());
  absl::Status s = (*ex)->Run("main", RunContext{});
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(s.message(), HasSubstr("dynamic_slice start block 4 of size 1 is outside dim 0 (4)"));
}

// One Adam update (optax.adam, lr 0.1) of a 2-element parameter; `seen` reads mu after it.
constexpr char kAdamProgram[] = R"pb(
  buffers {
    name: "p"
    dtype: DTYPE_F32
    shape { dims: 2 }
  }
  buffers {
    name: "g"
    dtype: DTYPE_F32
    shape { dims: 2 }
  }
  buffers {
    name: "mu"
    dtype: DTYPE_F32
    shape { dims: 2 }
  }
  buffers {
    name: "nu"
    dtype: DTYPE_F32
    shape { dims: 2 }
  }
  buffers {
    name: "step"
    dtype: DTYPE_F32
    shape {}
  }
  buffers {
    name: "p2"
    dtype: DTYPE_F32
    shape { dims: 2 }
  }
  buffers {
    name: "mu2"
    dtype: DTYPE_F32
    shape { dims: 2 }
  }
  buffers {
    name: "nu2"
    dtype: DTYPE_F32
    shape { dims: 2 }
  }
  buffers {
    name: "seen"
    dtype: DTYPE_F32
    shape { dims: 2 }
  }
  functions {
    name: "main"
    ops {
      kind: OP_ADAM_UPDATE
      inputs: "p"
      inputs: "g"
      inputs: "mu"
      inputs: "nu"
      inputs: "step"
      outputs: "p2"
      outputs: "mu2"
      outputs: "nu2"
      adamw { learning_rate: 0.1 b1: 0.9 b2: 0.999 eps: 1e-8 }
    }
    ops { kind: OP_UNARY fn: "abs" inputs: "mu" outputs: "seen" }
  }
)pb";

TEST(ExecutorBindingTest, AdamWritesOverDonatedInputsThatNoLaterOpReads) {
  v1::StepProgram program;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(kAdamProgram, &program));
  for (const bool donate : {false, true}) {
    SCOPED_TRACE(donate ? "donated" : "not donated");
    absl::StatusOr<std::unique_ptr<Executor>> ex = Executor::Create(program, Executor::Options{});
    ASSERT_TRUE(ex.ok()) << ex.status();
    Tensor p(v1::DTYPE_F32, {2}), g(v1::DTYPE_F32, {2}), mu(v1::DTYPE_F32, {2}),
        nu(v1::DTYPE_F32, {2});
    p.data<float>()[0] = 1.0f;
    p.data<float>()[1] = -2.0f;
    g.data<float>()[0] = 0.5f;
    g.data<float>()[1] = 0.25f;
    ASSERT_TRUE((*ex)->BindInput("p", p, donate).ok());
    ASSERT_TRUE((*ex)->BindInput("g", g, donate).ok());
    ASSERT_TRUE((*ex)->BindInput("mu", mu, donate).ok());
    ASSERT_TRUE((*ex)->BindInput("nu", nu, donate).ok());
    ASSERT_TRUE((*ex)->BindInput("step", Tensor(v1::DTYPE_F32, {})).ok());
    ASSERT_TRUE((*ex)->Run("main", RunContext{}).ok());
    // optax.adam's first step moves each parameter by lr against the gradient's sign.
    EXPECT_THAT(Values(*(*ex)->TakeOutput("p2")),
                ElementsAre(::testing::FloatNear(0.9f, 1e-6f), ::testing::FloatNear(-2.1f, 1e-6f)));
    EXPECT_THAT(
        Values(*(*ex)->TakeOutput("mu2")),
        ElementsAre(::testing::FloatNear(0.05f, 1e-7f), ::testing::FloatNear(0.025f, 1e-7f)));
    EXPECT_THAT(Values(*(*ex)->TakeOutput("seen")), ElementsAre(0, 0))
        << "mu read after the update";
    EXPECT_EQ((*ex)->buffer("p2")->raw() == p.raw(), donate)
        << "param updated in place only when donated";
    EXPECT_EQ((*ex)->buffer("nu2")->raw() == nu.raw(), donate);
    EXPECT_NE((*ex)->buffer("mu2")->raw(), mu.raw()) << "a later op reads mu: never in place";
    EXPECT_THAT(Values(mu), ElementsAre(0, 0));
    if (!donate) {
      EXPECT_THAT(Values(p), ElementsAre(1, -2)) << "a kept argument is never written";
    }
  }
}

// A scan's view of its stacked parameter: `layer` (a dynamic slice of p, then a reshape) feeds a
// matmul before the Adam update of p; `late`, if present, reads the view after it.
std::string ScanAdamProgram(bool view_read_after_update) {
  std::string text = R"pb(
    buffers {
      name: "p"
      dtype: DTYPE_F32
      shape { dims: 2 dims: 1 dims: 2 }
    }
    buffers {
      name: "g"
      dtype: DTYPE_F32
      shape { dims: 2 dims: 1 dims: 2 }
    }
    buffers {
      name: "mu"
      dtype: DTYPE_F32
      shape { dims: 2 dims: 1 dims: 2 }
    }
    buffers {
      name: "nu"
      dtype: DTYPE_F32
      shape { dims: 2 dims: 1 dims: 2 }
    }
    buffers {
      name: "step"
      dtype: DTYPE_F32
      shape {}
    }
    buffers {
      name: "i"
      dtype: DTYPE_I32
      shape {}
    }
    buffers {
      name: "layer"
      dtype: DTYPE_F32
      shape { dims: 1 dims: 1 dims: 2 }
    }
    buffers {
      name: "kernel"
      dtype: DTYPE_F32
      shape { dims: 1 dims: 2 }
    }
    buffers {
      name: "x"
      dtype: DTYPE_F32
      shape { dims: 1 dims: 1 }
    }
    buffers {
      name: "y"
      dtype: DTYPE_F32
      shape { dims: 1 dims: 2 }
    }
    buffers {
      name: "late"
      dtype: DTYPE_F32
      shape { dims: 1 dims: 2 }
    }
    buffers {
      name: "p2"
      dtype: DTYPE_F32
      shape { dims: 2 dims: 1 dims: 2 }
    }
    buffers {
      name: "mu2"
      dtype: DTYPE_F32
      shape { dims: 2 dims: 1 dims: 2 }
    }
    buffers {
      name: "nu2"
      dtype: DTYPE_F32
      shape { dims: 2 dims: 1 dims: 2 }
    }
    functions { name: "main"
                ops { kind: OP_DYNAMIC_SLICE inputs: "p" inputs: "i" outputs: "layer" dim: 0 }
                ops { kind: OP_RESHAPE inputs: "layer" outputs: "kernel" }
                ops { kind: OP_MATMUL inputs: "x" inputs: "kernel" outputs: "y" }
                ops {
                  kind: OP_ADAM_UPDATE
                  inputs: "p"
                  inputs: "g"
                  inputs: "mu"
                  inputs: "nu"
                  inputs: "step"
                  outputs: "p2"
                  outputs: "mu2"
                  outputs: "nu2"
                  adamw { learning_rate: 0.1 b1: 0.9 b2: 0.999 eps: 1e-8 }
                }
  )pb";
  if (view_read_after_update)
    text += R"pb(ops { kind: OP_UNARY fn: "abs" inputs: "kernel" outputs: "late" })pb";
  return text + "}";
}

TEST(ExecutorBindingTest, AdamWritesOverADonatedStackedParamOnceItsViewsAreRead) {
  struct Case {
    const char* name;
    bool late_reader;
    std::vector<std::string> results;
    bool in_place;
  };
  for (const Case& c : {Case{"views read before the update", false, {"y", "p2"}, true},
                        Case{"a view read after the update", true, {"late", "p2"}, false},
                        Case{"a view is a result", false, {"kernel", "p2"}, false}}) {
    SCOPED_TRACE(c.name);
    v1::StepProgram program;
    ASSERT_TRUE(
        google::protobuf::TextFormat::ParseFromString(ScanAdamProgram(c.late_reader), &program));
    Executor::Options o;
    o.results = c.results;
    absl::StatusOr<std::unique_ptr<Executor>> ex = Executor::Create(program, o);
    ASSERT_TRUE(ex.ok()) << ex.status();
    Tensor p(v1::DTYPE_F32, {2, 1, 2}), g(v1::DTYPE_F32, {2, 1, 2});
    for (int k = 0; k < 4; ++k) {
      p.data<float>()[k] = static_cast<float>(k + 1);  // layer 1 is [3, 4]
      g.data<float>()[k] = 1.0f;
    }
    Tensor i(v1::DTYPE_I32, {});
    i.data<int32_t>()[0] = 1;
    ASSERT_TRUE((*ex)->BindInput("p", p, /*donated=*/true).ok());
    ASSERT_TRUE((*ex)->BindInput("g", g).ok());
    ASSERT_TRUE((*ex)->BindInput("mu", Tensor(v1::DTYPE_F32, {2, 1, 2}), true).ok());
    ASSERT_TRUE((*ex)->BindInput("nu", Tensor(v1::DTYPE_F32, {2, 1, 2}), true).ok());
    ASSERT_TRUE((*ex)->BindInput("step", Tensor(v1::DTYPE_F32, {})).ok());
    ASSERT_TRUE((*ex)->BindInput("i", i).ok());
    ASSERT_TRUE((*ex)->BindInput("x", Matrix(1, 1, {2})).ok());
    ASSERT_TRUE((*ex)->Run("main", RunContext{}).ok());
    EXPECT_EQ((*ex)->buffer("p2")->raw() == p.raw(), c.in_place);
    // The matmul saw the old layer whichever way: 2 * [3, 4]; optax.adam's first step: p - 0.1.
    EXPECT_THAT(Values(*(*ex)->TakeOutput("y")), ElementsAre(6, 8));
    EXPECT_THAT(Values(*(*ex)->TakeOutput("p2")),
                ElementsAre(FloatNear(0.9f, 1e-6f), FloatNear(1.9f, 1e-6f), FloatNear(2.9f, 1e-6f),
                            FloatNear(3.9f, 1e-6f)));
    if (c.late_reader) {
      EXPECT_THAT(Values(*(*ex)->TakeOutput("late")), ElementsAre(3, 4))
          << "the view read after it";
    }
    if (!c.in_place) {
      EXPECT_THAT(Values(*(*ex)->TakeOutput("kernel")), ElementsAre(3, 4))
          << "the view keeps the old values";
    }
  }
}

// out = concatenate([|a0|, reshape(|a1|)]) along dim 0, as a scan stacks its per-layer
// gradients; side = concatenate([a0t, a0t]) along dim 1, whose parts are not contiguous in it.
constexpr char kConcatProgram[] = R"pb(
  buffers {
    name: "a0"
    dtype: DTYPE_F32
    shape { dims: 1 dims: 3 }
  }
  buffers {
    name: "a1"
    dtype: DTYPE_F32
    shape { dims: 3 }
  }
  buffers {
    name: "p0"
    dtype: DTYPE_F32
    shape { dims: 1 dims: 3 }
  }
  buffers {
    name: "p1flat"
    dtype: DTYPE_F32
    shape { dims: 3 }
  }
  buffers {
    name: "p1"
    dtype: DTYPE_F32
    shape { dims: 1 dims: 3 }
  }
  buffers {
    name: "out"
    dtype: DTYPE_F32
    shape { dims: 2 dims: 3 }
  }
  buffers {
    name: "a0t"
    dtype: DTYPE_F32
    shape { dims: 3 dims: 1 }
  }
  buffers {
    name: "side"
    dtype: DTYPE_F32
    shape { dims: 3 dims: 2 }
  }
  functions {
    name: "main"
    ops { kind: OP_UNARY fn: "abs" inputs: "a0" outputs: "p0" }
    ops { kind: OP_UNARY fn: "abs" inputs: "a1" outputs: "p1flat" }
    ops { kind: OP_RESHAPE inputs: "p1flat" outputs: "p1" }
    ops { kind: OP_CONCATENATE inputs: "p0" inputs: "p1" outputs: "out" dim: 0 }
    ops { kind: OP_RESHAPE inputs: "a0" outputs: "a0t" }
    ops { kind: OP_CONCATENATE inputs: "a0t" inputs: "a0t" outputs: "side" dim: 1 }
  }
)pb";

TEST(ExecutorBindingTest, ConcatenatedPartsAreComputedInPlace) {
  v1::StepProgram program;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(kConcatProgram, &program));
  absl::StatusOr<std::unique_ptr<Executor>> ex = Executor::Create(program, Executor::Options{});
  ASSERT_TRUE(ex.ok()) << ex.status();
  for (int call = 0; call < 2; ++call) {
    const float sign = call == 0 ? -1.0f : 1.0f;
    Tensor a1(v1::DTYPE_F32, {3});
    for (int i = 0; i < 3; ++i) a1.data<float>()[i] = sign * (4 + i);
    ASSERT_TRUE((*ex)->BindInput("a0", Matrix(1, 3, {sign * 1, 2, sign * 3})).ok());
    ASSERT_TRUE((*ex)->BindInput("a1", a1).ok());
    ASSERT_TRUE((*ex)->Run("main", RunContext{}).ok());
    const char* out = static_cast<const char*>((*ex)->buffer("out")->raw());
    EXPECT_EQ((*ex)->buffer("p0")->raw(), out);
    EXPECT_EQ((*ex)->buffer("p1flat")->raw(), out + 3 * sizeof(float))
        << "computed where the concat puts it";
    absl::StatusOr<Tensor> got = (*ex)->TakeOutput("out");
    ASSERT_TRUE(got.ok());
    EXPECT_THAT(Values(*got), ElementsAre(1, 2, 3, 4, 5, 6)) << "call " << call;
    EXPECT_THAT(Values(*(*ex)->TakeOutput("side")),
                ElementsAre(sign * 1, sign * 1, 2, 2, sign * 3, sign * 3));
  }
}

// g = x * 2 on each rank; s = psum(g) over `data` (g is read by nothing else: s is reduced in
// g's memory); h = psum(k) where k is read again afterwards (k must keep its values: a copy);
// out = h + k.
constexpr char kPsumProgram[] = R"pb(
  buffers {
    name: "x"
    dtype: DTYPE_F32
    shape { dims: 4 }
  }
  buffers {
    name: "two"
    dtype: DTYPE_F32
    shape { dims: 4 }
  }
  buffers {
    name: "g"
    dtype: DTYPE_F32
    shape { dims: 4 }
  }
  buffers {
    name: "s"
    dtype: DTYPE_F32
    shape { dims: 4 }
  }
  buffers {
    name: "k"
    dtype: DTYPE_F32
    shape { dims: 4 }
  }
  buffers {
    name: "h"
    dtype: DTYPE_F32
    shape { dims: 4 }
  }
  buffers {
    name: "out"
    dtype: DTYPE_F32
    shape { dims: 4 }
  }
  functions {
    name: "main"
    ops { kind: OP_FILL_VALUE outputs: "two" value: 2 }
    ops { kind: OP_BINARY fn: "mul" inputs: "x" inputs: "two" outputs: "g" }
    ops { kind: OP_PSUM inputs: "g" outputs: "s" axis_names: "data" }
    ops { kind: OP_BINARY fn: "add" inputs: "x" inputs: "x" outputs: "k" }
    ops { kind: OP_PSUM inputs: "k" outputs: "h" axis_names: "data" }
    ops { kind: OP_BINARY fn: "add" inputs: "h" inputs: "k" outputs: "out" }
  }
)pb";

// One executor per rank of the 1-axis mesh `data=N` (N = transports.size()) over `transports`,
// each keeping `results`; empty, with the failure recorded, if one does not compile.
std::vector<std::unique_ptr<Executor>> RankExecutors(
    const v1::StepProgram& program, const Mesh& mesh,
    const std::vector<std::unique_ptr<Transport>>& transports, std::vector<std::string> results,
    const CollectiveOptions& collectives = {}) {
  std::vector<std::unique_ptr<Executor>> ex;
  for (size_t r = 0; r < transports.size(); ++r) {
    Executor::Options o;
    o.mesh = &mesh;
    o.rank = static_cast<int>(r);
    o.transport = transports[r].get();
    o.collectives = collectives;
    o.results = results;
    absl::StatusOr<std::unique_ptr<Executor>> e = Executor::Create(program, o);
    EXPECT_TRUE(e.ok()) << "rank " << r << ": " << e.status();
    if (!e.ok()) return {};
    ex.push_back(*std::move(e));
  }
  return ex;
}

TEST(ExecutorBindingTest, APsumOfAnInputNothingReadsAfterIsReducedInThatInputsMemory) {
  v1::StepProgram program;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(kPsumProgram, &program));
  absl::StatusOr<Mesh> mesh = Mesh::Parse("data=2");
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  std::vector<std::unique_ptr<Transport>> transports = CreateInProcessTransports(2);
  CollectiveOptions uncombined;  // each psum on its own, as this test is about one of them
  uncombined.combine_max_bytes = 0;
  std::vector<std::unique_ptr<Executor>> ex =
      RankExecutors(program, *mesh, transports, {"s", "out"}, uncombined);
  ASSERT_EQ(ex.size(), 2u);
  std::vector<std::vector<float>> taken_s(2);
  for (int call = 0; call < 2; ++call) {
    std::vector<absl::Status> status(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        Tensor x(v1::DTYPE_F32, {4});
        for (int i = 0; i < 4; ++i) x.data<float>()[i] = (call + 1) * (r * 10 + i);
        status[r] = ex[r]->BindInput("x", x);
        if (status[r].ok()) status[r] = ex[r]->Run("main", RunContext{});
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(status[r].ok()) << status[r];
      EXPECT_EQ(ex[r]->buffer("s")->raw(), ex[r]->buffer("g")->raw())
          << "s is reduced in g's memory";
      EXPECT_NE(ex[r]->buffer("h")->raw(), ex[r]->buffer("k")->raw()) << "k is read after the psum";
      const float c = call + 1;
      // psum over the two ranks of 2 * x: 2 * c * (i + (10 + i)).
      EXPECT_THAT(Values(*ex[r]->buffer("s")), ElementsAre(c * 20, c * 24, c * 28, c * 32));
      // h = psum(2x) and out = h + k with this rank's own k = 2x.
      std::vector<float> out;
      for (int i = 0; i < 4; ++i) out.push_back(c * (20 + 4 * i) + 2 * c * (r * 10 + i));
      EXPECT_THAT(Values(*ex[r]->buffer("out")), ElementsAre(out[0], out[1], out[2], out[3]));
    }
    absl::StatusOr<Tensor> s = ex[0]->TakeOutput("s");
    ASSERT_TRUE(s.ok());
    taken_s[call] = Values(*s);
    if (call == 1) {
      EXPECT_THAT(taken_s[0], ElementsAre(20, 24, 28, 32)) << "a taken result keeps its values";
    }
  }
}

// p2, mu2, nu2 = adam(p, psum(g, 'data'), mu, nu) in one op; `read_g_later` adds an op that
// reads the partial gradient after the update.
std::string FusedAdamProgram(bool read_g_later) {
  return absl::StrCat(
      R"pb(
        buffers {
          name: "x"
          dtype: DTYPE_F32
          shape { dims: 4 }
        }
        buffers {
          name: "two"
          dtype: DTYPE_F32
          shape { dims: 4 }
        }
        buffers {
          name: "g"
          dtype: DTYPE_F32
          shape { dims: 4 }
        }
        buffers {
          name: "p"
          dtype: DTYPE_F32
          shape { dims: 4 }
        }
        buffers {
          name: "mu"
          dtype: DTYPE_F32
          shape { dims: 4 }
        }
        buffers {
          name: "nu"
          dtype: DTYPE_F32
          shape { dims: 4 }
        }
        buffers {
          name: "step"
          dtype: DTYPE_F32
          shape {}
        }
        buffers {
          name: "p2"
          dtype: DTYPE_F32
          shape { dims: 4 }
        }
        buffers {
          name: "mu2"
          dtype: DTYPE_F32
          shape { dims: 4 }
        }
        buffers {
          name: "nu2"
          dtype: DTYPE_F32
          shape { dims: 4 }
        }
        buffers {
          name: "seen"
          dtype: DTYPE_F32
          shape { dims: 4 }
        }
        functions { name: "main"
                    ops { kind: OP_FILL_VALUE outputs: "two" value: 2 }
                    ops { kind: OP_BINARY fn: "mul" inputs: "x" inputs: "two" outputs: "g" }
                    ops {
                      kind: OP_ADAM_UPDATE
                      inputs: "p"
                      inputs: "g"
                      inputs: "mu"
                      inputs: "nu"
                      inputs: "step"
                      outputs: "p2"
                      outputs: "mu2"
                      outputs: "nu2"
                      adamw { learning_rate: 0.1 b1: 0.9 b2: 0.999 eps: 1e-8 }
                      axis_names: "data"
                      fn: "sum"
                    })pb",
      read_g_later ? R"pb(ops { kind: OP_UNARY fn: "abs" inputs: "g" outputs: "seen" })pb" : "",
      "}");
}

// The fused update gives every rank Adam's step on the summed gradient, single-copy (every
// buffer shareable in process) or over the ring (below direct_min_bytes); on the ring path the
// partial gradient is reduced in its own memory unless a later op reads it.
TEST(ExecutorBindingTest, AFusedAdamUpdateStepsOnThePsumOfItsPartialGradient) {
  absl::StatusOr<Mesh> mesh = Mesh::Parse("data=2");
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  for (const bool direct : {true, false}) {
    for (const bool read_g_later : {false, true}) {
      SCOPED_TRACE(absl::StrCat(direct ? "direct" : "ring", read_g_later ? ", g read later" : ""));
      v1::StepProgram program;
      ASSERT_TRUE(
          google::protobuf::TextFormat::ParseFromString(FusedAdamProgram(read_g_later), &program));
      std::vector<std::unique_ptr<Transport>> transports = CreateInProcessTransports(2);
      CollectiveOptions collectives;
      collectives.direct_min_bytes = direct ? 1 : 0;
      std::vector<std::unique_ptr<Executor>> ex =
          RankExecutors(program, *mesh, transports, {"p2", "mu2", "nu2"}, collectives);
      ASSERT_EQ(ex.size(), 2u);
      std::vector<absl::Status> status(2);
      std::vector<std::thread> threads;
      for (int r = 0; r < 2; ++r) {
        threads.emplace_back([&, r] {
          Tensor x(v1::DTYPE_F32, {4}), p(v1::DTYPE_F32, {4});
          for (int i = 0; i < 4; ++i) {
            x.data<float>()[i] = r * 10 + i + 1;
            p.data<float>()[i] = i;  // replicated
          }
          for (const auto& [name, t] :
               std::vector<std::pair<std::string, Tensor>>{{"x", x},
                                                           {"p", p},
                                                           {"mu", Tensor(v1::DTYPE_F32, {4})},
                                                           {"nu", Tensor(v1::DTYPE_F32, {4})},
                                                           {"step", Tensor(v1::DTYPE_F32, {})}}) {
            if (status[r].ok()) status[r] = ex[r]->BindInput(name, t);
          }
          if (status[r].ok()) status[r] = ex[r]->Run("main", RunContext{});
        });
      }
      for (auto& t : threads) t.join();
      for (int r = 0; r < 2; ++r) {
        ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
        // psum(2x) = 2 (i + 1) + 2 (10 + i + 1) > 0: Adam's first step moves p by -lr.
        std::vector<float> p2, mu2;
        for (int i = 0; i < 4; ++i) {
          p2.push_back(i - 0.1f);
          mu2.push_back(0.1f * (4 * i + 24));
        }
        EXPECT_THAT(Values(*ex[r]->buffer("p2")),
                    ElementsAre(FloatNear(p2[0], 1e-6f), FloatNear(p2[1], 1e-6f),
                                FloatNear(p2[2], 1e-6f), FloatNear(p2[3], 1e-6f)))
            << "rank " << r;
        EXPECT_THAT(Values(*ex[r]->buffer("mu2")),
                    ElementsAre(FloatNear(mu2[0], 1e-5f), FloatNear(mu2[1], 1e-5f),
                                FloatNear(mu2[2], 1e-5f), FloatNear(mu2[3], 1e-5f)))
            << "rank " << r;
        // What is left in g: the sum where the ring path reduced it in place, else the partial.
        const bool summed = !direct && !read_g_later;
        for (int i = 0; i < 4; ++i) {
          EXPECT_EQ(ex[r]->buffer("g")->data<float>()[i],
                    summed ? 4 * i + 24 : 2 * (r * 10 + i + 1))
              << "rank " << r << " element " << i;
        }
        if (read_g_later) {
          EXPECT_EQ(ex[r]->buffer("seen")->data<float>()[0], 2 * (r * 10 + 1))
              << "the partial, read later";
        }
      }
    }
  }
}

// lax.iota along each dim of a rank-3 array, in f32, i32 and bf16 (each element its index along
// the dim), a dim of 1 and an empty array among them; a second run writes the same.
TEST(ExecutorTest, IotaGivesEachElementItsIndexAlongTheDim) {
  const Dims dims = {3, 5, 7};
  for (const v1::DType dtype : {v1::DTYPE_F32, v1::DTYPE_I32, v1::DTYPE_BF16}) {
    for (const Dims& shape : {dims, Dims{1, 4, 1}, Dims{2, 0, 3}}) {
      for (int64_t dim = 0; dim < 3; ++dim) {
        v1::StepProgram p;
        v1::BufferDecl* b = p.add_buffers();
        b->set_name("y");
        b->set_dtype(dtype);
        for (int64_t d : shape) b->mutable_shape()->add_dims(d);
        v1::Function* f = p.add_functions();
        f->set_name("main");
        v1::Op* op = f->add_ops();
        op->set_kind(v1::OP_IOTA);
        op->set_dim(dim);
        op->add_outputs("y");
        absl::StatusOr<std::unique_ptr<Executor>> ex = Executor::Create(p, Executor::Options{});
        ASSERT_TRUE(ex.ok()) << ex.status();
        for (int run = 0; run < 2; ++run) {
          ASSERT_TRUE((*ex)->Run("main", RunContext{}).ok());
          const Tensor* y = (*ex)->buffer("y");
          for (int64_t i = 0; i < shape[0]; ++i)
            for (int64_t j = 0; j < shape[1]; ++j)
              for (int64_t k = 0; k < shape[2]; ++k) {
                const int64_t at = (i * shape[1] + j) * shape[2] + k;
                const int64_t want = dim == 0 ? i : dim == 1 ? j : k;
                ASSERT_EQ(GetAsDouble(*y, at), static_cast<double>(want))
                    << DTypeName(dtype) << DimsToString(shape) << " dim " << dim << " at " << at;
              }
        }
      }
    }
  }
}

}  // namespace
}  // namespace meshrun
