// SimplifyProgram (core/spmd/fusion.h) on a bf16 GEMM whose result an element-wise op reads, as
// the partitioner spells a bf16 op: the product widened to f32 (an OP_CONVERT marked `widened`),
// the op in f32, its result rounded back to bf16. XLA rounds the product before the op, so the
// GEMM may hand over its unrounded f32 accumulator only where the rounding cannot show: a relu.
#include <algorithm>
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

// y = f32(bf16(x)), read by a mul (and the mul's result rounded so too): the partitioner's
// spelling of a bf16 op computed in f32. `extra` adds ops text after them.
v1::ShardMapProgram RoundTripProgram(const std::string& extra = "",
                                     const std::string& outputs = "outputs: 'out'") {
  const std::string text = absl::StrCat(
      "program { ", "buffers { name: 'x' dtype: DTYPE_F32 shape { dims: 37 } } ",
      "buffers { name: 'xb' dtype: DTYPE_BF16 shape { dims: 37 } } ",
      "buffers { name: 'y' dtype: DTYPE_F32 shape { dims: 37 } } ",
      "buffers { name: 'z' dtype: DTYPE_F32 shape { dims: 37 } } ",
      "buffers { name: 'zb' dtype: DTYPE_BF16 shape { dims: 37 } } ",
      "buffers { name: 'out' dtype: DTYPE_F32 shape { dims: 37 } } ",
      "buffers { name: 'n' dtype: DTYPE_F32 shape { dims: 37 } } ", "functions { name: 'main' ",
      "ops { kind: OP_CONVERT inputs: 'x' outputs: 'xb' } ",
      "ops { kind: OP_CONVERT inputs: 'xb' outputs: 'y' widened: true } ",
      "ops { kind: OP_BINARY fn: 'mul' inputs: 'y' inputs: 'y' outputs: 'z' } ",
      "ops { kind: OP_CONVERT inputs: 'z' outputs: 'zb' } ",
      "ops { kind: OP_CONVERT inputs: 'zb' outputs: 'out' widened: true } ", extra,
      "} } inputs: 'x' ", outputs);
  v1::ShardMapProgram p;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &p)) << text;
  return p;
}

// Inputs with NaNs, infinities, ties, values that round to infinity and subnormals among them.
std::vector<float> RoundTripOut(const v1::ShardMapProgram& p) {
  return testing::RunProgramOnce(p,
                                 [](const std::string&, Tensor& t) {
                                   const uint32_t special[] = {
                                       0x7fc00000u, 0xffc01234u, 0x7f800000u, 0x3f808000u,
                                       0x3f818000u, 0x7f7fffffu, 0x00018000u, 0x80000001u};
                                   for (int i = 0; i < 8; ++i)
                                     std::memcpy(&t.data<float>()[4 * i], &special[i], 4);
                                 })
      .at("out");
}

std::vector<std::string> Kinds(const v1::ShardMapProgram& p) {
  std::vector<std::string> kinds;
  for (const v1::Op& op : p.program().functions(0).ops())
    kinds.push_back(absl::StrCat(v1::OpKind_Name(op.kind()), op.fn().empty() ? "" : " ", op.fn()));
  return kinds;
}

int DifferingBits(const std::vector<float>& a, const std::vector<float>& b) {
  int n = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    n += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  return n;
}

TEST(SimplifyBf16Test, AConvertToBf16AndBackIsOneRoundBf16WithTheSameBits) {
  const v1::ShardMapProgram original = RoundTripProgram();
  const std::vector<float> want = RoundTripOut(original);
  ASSERT_EQ(want.size(), 37u);
  v1::ShardMapProgram simplified = original;
  SimplifyProgram(&simplified);
  EXPECT_EQ(Kinds(simplified), (std::vector<std::string>{"OP_UNARY round_bf16", "OP_BINARY mul",
                                                         "OP_UNARY round_bf16"}));
  for (const v1::BufferDecl& b : simplified.program().buffers())
    EXPECT_NE(b.dtype(), v1::DTYPE_BF16) << b.name();  // no bf16 buffer is left
  EXPECT_EQ(DifferingBits(RoundTripOut(simplified), want), 0);
  // And the three in one loop.
  FuseElementwise(&simplified);
  EXPECT_EQ(Kinds(simplified), (std::vector<std::string>{"OP_FUSED_ELEMENTWISE"}));
  EXPECT_EQ(DifferingBits(RoundTripOut(simplified), want), 0);
}

TEST(SimplifyBf16Test, ABf16ValueThatOthersReadOrTheCallerSeesKeepsItsConverts) {
  auto converts = [](v1::ShardMapProgram p) {
    SimplifyProgram(&p);
    const std::vector<std::string> k = Kinds(p);
    return std::count(k.begin(), k.end(), "OP_CONVERT");
  };
  EXPECT_EQ(converts(RoundTripProgram()), 0);
  // xb read by an op besides its widening: both converts stay (the bf16 value is needed).
  EXPECT_EQ(converts(RoundTripProgram("ops { kind: OP_CONVERT inputs: 'xb' outputs: 'n' } ",
                                      "outputs: 'out' outputs: 'n'")),
            2 + 1);
  // zb returned: its pair stays; x's is still rewritten.
  EXPECT_EQ(converts(RoundTripProgram("", "outputs: 'out' outputs: 'zb'")), 2);
  // y read before the widening writes it (a program that reads its result early): left alone.
  v1::ShardMapProgram early = RoundTripProgram();
  v1::Op* read = early.mutable_program()->mutable_functions(0)->mutable_ops()->Add();
  read->set_kind(v1::OP_UNARY);
  read->set_fn("neg");
  read->add_inputs("y");
  read->add_outputs("n");
  early.mutable_program()->mutable_functions(0)->mutable_ops()->SwapElements(1, 5);
  early.add_outputs("n");
  EXPECT_EQ(converts(early), 2);
}

}  // namespace
}  // namespace meshrun
