// Executor: a fused element-wise op (a jaxpr-derived optimizer update, as cluster.jit's Adam
// fuses) writes its results over the donated inputs it replaces, as XLA reuses a donated
// buffer, and over nothing a later op still reads.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "worker/executor.h"

namespace meshrun {
namespace {

using ::testing::ElementsAre;
using ::testing::FloatEq;

std::vector<float> Values(const Tensor& t) {
  return {t.data<float>(), t.data<float>() + t.num_elements()};
}

Tensor Vector(std::vector<float> v) {
  Tensor t(v1::DTYPE_F32, {static_cast<int64_t>(v.size())});
  for (size_t i = 0; i < v.size(); ++i) t.data<float>()[i] = v[i];
  return t;
}

// p2 = p - g * lr, mu2 = mu * lr + g (inputs g, p, mu, lr; rows 4.. the fused ops' results);
// with `read_mu_after`, a later op reads mu.
v1::StepProgram SgdProgram(bool read_mu_after) {
  std::string text;
  for (const char* name : {"p", "mu", "g", "p2", "mu2", "seen"})
    absl::StrAppend(&text, "buffers { name: '", name, "' dtype: DTYPE_F32 shape { dims: 4 } } ");
  absl::StrAppend(&text,
                  "buffers { name: 'lr' dtype: DTYPE_F32 shape {} } functions { name: 'main' ",
                  "ops { kind: OP_FUSED_ELEMENTWISE inputs: 'g' inputs: 'p' inputs: 'mu' ",
                  "inputs: 'lr' fused { fn: 'mul' args: 0 args: 3 } ",
                  "fused { fn: 'sub' args: 1 args: 4 } fused { fn: 'mul' args: 2 args: 3 } ",
                  "fused { fn: 'add' args: 6 args: 0 } fused_outputs: 1 fused_outputs: 3 ",
                  "outputs: 'p2' outputs: 'mu2' } ");
  if (read_mu_after)
    absl::StrAppend(&text, "ops { kind: OP_UNARY fn: 'abs' inputs: 'mu' outputs: 'seen' } ");
  absl::StrAppend(&text, "}");
  v1::StepProgram program;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &program));
  return program;
}

TEST(ExecutorDonationTest, AFusedUpdateWritesOverDonatedInputsThatNoLaterOpReads) {
  for (const bool read_mu_after : {false, true}) {
    for (const bool donate : {false, true}) {
      SCOPED_TRACE(absl::StrCat(donate ? "donated" : "not donated",
                                read_mu_after ? ", mu read after the update" : ""));
      absl::StatusOr<std::unique_ptr<Executor>> ex =
          Executor::Create(SgdProgram(read_mu_after), Executor::Options{});
      ASSERT_TRUE(ex.ok()) << ex.status();
      // 64 elements would take the compiled loop; 4 take the interpreter, whose in-place path
      // is the one that must read each element before writing it.
      Tensor p = Vector({1, -2, 3, -4}), mu = Vector({0.5f, 0.25f, 0, 1}),
             g = Vector({1, 1, -1, 2}), lr(v1::DTYPE_F32, {});
      lr.data<float>()[0] = 0.5f;
      ASSERT_TRUE((*ex)->BindInput("p", p, donate).ok());
      ASSERT_TRUE((*ex)->BindInput("mu", mu, donate).ok());
      ASSERT_TRUE((*ex)->BindInput("g", g).ok());  // the batch's gradient: kept
      ASSERT_TRUE((*ex)->BindInput("lr", lr).ok());
      ASSERT_TRUE((*ex)->Run("main", RunContext{}).ok());
      const void* p2 = (*ex)->buffer("p2")->raw();
      const void* mu2 = (*ex)->buffer("mu2")->raw();
      EXPECT_EQ(p2 == p.raw(), donate) << "p2 over p only when p is donated";
      EXPECT_EQ(mu2 == mu.raw(), donate && !read_mu_after)
          << "mu2 over mu only when mu is donated and nothing reads mu later";
      EXPECT_NE(p2, g.raw()) << "never over a kept argument";
      EXPECT_NE(mu2, g.raw());
      EXPECT_NE(p2, mu2);
      EXPECT_THAT(Values(*(*ex)->TakeOutput("p2")),
                  ElementsAre(FloatEq(0.5f), FloatEq(-2.5f), FloatEq(3.5f), FloatEq(-5)));
      EXPECT_THAT(Values(*(*ex)->TakeOutput("mu2")),
                  ElementsAre(FloatEq(1.25f), FloatEq(1.125f), FloatEq(-1), FloatEq(2.5f)));
      if (read_mu_after) {
        EXPECT_THAT(Values(*(*ex)->TakeOutput("seen")), ElementsAre(0.5f, 0.25f, 0, 1))
            << "the later reader sees mu before the update";
      }
      if (!donate) {
        EXPECT_THAT(Values(p), ElementsAre(1, -2, 3, -4)) << "a kept argument is never written";
        EXPECT_THAT(Values(mu), ElementsAre(0.5f, 0.25f, 0, 1));
      }
    }
  }
}

// Found by worker_fuzz: planning which buffers a fused op may write over must not look up a
// buffer the program does not declare; the op is refused by name instead.
TEST(ExecutorDonationTest, AFusedOpOverAnUndeclaredBufferIsRefused) {
  for (const char* missing : {"inputs: 'zz' inputs: 'p'", "inputs: 'p' inputs: 'zz'"}) {
    for (const char* out : {"p2", "zz2"}) {
      v1::StepProgram program;
      ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(
          absl::StrCat("buffers { name: 'p' dtype: DTYPE_F32 shape { dims: 4 } } ",
                       "buffers { name: 'p2' dtype: DTYPE_F32 shape { dims: 4 } } ",
                       "functions { name: 'main' ops { kind: OP_FUSED_ELEMENTWISE ", missing,
                       " fused { fn: 'add' args: 0 args: 1 } fused_outputs: 0 outputs: '", out,
                       "' } }"),
          &program));
      absl::StatusOr<std::unique_ptr<Executor>> ex = Executor::Create(program, Executor::Options{});
      ASSERT_FALSE(ex.ok()) << missing << " -> " << out;
      EXPECT_THAT(std::string(ex.status().message()), ::testing::HasSubstr("zz"));
    }
  }
}

}  // namespace
}  // namespace meshrun
