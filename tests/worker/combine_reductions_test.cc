#include "worker/combine_reductions.h"

#include <thread>

#include "core/collectives/in_process_transport.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
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
  const Mesh mesh = *Mesh::Parse("data=2");
  for (const size_t combine : {size_t{0}, size_t{256} << 10}) {
    std::vector<std::unique_ptr<Transport>> transports = CreateInProcessTransports(2);
    std::vector<std::vector<float>> got(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        Executor::Options o;
        o.mesh = &mesh;
        o.rank = r;
        o.transport = transports[r].get();
        o.collectives.combine_max_bytes = combine;
        o.results = {"s1", "m1", "s2", "r"};
        auto ex = Executor::Create(Parse(), o);
        ASSERT_TRUE(ex.ok()) << ex.status();
        for (const char* name : {"x", "y", "z"}) {
          Tensor t(v1::DTYPE_F32, (*ex)->buffer(name)->dims());
          for (int64_t i = 0; i < t.num_elements(); ++i) t.data<float>()[i] = 10 * r + i + 1;
          ASSERT_TRUE((*ex)->BindInput(name, t).ok());
        }
        ASSERT_TRUE((*ex)->Run("main", RunContext{}).ok());
        for (const char* name : {"s1", "m1", "s2", "r"}) {
          const Tensor* t = (*ex)->buffer(name);
          got[r].insert(got[r].end(), t->data<float>(), t->data<float>() + t->num_elements());
        }
      });
    }
    for (auto& t : threads) t.join();
    // s1 = x0 + x1, m1 = mean(y), s2 = z0 + z1, r = -s1; element i of rank r's inputs is
    // 10 r + i + 1.
    for (int r = 0; r < 2; ++r) {
      EXPECT_THAT(got[r], ElementsAre(12, 14, 16, 6, 7, 12, 14, 16, 18, -12, -14, -16))
          << "combine_max_bytes " << combine << ", rank " << r;
    }
  }
}

}  // namespace
}  // namespace meshrun
