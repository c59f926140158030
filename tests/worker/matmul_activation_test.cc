// Activations fused into the matmul that produces their input (oneDNN's eltwise post-op) and
// relu's gradient taken from its output: the kernels against the unfused composition bit for bit
// (f32 and bf16 operands, shapes that are and are not multiples of the vector width), and
// SimplifyProgram's rewrite of a DotReluDot block's forward and backward, which runs to the same
// bits.
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/array_ops.h"
#include "core/spmd/fusion.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "tests/worker/random_tensor.h"
#include "tests/worker/run_program.h"
#include "worker/kernels/kernel.h"

namespace meshrun {
namespace {

using testing::Random;

// The same bits, or both NaN (payloads may differ), element by element.
void ExpectSameBits(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.dims(), want.dims()) << what;
  int64_t differ = 0, first = -1;
  for (int64_t i = 0; i < want.num_elements(); ++i) {
    const float g = got.data<float>()[i], w = want.data<float>()[i];
    if (std::isnan(g) && std::isnan(w)) continue;
    if (std::memcmp(&g, &w, sizeof(float)) != 0 && differ++ == 0) first = i;
  }
  EXPECT_EQ(differ, 0) << what << ": " << differ << " of " << want.num_elements()
                       << " elements differ, first at " << first << ": "
                       << (first >= 0 ? got.data<float>()[first] : 0) << " vs "
                       << (first >= 0 ? want.data<float>()[first] : 0);
}

// matmul(activation) == unary(activation, matmul) bit for bit, for every activation the
// simplifier fuses, with and
// without a bias and transposes, on f32 and on bf16 operands (the f32 accumulator either way).
TEST(MatmulActivationTest, ThePostOpEqualsTheMatmulThenTheUnary) {
  struct Case {
    int64_t m, k, n;
    bool ta, tb, bias;
  };
  // Not tanh, exp or logistic: their unaries are XLA's, which SimplifyProgram never makes
  // post-ops.
  const std::vector<std::string> fns = {"relu", "silu", "sqrt", "rsqrt", "abs", "square", "neg"};
  for (const Case& c :
       {Case{3, 4, 5, false, false, true}, Case{17, 33, 19, true, false, false},
        Case{32, 64, 48, false, true, true}, Case{8, 1024, 256, false, false, false}}) {
    for (const DType dtype : {v1::DTYPE_F32, v1::DTYPE_BF16}) {
      Tensor a = Random(c.ta ? Dims{c.k, c.m} : Dims{c.m, c.k}, 31);
      Tensor b = Random(c.tb ? Dims{c.n, c.k} : Dims{c.k, c.n}, 32);
      if (dtype == v1::DTYPE_BF16) {
        Tensor a16 = Tensor::Uninitialized(dtype, a.dims()),
               b16 = Tensor::Uninitialized(dtype, b.dims());
        Convert(a, a16);
        Convert(b, b16);
        a = std::move(a16);
        b = std::move(b16);
      }
      const Tensor bias = Random({c.n}, 33);
      const Tensor* bias_p = c.bias ? &bias : nullptr;
      Tensor product(v1::DTYPE_F32, {c.m, c.n});
      MatmulOptions plain{.transpose_a = c.ta, .transpose_b = c.tb};
      auto mm = CreateMatmul(a, b, bias_p, product, plain);
      ASSERT_TRUE(mm.ok()) << mm.status();
      ASSERT_TRUE((*mm)->Run().ok());
      for (const std::string& fn : fns) {
        const std::string what =
            absl::StrCat(fn, " ", DTypeName(dtype), " ", c.m, "x", c.k, "x", c.n, c.ta ? " ta" : "",
                         c.tb ? " tb" : "", c.bias ? " bias" : "");
        Tensor want(v1::DTYPE_F32, {c.m, c.n}), got(v1::DTYPE_F32, {c.m, c.n});
        auto unary = CreateUnary(fn, product, want);
        ASSERT_TRUE(unary.ok()) << what << ": " << unary.status();
        ASSERT_TRUE((*unary)->Run().ok());
        MatmulOptions fused = plain;
        fused.activation = fn;
        auto k = CreateMatmul(a, b, bias_p, got, fused);
        ASSERT_TRUE(k.ok()) << what << ": " << k.status();
        ASSERT_TRUE((*k)->Run().ok());
        ExpectSameBits(got, want, what);
      }
    }
  }
}

TEST(MatmulActivationTest, RefusesUnknownActivationsAndAccumulation) {
  Tensor a = Random({2, 3}, 1), b = Random({3, 4}, 2), c(v1::DTYPE_F32, {2, 4});
  for (const char* fn : {"pow", "erf", "gelu"}) {
    auto k = CreateMatmul(a, b, nullptr, c, {.activation = fn});
    EXPECT_EQ(k.status().code(), absl::StatusCode::kInvalidArgument) << fn;
    EXPECT_THAT(std::string(k.status().message()), ::testing::HasSubstr(fn));
  }
  auto acc = CreateMatmul(a, b, nullptr, c, {.accumulate = true, .activation = "relu"});
  EXPECT_EQ(acc.status().code(), absl::StatusCode::kInvalidArgument);
  auto scaled = CreateMatmul(a, b, nullptr, c, {.alpha = 0.5f, .activation = "relu"});
  EXPECT_EQ(scaled.status().code(), absl::StatusCode::kInvalidArgument);
}

// relu's gradient from y = relu(x) equals the one from x bit for bit for every x that is not NaN:
// zeros, negative zeros, infinities and negatives included (y > 0 exactly where x > 0). At a NaN
// x oneDNN's relu gives y = 0, and the gradient from y is then 0 (that of the 0 the forward pass
// produced) where the one from x passes dy.
TEST(MatmulActivationTest, ReluGradFromTheOutputEqualsTheOneFromTheInput) {
  Tensor x = Random({7, 37}, 41), dy = Random({7, 37}, 42);
  x.data<float>()[0] = 0.0f;
  x.data<float>()[1] = -0.0f;
  x.data<float>()[2] = std::numeric_limits<float>::infinity();
  x.data<float>()[3] = -std::numeric_limits<float>::infinity();
  dy.data<float>()[4] = std::numeric_limits<float>::infinity();
  Tensor y(v1::DTYPE_F32, x.dims()), from_x(v1::DTYPE_F32, x.dims()),
      from_y(v1::DTYPE_F32, x.dims());
  auto relu = CreateUnary("relu", x, y);
  auto gx = CreateUnaryGrad("relu", x, dy, from_x);
  auto gy = CreateUnaryGrad("relu", y, dy, from_y, /*from_output=*/true);
  ASSERT_TRUE(relu.ok() && gx.ok() && gy.ok());
  ASSERT_TRUE((*relu)->Run().ok());
  ASSERT_TRUE((*gx)->Run().ok());
  ASSERT_TRUE((*gy)->Run().ok());
  ExpectSameBits(from_y, from_x, "relu grad");
  for (int64_t i = 5; i < x.num_elements(); ++i) {
    EXPECT_EQ(from_x.data<float>()[i], x.data<float>()[i] > 0 ? dy.data<float>()[i] : 0.0f) << i;
  }
  x.data<float>()[0] = std::nanf("");
  ASSERT_TRUE((*relu)->Run().ok());
  ASSERT_TRUE((*gy)->Run().ok());
  EXPECT_EQ(y.data<float>()[0], 0.0f) << "oneDNN's relu(NaN)";
  EXPECT_EQ(from_y.data<float>()[0], 0.0f);
  auto silu = CreateUnaryGrad("silu", y, dy, from_y, /*from_output=*/true);
  EXPECT_EQ(silu.status().code(), absl::StatusCode::kInvalidArgument);
}

// One DotReluDot block's forward and backward as a traced f32 step spells it:
//   h = x @ w1; y = relu(h); z = y @ w2; dy = g @ w2^T; dh = relu_grad(h, dy); dw1 = x^T @ dh.
constexpr char kBlock[] = R"pb(
  program {
    buffers {
      name: "x"
      dtype: DTYPE_F32
      shape { dims: 4 dims: 6 }
    }
    buffers {
      name: "w1"
      dtype: DTYPE_F32
      shape { dims: 6 dims: 8 }
    }
    buffers {
      name: "w2"
      dtype: DTYPE_F32
      shape { dims: 8 dims: 6 }
    }
    buffers {
      name: "g"
      dtype: DTYPE_F32
      shape { dims: 4 dims: 6 }
    }
    buffers {
      name: "h"
      dtype: DTYPE_F32
      shape { dims: 4 dims: 8 }
    }
    buffers {
      name: "y"
      dtype: DTYPE_F32
      shape { dims: 4 dims: 8 }
    }
    buffers {
      name: "z"
      dtype: DTYPE_F32
      shape { dims: 4 dims: 6 }
    }
    buffers {
      name: "dy"
      dtype: DTYPE_F32
      shape { dims: 4 dims: 8 }
    }
    buffers {
      name: "dh"
      dtype: DTYPE_F32
      shape { dims: 4 dims: 8 }
    }
    buffers {
      name: "dw1"
      dtype: DTYPE_F32
      shape { dims: 6 dims: 8 }
    }
    functions {
      name: "main"
      ops { kind: OP_MATMUL inputs: "x" inputs: "w1" outputs: "h" }
      ops { kind: OP_UNARY fn: "relu" inputs: "h" outputs: "y" }
      ops { kind: OP_MATMUL inputs: "y" inputs: "w2" outputs: "z" }
      ops { kind: OP_MATMUL transpose_b: true inputs: "g" inputs: "w2" outputs: "dy" }
      ops { kind: OP_UNARY_GRAD fn: "relu" inputs: "h" inputs: "dy" outputs: "dh" }
      ops { kind: OP_MATMUL transpose_a: true inputs: "x" inputs: "dh" outputs: "dw1" }
    }
  }
  inputs: "x"
  inputs: "w1"
  inputs: "w2"
  inputs: "g"
  outputs: "z"
  outputs: "dw1"
)pb";

v1::ShardMapProgram Block() {
  v1::ShardMapProgram p;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(kBlock, &p));
  return p;
}

const v1::Op* Writer(const v1::ShardMapProgram& p, const std::string& name) {
  for (const v1::Op& op : p.program().functions(0).ops())
    if (op.outputs_size() > 0 && op.outputs(0) == name) return &op;
  return nullptr;
}

TEST(MatmulActivationTest, SimplifyFusesTheReluIntoItsMatmulAndItsGradReadsTheOutput) {
  v1::ShardMapProgram p = Block();
  SimplifyProgram(&p);
  ASSERT_EQ(p.program().functions(0).ops_size(), 5) << p.DebugString();
  const v1::Op* y = Writer(p, "y");
  ASSERT_NE(y, nullptr);
  EXPECT_EQ(y->kind(), v1::OP_MATMUL);
  EXPECT_EQ(y->fn(), "relu");
  EXPECT_EQ(Writer(p, "h"), nullptr) << "the pre-activation is never written";
  const v1::Op* dh = Writer(p, "dh");
  ASSERT_NE(dh, nullptr);
  EXPECT_TRUE(dh->grad_from_output());
  EXPECT_EQ(dh->inputs(0), "y");
  for (const v1::BufferDecl& b : p.program().buffers()) EXPECT_NE(b.name(), "h");

  const auto before = testing::RunProgramOnce(Block()), after = testing::RunProgramOnce(p);
  ASSERT_EQ(before.size(), 2u);
  for (const auto& [name, values] : before) {
    ASSERT_EQ(after.at(name).size(), values.size()) << name;
    EXPECT_EQ(std::memcmp(after.at(name).data(), values.data(), values.size() * sizeof(float)), 0)
        << name;
  }
}

TEST(MatmulActivationTest, LeavesPreActivationsThatAreReadOrReturnedAndOtherGradients) {
  // The pre-activation is returned: the relu stays its own op (its gradient still reads y).
  v1::ShardMapProgram returned = Block();
  returned.add_outputs("h");
  SimplifyProgram(&returned);
  ASSERT_NE(Writer(returned, "h"), nullptr);
  EXPECT_EQ(Writer(returned, "h")->fn(), "");
  EXPECT_EQ(Writer(returned, "y")->kind(), v1::OP_UNARY);

  // silu's gradient needs x: no fusion, no rewrite.
  v1::ShardMapProgram silu = Block();
  for (v1::Op& op : *silu.mutable_program()->mutable_functions(0)->mutable_ops())
    if (op.fn() == "relu") op.set_fn("silu");
  SimplifyProgram(&silu);
  EXPECT_EQ(Writer(silu, "y")->kind(), v1::OP_UNARY);
  EXPECT_FALSE(Writer(silu, "dh")->grad_from_output());
  EXPECT_EQ(Writer(silu, "dh")->inputs(0), "h");

  // An accumulating matmul takes no activation.
  v1::ShardMapProgram acc = Block();
  acc.mutable_program()->mutable_functions(0)->mutable_ops(0)->set_accumulate(true);
  SimplifyProgram(&acc);
  EXPECT_EQ(Writer(acc, "y")->kind(), v1::OP_UNARY);
}

}  // namespace
}  // namespace meshrun
