#include "worker/combine_reductions.h"

#include <functional>
#include <set>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/collectives/in_process_transport.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "tests/worker/two_ranks.h"
#include "worker/executor.h"

namespace meshrun {
namespace {

using ::testing::ElementsAre;

// Two psums and a pmean of small arrays; `r` needs s1 before the program ends.
constexpr char kProgram[] = R"pb(
  buffers {
    name: "x"
    dtype: DTYPE_F32
    shape { dims: 3 }
  }
  buffers {
    name: "y"
    dtype: DTYPE_F32
    shape { dims: 2 }
  }
  buffers {
    name: "z"
    dtype: DTYPE_F32
    shape { dims: 4 }
  }
  buffers {
    name: "s1"
    dtype: DTYPE_F32
    shape { dims: 3 }
  }
  buffers {
    name: "m1"
    dtype: DTYPE_F32
    shape { dims: 2 }
  }
  buffers {
    name: "s2"
    dtype: DTYPE_F32
    shape { dims: 4 }
  }
  buffers {
    name: "r"
    dtype: DTYPE_F32
    shape { dims: 3 }
  }
  functions {
    name: "main"
    ops { kind: OP_PSUM inputs: "x" outputs: "s1" axis_names: "data" }
    ops { kind: OP_PMEAN inputs: "y" outputs: "m1" axis_names: "data" }
    ops { kind: OP_PSUM inputs: "z" outputs: "s2" axis_names: "data" }
    ops { kind: OP_UNARY fn: "neg" inputs: "s1" outputs: "r" }
  }
)pb";

v1::StepProgram Parse() {
  v1::StepProgram p;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(kProgram, &p));
  return p;
}

TEST(CombineReductionsTest, ReductionsOverOneAxisRunTogetherBeforeTheirFirstReader) {
  v1::StepProgram p = Parse();
  CombineReductions(&p, 256 << 10, 256 << 10);
  const auto& ops = p.functions(0).ops();
  ASSERT_EQ(ops.size(), 2);
  EXPECT_EQ(ops[0].kind(), v1::OP_PSUM);  // all three side by side, before neg reads s1
  EXPECT_THAT(ops[0].inputs(), ElementsAre("x", "y", "z"));
  EXPECT_THAT(ops[0].outputs(), ElementsAre("s1", "m1", "s2"));
  EXPECT_EQ(ops[0].fn(), "sms");  // y's is a mean
  EXPECT_EQ(ops[1].kind(), v1::OP_UNARY);

  v1::StepProgram off = Parse();
  CombineReductions(&off, 0, 256 << 10);
  EXPECT_EQ(off.functions(0).ops_size(), 4);
  v1::StepProgram large = Parse();
  CombineReductions(&large, 12, 256 << 10);  // only y (8 bytes) is below 12: alone, as it was
  EXPECT_EQ(large.functions(0).ops_size(), 4);
  EXPECT_EQ(large.functions(0).ops(3).kind(), v1::OP_PMEAN);  // delayed to the end
  EXPECT_EQ(large.functions(0).ops(3).fn(), "");
}

TEST(CombineReductionsTest, TheCombinedProgramComputesWhatTheOriginalDoes) {
  for (const size_t combine : {size_t{0}, size_t{256} << 10}) {
    CollectiveOptions collectives;
    collectives.combine_max_bytes = combine;
    const std::vector<std::vector<float>> got =
        RunOnTwoRanks(Parse(), collectives, {"x", "y", "z"},
                      [](const std::string&, int r, int64_t i) { return 10.0f * r + i + 1; },
                      {"s1", "m1", "s2", "r"});
    // s1 = x0 + x1, m1 = mean(y), s2 = z0 + z1, r = -s1; element i of rank r's inputs is
    // 10 r + i + 1.
    for (int r = 0; r < 2; ++r) {
      EXPECT_THAT(got[r], ElementsAre(12, 14, 16, 6, 7, 12, 14, 16, 18, -12, -14, -16))
          << "combine_max_bytes " << combine << ", rank " << r;
    }
  }
}

// A psum of a psum's result (shard_map bodies hold them: JAX's pvary transposes to one) waits
// for it: combined into one bucket, the second would read the first's result before it exists.
TEST(CombineReductionsTest, AReductionOfAReductionsResultRunsAfterIt) {
  v1::StepProgram p = ParseText(
      "buffers { name: 'x' dtype: DTYPE_F32 shape { dims: 3 } } "
      "buffers { name: 's1' dtype: DTYPE_F32 shape { dims: 3 } } "
      "buffers { name: 'y' dtype: DTYPE_F32 shape { dims: 2 } } "
      "buffers { name: 's2' dtype: DTYPE_F32 shape { dims: 2 } } "
      "buffers { name: 's3' dtype: DTYPE_F32 shape { dims: 3 } } "
      "functions { name: 'main' "
      "ops { kind: OP_PSUM inputs: 'x' outputs: 's1' axis_names: 'data' } "
      "ops { kind: OP_PSUM inputs: 'y' outputs: 's2' axis_names: 'data' } "
      "ops { kind: OP_PSUM inputs: 's1' outputs: 's3' axis_names: 'data' } }");
  v1::StepProgram combined = p;
  CombineReductions(&combined, 256 << 10, 256 << 10);
  const auto& ops = combined.functions(0).ops();
  ASSERT_EQ(ops.size(), 2);
  EXPECT_THAT(ops[0].inputs(), ElementsAre("x", "y"));
  EXPECT_THAT(ops[1].inputs(), ElementsAre("s1"));
  CollectiveOptions collectives;
  collectives.combine_max_bytes = 256 << 10;
  const std::vector<std::vector<float>> got = RunOnTwoRanks(
      p, collectives, {"x", "y"},
      [](const std::string&, int r, int64_t i) { return 10.0f * r + i + 1; }, {"s1", "s2", "s3"});
  // s1 = x0 + x1 = 12 + 2i, s2 likewise, s3 = 2 s1 (s1 is the same on both ranks).
  for (int r = 0; r < 2; ++r) EXPECT_THAT(got[r], ElementsAre(12, 14, 16, 12, 14, 24, 28, 32));
}

// An optimizer's element-wise update of a parameter replicated over "data" (37 elements: not a
// multiple of the segments), w' = w - lr * sum(g) and v' = v * sum(g): written as the psum and
// the update, or as the update that reduces its input 0 itself (core/spmd/fusion.h's
// FuseReductionsIntoUpdates); `fn`: "sum" or "mean".
std::string ElementwiseTail(bool fused, const std::string& fn) {
  std::string buffers;
  for (const char* name : {"w", "v", "g", "gs", "w2", "v2"}) {
    buffers += absl::StrCat("buffers { name: '", name, "' dtype: DTYPE_F32 shape { dims: 37 } }");
  }
  buffers += "buffers { name: 'lr' dtype: DTYPE_F32 shape {} } ";
  const std::string body =
      "fused { fn: 'mul' args: 0 args: 3 } fused { fn: 'sub' args: 1 args: 4 } "
      "fused { fn: 'mul' args: 2 args: 0 } fused_outputs: 1 fused_outputs: 2 "
      "outputs: 'w2' outputs: 'v2' ";
  if (fused) {
    return absl::StrCat(buffers, "functions { name: 'main' ops { kind: OP_FUSED_ELEMENTWISE ",
                        "inputs: 'g' inputs: 'w' inputs: 'v' inputs: 'lr' axis_names: 'data' ",
                        "fn: '", fn, "' ", body, "} }");
  }
  return absl::StrCat(buffers,
                      "functions { name: 'main' ops { kind: ", fn == "sum" ? "OP_PSUM" : "OP_PMEAN",
                      " inputs: 'g' outputs: 'gs' axis_names: 'data' } ",
                      "ops { kind: OP_FUSED_ELEMENTWISE inputs: 'gs' inputs: 'w' inputs: 'v' ",
                      "inputs: 'lr' ", body, "} }");
}

std::vector<std::vector<float>> RunElementwiseTail(const std::string& text, size_t combine,
                                                   size_t direct_min_bytes) {
  CollectiveOptions collectives;
  collectives.combine_max_bytes = combine;
  collectives.direct_min_bytes = direct_min_bytes;
  return RunOnTwoRanks(ParseText(text), collectives, {"w", "v", "g", "lr"},
                       [](const std::string& name, int r, int64_t i) {
                         if (name == "g") return (r + 1) * (2.5f - 0.3f * i) + 0.125f * r;
                         return name == "lr" ? 0.1f : 0.25f * i - 1;
                       },
                       {"w2", "v2"});
}

// The update that reduces its input itself gives the bits of the psum then the update: reduced
// and updated one segment per rank (single-copy), over the ring, and split back into a psum by
// CombineReductions when the input is small (then bucketed with other small reductions).
TEST(CombineReductionsTest, AnElementwiseUpdateThatReducesItsInputComputesWhatThePsumThenItDo) {
  for (const std::string fn : {"sum", "mean"}) {
    const std::vector<std::vector<float>> want =
        RunElementwiseTail(ElementwiseTail(false, fn), 0, 0);
    ASSERT_EQ(want[0].size(), 2 * 37);
    EXPECT_EQ(want[0], want[1]);
    const float g0 = 2.5f + (2 * 2.5f + 0.125f);  // element 0 of g over both ranks
    EXPECT_FLOAT_EQ(want[0][0], -1 - 0.1f * (fn == "sum" ? g0 : g0 / 2)) << fn;
    const struct {
      const char* what;
      size_t combine, direct_min_bytes;
    } cases[] = {{"single-copy", 0, 64}, {"over the ring", 0, 0}, {"split, bucketed", 1 << 20, 0}};
    for (const auto& c : cases) {
      const std::vector<std::vector<float>> got =
          RunElementwiseTail(ElementwiseTail(true, fn), c.combine, c.direct_min_bytes);
      for (int r = 0; r < 2; ++r)
        EXPECT_EQ(got[r], want[r]) << fn << ", " << c.what << ", rank " << r;
    }
  }
  v1::StepProgram split = ParseText(ElementwiseTail(true, "sum"));
  CombineReductions(&split, 1 << 20, 1 << 10);  // 148 bytes: below single-copy
  ASSERT_EQ(split.functions(0).ops_size(), 2);
  EXPECT_EQ(split.functions(0).ops(0).kind(), v1::OP_PSUM);
  EXPECT_EQ(split.functions(0).ops(1).axis_names_size(), 0);
  EXPECT_EQ(split.functions(0).ops(1).inputs(0), "g/reduced");
}

// Two updates that reduce the same small operand themselves (a comparison and a select over one
// partial sum, as jnp.where(s > t, s, t) gives) are each split into a reduction into a buffer of
// its own, and compute what the psum then the two updates do.
TEST(CombineReductionsTest, TwoUpdatesThatReduceTheSameOperandGetABufferEach) {
  const auto program = [](bool fused) {
    std::string text;
    for (const char* name : {"g", "gs", "a", "b"})
      text += absl::StrCat("buffers { name: '", name, "' dtype: DTYPE_F32 shape { dims: 5 } }");
    const std::string reduce = fused ? "axis_names: 'data' fn: 'sum' " : "";
    const std::string in = fused ? "g" : "gs";
    text += "functions { name: 'main' ";
    if (!fused) text += "ops { kind: OP_PSUM inputs: 'g' outputs: 'gs' axis_names: 'data' } ";
    for (const char* out : {"a", "b"}) {
      text += absl::StrCat("ops { kind: OP_FUSED_ELEMENTWISE inputs: '", in, "' ", reduce,
                           "fused { fn: '", out[0] == 'a' ? "mul" : "add",
                           "' args: 0 args: 0 } fused_outputs: 0 outputs: '", out, "' } ");
    }
    return ParseText(text + "}");
  };
  v1::StepProgram split = program(true);
  CombineReductions(&split, 1 << 20, 0);
  std::set<std::string> names;
  for (const v1::BufferDecl& d : split.buffers())
    EXPECT_TRUE(names.insert(d.name()).second) << d.name() << " is declared twice";
  EXPECT_THAT(names, ::testing::IsSupersetOf({"g/reduced", "g/reduced2"}));
  CollectiveOptions collectives;
  collectives.combine_max_bytes = 1 << 20;
  const auto value = [](const std::string&, int r, int64_t i) { return r + 0.5f * i; };
  const std::vector<std::vector<float>> got =
      RunOnTwoRanks(program(true), collectives, {"g"}, value, {"a", "b"});
  const std::vector<std::vector<float>> want =
      RunOnTwoRanks(program(false), collectives, {"g"}, value, {"a", "b"});
  ASSERT_EQ(want[0].size(), 10);
  EXPECT_FLOAT_EQ(want[0][6], 2 * (1 + 2 * 0.5f));  // b[1] = 2 * (g0[1] + g1[1])
  for (int r = 0; r < 2; ++r) EXPECT_EQ(got[r], want[r]) << "rank " << r;
}

// The loss's pmean next to a single-copy element-wise update rides with it (fn "sum:m"), and
// gives what the separate pmean gives, single-copy and over the ring.
TEST(CombineReductionsTest, SmallReductionsRideWithASingleCopyElementwiseUpdate) {
  auto with_loss = [](std::string text) {
    text.insert(text.find("functions {"),
                "buffers { name: 'l' dtype: DTYPE_F32 shape {} } "
                "buffers { name: 'lm' dtype: DTYPE_F32 shape {} } ");
    const std::string main = "functions { name: 'main' ";
    text.insert(text.find(main) + main.size(),
                "ops { kind: OP_PMEAN inputs: 'l' outputs: 'lm' axis_names: 'data' } ");
    return text;
  };
  v1::StepProgram p = ParseText(with_loss(ElementwiseTail(true, "sum")));
  CombineReductions(&p, 256 << 10, 64);
  const auto& ops = p.functions(0).ops();
  ASSERT_EQ(ops.size(), 1) << p.DebugString();
  EXPECT_EQ(ops[0].kind(), v1::OP_FUSED_ELEMENTWISE);
  EXPECT_EQ(ops[0].fn(), "sum:m");
  EXPECT_THAT(ops[0].inputs(), ElementsAre("g", "w", "v", "lr", "l"));
  EXPECT_THAT(ops[0].outputs(), ElementsAre("w2", "v2", "lm"));

  auto run = [](const std::string& text, size_t combine, size_t direct_min_bytes) {
    CollectiveOptions collectives;
    collectives.combine_max_bytes = combine;
    collectives.direct_min_bytes = direct_min_bytes;
    return RunOnTwoRanks(ParseText(text), collectives, {"w", "v", "g", "lr", "l"},
                         [](const std::string& name, int r, int64_t i) {
                           if (name == "g") return (r + 1) * (2.5f - 0.3f * i) + 0.125f * r;
                           if (name == "l") return 3.0f + r;
                           return name == "lr" ? 0.1f : 0.25f * i - 1;
                         },
                         {"w2", "v2", "lm"});
  };
  const std::vector<std::vector<float>> want = run(with_loss(ElementwiseTail(false, "sum")), 0, 0);
  ASSERT_EQ(want[0].size(), 2 * 37 + 1);
  EXPECT_FLOAT_EQ(want[0].back(), 3.5f);  // pmean(l)
  std::string joined;
  google::protobuf::TextFormat::PrintToString(p, &joined);
  for (const size_t direct_min_bytes : {size_t{64}, size_t{0}}) {
    const std::vector<std::vector<float>> got = run(joined, 0, direct_min_bytes);
    for (int r = 0; r < 2; ++r)
      EXPECT_EQ(got[r], want[r]) << "direct_min_bytes " << direct_min_bytes << ", rank " << r;
  }
}

}  // namespace
}  // namespace meshrun
