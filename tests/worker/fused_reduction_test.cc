// Updates fused with the all-reduce of their partial gradient (worker/executor_adam.cc): Adam's,
// with the small reductions that ride along (worker/combine_reductions.h), and the gradient
// reduced in bf16 (AdamWAttrs.reduce_dtype, FSDP2's reduce_dtype).
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/collectives/in_process_transport.h"
#include "core/collectives/reduce_kernels.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "tests/worker/two_ranks.h"
#include "worker/combine_reductions.h"
#include "worker/executor.h"

namespace meshrun {
namespace {

using ::testing::ElementsAre;

// A data-parallel step's tail: the loss's pmean, a small parameter's Adam update and a large one's
// (w: 32 elements, 128 bytes: single-copy from 64 bytes on), all over "data".
std::string AdamTail(bool riders) {
  std::string buffers;
  for (const char* name : {"w", "gw", "muw", "nuw", "w2", "muw2", "nuw2"}) {
    buffers += absl::StrCat("buffers { name: '", name, "' dtype: DTYPE_F32 shape { dims: 32 } }");
  }
  for (const char* name : {"b", "gb", "mub", "nub", "b2", "mub2", "nub2", "gbr"}) {
    buffers += absl::StrCat("buffers { name: '", name, "' dtype: DTYPE_F32 shape { dims: 3 } }");
  }
  for (const char* name : {"step", "l", "lm"}) {
    buffers += absl::StrCat("buffers { name: '", name, "' dtype: DTYPE_F32 shape {} }");
  }
  const std::string adamw = "adamw { learning_rate: 0.1 b1: 0.9 b2: 0.999 eps: 1e-8 }";
  const std::string w = absl::StrCat(
      "kind: OP_ADAM_UPDATE inputs: 'w' inputs: 'gw' inputs: 'muw' inputs: 'nuw' inputs: 'step' ",
      "outputs: 'w2' outputs: 'muw2' outputs: 'nuw2' axis_names: 'data' ", adamw);
  if (riders) {  // as step 3 leaves it, written out
    return absl::StrCat(buffers, "functions { name: 'main' ops { ", w,
                        " inputs: 'l' inputs: 'gb' outputs: 'lm' outputs: 'gbr' fn: 'sum:ms' } ",
                        "ops { kind: OP_ADAM_UPDATE inputs: 'b' inputs: 'gbr' inputs: 'mub' ",
                        "inputs: 'nub' inputs: 'step' outputs: 'b2' outputs: 'mub2' ",
                        "outputs: 'nub2' ", adamw, " } }");
  }
  return absl::StrCat(buffers, "functions { name: 'main' ",
                      "ops { kind: OP_PMEAN inputs: 'l' outputs: 'lm' axis_names: 'data' } ",
                      "ops { kind: OP_ADAM_UPDATE inputs: 'b' inputs: 'gb' inputs: 'mub' ",
                      "inputs: 'nub' inputs: 'step' outputs: 'b2' outputs: 'mub2' ",
                      "outputs: 'nub2' axis_names: 'data' fn: 'sum' ", adamw, " } ", "ops { ", w,
                      " fn: 'sum' } }");
}

TEST(FusedReductionTest, SmallReductionsRideWithASingleCopyAdamUpdate) {
  v1::StepProgram p = ParseText(AdamTail(false));
  CombineReductions(&p, 256 << 10, 64);
  const auto& ops = p.functions(0).ops();
  ASSERT_EQ(ops.size(), 2) << p.DebugString();
  EXPECT_EQ(ops[0].kind(), v1::OP_ADAM_UPDATE);  // w's, with the loss and b's gradient
  EXPECT_THAT(ops[0].inputs(), ElementsAre("w", "gw", "muw", "nuw", "step", "l", "gb"));
  EXPECT_THAT(ops[0].outputs(), ElementsAre("w2", "muw2", "nuw2", "lm", "gb/reduced"));
  EXPECT_EQ(ops[0].fn(), "sum:ms");
  EXPECT_EQ(ops[1].kind(), v1::OP_ADAM_UPDATE);  // b's, on its reduced gradient, no axes
  EXPECT_EQ(ops[1].inputs(1), "gb/reduced");
  EXPECT_EQ(ops[1].axis_names_size(), 0);

  // Without single-copy (direct_min_bytes 0), or with w below it, every reduction, w's gradient's
  // too, goes into one bucket.
  for (const size_t direct_min_bytes : {size_t{0}, size_t{256}}) {
    v1::StepProgram q = ParseText(AdamTail(false));
    CombineReductions(&q, 256 << 10, direct_min_bytes);
    ASSERT_GE(q.functions(0).ops_size(), 3) << q.DebugString();
    EXPECT_EQ(q.functions(0).ops(0).kind(), v1::OP_PSUM) << "direct_min_bytes " << direct_min_bytes;
    EXPECT_EQ(q.functions(0).ops(0).fn(), "mss");
  }
}

// Runs `text` on two ranks (element i of rank r's inputs set from r and i) and returns each
// rank's w2, muw2, nuw2, b2, mub2, nub2 and lm side by side.
std::vector<std::vector<float>> RunAdamTail(const std::string& text, size_t combine,
                                            size_t direct_min_bytes) {
  CollectiveOptions collectives;
  collectives.combine_max_bytes = combine;
  collectives.direct_min_bytes = direct_min_bytes;
  return RunOnTwoRanks(ParseText(text), collectives, {"w", "gw", "b", "gb", "l", "muw", "mub"},
                       [](const std::string& name, int r, int64_t i) {
                         const bool replicated = name[0] != 'g' && name[0] != 'l';
                         return replicated ? 0.25f * i - 1 : (r + 1) * (2.5f - i) + 0.125f * r;
                       },
                       {"w2", "muw2", "nuw2", "b2", "mub2", "nub2", "lm"});
}

// The riders' sums and means, and both updates, are what the separate collectives give, on the
// single-copy path and on the ring (the riders then a bucket of their own).
TEST(FusedReductionTest, RidersComputeWhatSeparateReductionsDo) {
  const std::vector<std::vector<float>> want = RunAdamTail(AdamTail(false), 0, 0);
  ASSERT_EQ(want[0].size(), 3 * 32 + 3 * 3 + 1);
  EXPECT_EQ(want[0], want[1]);
  EXPECT_FLOAT_EQ(want[0].back(), (1 * 2.5f + 2 * 2.5f + 0.125f) / 2);  // pmean(l)
  const struct {
    const char* what;
    std::string text;
    size_t combine, direct_min_bytes;
  } cases[] = {{"joined by CombineReductions, single-copy", AdamTail(false), 256 << 10, 64},
               {"written out, single-copy", AdamTail(true), 0, 64},
               {"written out, over the ring", AdamTail(true), 0, 0}};
  for (const auto& c : cases) {
    const std::vector<std::vector<float>> got = RunAdamTail(c.text, c.combine, c.direct_min_bytes);
    for (int r = 0; r < 2; ++r) EXPECT_EQ(got[r], want[r]) << c.what << ", rank " << r;
  }
}

// The error rank 0's executor gives for `text` (OK if it compiles).
absl::Status CompileError(const std::string& text) {
  const Mesh mesh = *Mesh::Parse("data=2");
  std::vector<std::unique_ptr<Transport>> transports = CreateInProcessTransports(2);
  Executor::Options o;
  o.mesh = &mesh;
  o.transport = transports[0].get();
  return Executor::Create(ParseText(text), o).status();
}

TEST(FusedReductionTest, ARiderWithoutItsLetterIsRefused) {
  std::string text = AdamTail(true);
  text.replace(text.find("sum:ms"), 6, "sum:m");
  EXPECT_THAT(std::string(CompileError(text).message()), ::testing::HasSubstr("fn 'sum:m'"));
}

// AdamTail with both gradients reduced in bf16 (adamw.reduce_dtype).
std::string Bf16AdamTail() {
  std::string text = AdamTail(false);
  const std::string eps = "eps: 1e-8 }";
  for (size_t at = text.find(eps); at != std::string::npos; at = text.find(eps, at + 1))
    text.replace(at, eps.size(), "eps: 1e-8 reduce_dtype: DTYPE_BF16 }");
  return text;
}

// Gradients whose f32 values bf16 cannot hold.
float Bf16TestGrad(int r, int64_t i) { return (r + 1) * (2.5f - 0.3f * i) * 1.01f + 0.0123f * r; }

std::vector<std::vector<float>> RunBf16AdamTail(const std::string& text, size_t combine,
                                                size_t direct_min_bytes, bool pre_reduced) {
  CollectiveOptions collectives;
  collectives.combine_max_bytes = combine;
  collectives.direct_min_bytes = direct_min_bytes;
  return RunOnTwoRanks(ParseText(text), collectives, {"w", "gw", "b", "gb", "l", "muw", "mub"},
                       [pre_reduced](const std::string& name, int r, int64_t i) {
                         if (name == "l") return 2.5f + r;
                         if (name[0] != 'g') return 0.25f * i - 1;  // replicated
                         if (!pre_reduced) return Bf16TestGrad(r, i);
                         // Rank 0 holds what a bf16 all-reduce of both ranks' gradients gives, rank
                         // 1 zero: the f32 sum is then that value exactly.
                         if (r == 1) return 0.0f;
                         return Bf16ToF32(F32ToBf16(Bf16ToF32(F32ToBf16(Bf16TestGrad(0, i))) +
                                                    Bf16ToF32(F32ToBf16(Bf16TestGrad(1, i)))));
                       },
                       {"w2", "muw2", "nuw2", "b2", "mub2", "nub2", "lm"});
}

// reduce_dtype bf16: each rank's gradient rounded to bf16 and summed in bf16 (one rounding of
// the sum with two ranks), then the f32 update, on the single-copy path (the riders, f32,
// summed in the same session) and over the ring. With CombineReductions on, a gradient small
// enough to be bucketed (b's; w's too without single-copy) is summed in the f32 bucket instead.
TEST(FusedReductionTest, AGradientReducedInBf16IsTheBf16SumOfTheRoundedPartials) {
  const std::vector<std::vector<float>> want = RunBf16AdamTail(AdamTail(false), 0, 0, true);
  const std::vector<std::vector<float>> f32 = RunBf16AdamTail(AdamTail(false), 0, 0, false);
  constexpr size_t kW = 3 * 32, kB = 3 * 3;  // w2, muw2, nuw2; then b2, mub2, nub2; then lm
  ASSERT_EQ(want[0].size(), kW + kB + 1);
  auto part = [](const std::vector<float>& v, size_t begin, size_t n) {
    return std::vector<float>(v.begin() + begin, v.begin() + begin + n);
  };
  EXPECT_NE(part(want[0], 0, kW), part(f32[0], 0, kW)) << "the bf16 reduction rounds nothing";
  EXPECT_NE(part(want[0], kW, kB), part(f32[0], kW, kB)) << "the bf16 reduction rounds nothing";
  EXPECT_FLOAT_EQ(want[0].back(), 3.0f);  // pmean(l): f32
  const struct {
    const char* what;
    size_t combine, direct_min_bytes;
    bool bf16_w, bf16_b;  // whether w's and b's gradients are reduced in bf16
  } cases[] = {{"single-copy", 0, 64, true, true},
               {"over the ring", 0, 0, true, true},
               {"combined, single-copy (riders)", 256 << 10, 64, true, false},
               {"combined, over the ring", 256 << 10, 0, false, false}};
  for (const auto& c : cases) {
    const std::vector<std::vector<float>> got =
        RunBf16AdamTail(Bf16AdamTail(), c.combine, c.direct_min_bytes, false);
    for (int r = 0; r < 2; ++r) {
      ASSERT_EQ(got[r].size(), want[r].size()) << c.what;
      const std::vector<float>& w = c.bf16_w ? want[r] : f32[r];
      const std::vector<float>& b = c.bf16_b ? want[r] : f32[r];
      EXPECT_EQ(part(got[r], 0, kW), part(w, 0, kW)) << c.what << ", rank " << r;
      EXPECT_EQ(part(got[r], kW, kB), part(b, kW, kB)) << c.what << ", rank " << r;
      EXPECT_EQ(got[r].back(), want[r].back()) << c.what << ", rank " << r;
    }
  }
}

TEST(FusedReductionTest, AReduceDtypeOtherThanF32OrBf16IsRefused) {
  std::string text = Bf16AdamTail();
  for (size_t at = text.find("DTYPE_BF16"); at != std::string::npos;
       at = text.find("DTYPE_BF16", at + 1)) {
    text.replace(at, 10, "DTYPE_I32");
  }
  EXPECT_THAT(std::string(CompileError(text).message()),
              ::testing::HasSubstr("OP_ADAM_UPDATE: reduce_dtype i32; expected f32 or bf16"));
}

}  // namespace
}  // namespace meshrun
