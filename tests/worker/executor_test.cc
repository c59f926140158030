// Executor arguments and results without copies: a read-only input aliases the caller's array, an
// input the program writes is copied (the caller's array is never modified), and a taken output
// keeps its values when the executor runs again.
#include "worker/executor.h"

#include <vector>

#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"

namespace meshrun {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// y = x @ w; acc += y (ACCUMULATE writes acc, so acc is not read-only).
constexpr char kProgram[] = R"pb(
  buffers { name: "x" dtype: DTYPE_F32 shape { dims: 2 dims: 3 } }
  buffers { name: "w" dtype: DTYPE_F32 shape { dims: 3 dims: 2 } }
  buffers { name: "y" dtype: DTYPE_F32 shape { dims: 2 dims: 2 } }
  buffers { name: "acc" dtype: DTYPE_F32 shape { dims: 2 dims: 2 } }
  functions {
    name: "main"
    ops { kind: OP_MATMUL inputs: "x" inputs: "w" outputs: "y" }
    ops { kind: OP_ACCUMULATE inputs: "y" outputs: "acc" scale: 1 }
  }
)pb";

Tensor Matrix(int64_t rows, int64_t cols, std::vector<float> values) {
  Tensor t(v1::DTYPE_F32, {rows, cols});
  std::copy(values.begin(), values.end(), t.data<float>());
  return t;
}

std::vector<float> Values(const Tensor& t) { return {t.data<float>(), t.data<float>() + t.num_elements()}; }

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
  EXPECT_THAT(Values(acc), ElementsAre(100, 200, 300, 400)) << "the caller's array is never written";

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

TEST(ExecutorBindingTest, AnArgumentOfAnotherShapeOrAnUnknownBufferIsRefused) {
  std::unique_ptr<Executor> ex = Compile();
  ASSERT_NE(ex, nullptr);
  absl::Status s = ex->BindInput("x", Matrix(3, 2, {1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("input 'x' is f32[3, 2] but the program expects f32[2, 3]"));
  EXPECT_THAT(ex->BindInput("z", Matrix(2, 3, {})).message(), HasSubstr("no input buffer 'z'"));
  EXPECT_THAT(ex->TakeOutput("z").status().message(), HasSubstr("no output buffer 'z'"));
}

}  // namespace
}  // namespace meshrun
