// SimplifyProgram (core/spmd/fusion.h) on a bf16 GEMM whose result an element-wise op reads, as
// the partitioner spells a bf16 op: the product widened to f32 (an OP_CONVERT marked `widened`),
// the op in f32, its result rounded back to bf16. XLA rounds the product before the op, so the
// GEMM may hand over its unrounded f32 accumulator only where the rounding cannot show: a relu.
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/spmd/fusion.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "tests/worker/run_program.h"

namespace meshrun {
namespace {

constexpr int kM = 4, kK = 16, kN = 8;

// out = f32(bf16(fn(f32(bf16(x) @ bf16(w))))), the widening convert marked `widened` or not (a
// user's convert_element_type, which XLA folds into the dot).
v1::ShardMapProgram Program(const std::string& fn, bool widened) {
  auto buffer = [](const std::string& name, const std::string& dtype, int rows, int cols) {
    return absl::StrCat("buffers { name: '", name, "' dtype: ", dtype, " shape { dims: ", rows,
                        " dims: ", cols, " } } ");
  };
  const std::string text = absl::StrCat(
      "program { ", buffer("x", "DTYPE_F32", kM, kK), buffer("w", "DTYPE_F32", kK, kN),
      buffer("xb", "DTYPE_BF16", kM, kK), buffer("wb", "DTYPE_BF16", kK, kN),
      buffer("p", "DTYPE_BF16", kM, kN), buffer("q", "DTYPE_F32", kM, kN),
      buffer("t", "DTYPE_F32", kM, kN), buffer("tb", "DTYPE_BF16", kM, kN),
      buffer("out", "DTYPE_F32", kM, kN), "functions { name: 'main' ",
      "ops { kind: OP_CONVERT inputs: 'x' outputs: 'xb' } ",
      "ops { kind: OP_CONVERT inputs: 'w' outputs: 'wb' } ",
      "ops { kind: OP_MATMUL inputs: 'xb' inputs: 'wb' outputs: 'p' } ",
      "ops { kind: OP_CONVERT inputs: 'p' outputs: 'q' widened: ", widened ? "true" : "false",
      " } ", "ops { kind: OP_UNARY fn: '", fn, "' inputs: 'q' outputs: 't' } ",
      "ops { kind: OP_CONVERT inputs: 't' outputs: 'tb' } ",
      "ops { kind: OP_CONVERT inputs: 'tb' outputs: 'out' } ",
      "} } inputs: 'x' inputs: 'w' outputs: 'out'");
  v1::ShardMapProgram p;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &p)) << text;
  return p;
}

// The one matmul's output buffer after SimplifyProgram, and its post-op.
struct Gemm {
  std::string output, fn;
};
Gemm SimplifiedGemm(v1::ShardMapProgram* p) {
  SimplifyProgram(p);
  for (const v1::Op& op : p->program().functions(0).ops())
    if (op.kind() == v1::OP_MATMUL) return {op.outputs(0), op.fn()};
  ADD_FAILURE() << "no matmul left";
  return {};
}

std::vector<float> Out(const v1::ShardMapProgram& p) {
  // Inputs scaled down so that the products lie where a tanh is steep (its result then keeps the
  // products' digits below bf16's), not where it is flat at +-1.
  return testing::RunProgramOnce(p,
                                 [](const std::string&, Tensor& t) {
                                   for (int64_t i = 0; i < t.num_elements(); ++i)
                                     t.data<float>()[i] *= 0.15f;
                                 })
      .at("out");
}

int DifferingElements(const std::vector<float>& a, const std::vector<float>& b) {
  int n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  return n;
}

TEST(SimplifyBf16Test, AWidenedProductThatATanhReadsKeepsItsRounding) {
  const v1::ShardMapProgram original = Program("tanh", /*widened=*/true);
  v1::ShardMapProgram simplified = original;
  const Gemm gemm = SimplifiedGemm(&simplified);
  EXPECT_EQ(gemm.output, "p");  // the GEMM still writes the bf16 product
  EXPECT_EQ(gemm.fn, "");
  const std::vector<float> want = Out(original);
  ASSERT_EQ(want.size(), static_cast<size_t>(kM * kN));
  EXPECT_EQ(DifferingElements(Out(simplified), want), 0);

  // What the rounding is worth here: a user's convert (folded, as XLA folds convert(dot)) feeds
  // the tanh the unrounded accumulator, and some of the results move.
  v1::ShardMapProgram folded = Program("tanh", /*widened=*/false);
  EXPECT_EQ(SimplifiedGemm(&folded).output, "q");
  EXPECT_GT(DifferingElements(Out(folded), want), 0);
}

TEST(SimplifyBf16Test, AWidenedProductThatOnlyAReluReadsIsTheGemmsF32PostOp) {
  const v1::ShardMapProgram original = Program("relu", /*widened=*/true);
  v1::ShardMapProgram simplified = original;
  const Gemm gemm = SimplifiedGemm(&simplified);
  EXPECT_EQ(gemm.output, "t");  // f32 accumulator, relu as its post-op, then rounded once
  EXPECT_EQ(gemm.fn, "relu");
  const std::vector<float> want = Out(original);
  ASSERT_EQ(want.size(), static_cast<size_t>(kM * kN));
  EXPECT_EQ(DifferingElements(Out(simplified), want), 0);  // relu commutes with the rounding
}

TEST(SimplifyBf16Test, AReluWhoseF32OutputIsReturnedKeepsTheRounding) {
  v1::ShardMapProgram p = Program("relu", /*widened=*/true);
  p.add_outputs("t");  // relu's f32 result seen as it is: the product's rounding shows in it
  EXPECT_EQ(SimplifiedGemm(&p).output, "p");
}

}  // namespace
}  // namespace meshrun
