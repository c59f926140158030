// An Adam update whose operands are replicated over a mesh axis (OP_ADAM_UPDATE with axis_names)
// is split among the replicas that reach each other's memory: each computes its part and stores
// it into every replica's results (DirectSplitUpdate), so each reads only its part of the inputs.
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/collectives/in_process_transport.h"
#include "core/optim/adamw.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "worker/executor.h"

namespace meshrun {
namespace {

constexpr int64_t kElems = 10;  // not divisible by 4: segments of 3, 3, 2, 2

std::string AdamProgram(bool replicated) {
  std::string buffers;
  for (const char* b : {"p", "g", "m", "v", "p2", "m2", "v2"}) {
    buffers +=
        absl::StrCat("buffers { name: '", b, "' dtype: DTYPE_F32 shape { dims: ", kElems, " } }\n");
  }
  return absl::StrCat(
      buffers, "buffers { name: 'step' dtype: DTYPE_F32 shape { } }\n",
      "functions { name: 'main' ops { kind: OP_ADAM_UPDATE inputs: 'p' inputs: 'g' inputs: 'm' ",
      "inputs: 'v' inputs: 'step' outputs: 'p2' outputs: 'm2' outputs: 'v2' ",
      "adamw { learning_rate: 0.5 b1: 0.9 b2: 0.999 eps: 1e-8 } ",
      replicated ? "axis_names: 'data' " : "", "} }");
}

// Runs the program on 4 replicas over ('data': 4) whose operands differ on purpose (rank r's
// gradient is r + 1 and its first moment r / 2 everywhere, p = v = 0), and returns each rank's p2.
std::vector<std::vector<float>> RunOnFourRanks(bool replicated) {
  v1::StepProgram program;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(AdamProgram(replicated), &program));
  Mesh mesh = *Mesh::Parse("data=4");
  std::vector<std::unique_ptr<Transport>> transports = CreateInProcessTransports(4);
  std::vector<std::vector<float>> p2(4);
  std::vector<std::thread> threads;
  for (int r = 0; r < 4; ++r) {
    threads.emplace_back([&, r] {
      Executor::Options o;
      o.mesh = &mesh;
      o.rank = r;
      o.transport = transports[r].get();
      o.collectives.direct_min_bytes = 1;
      absl::StatusOr<std::unique_ptr<Executor>> e = Executor::Create(program, o);
      ASSERT_TRUE(e.ok()) << e.status();
      Tensor g(v1::DTYPE_F32, {kElems});
      std::fill_n(g.data<float>(), kElems, static_cast<float>(r + 1));
      Tensor m(v1::DTYPE_F32, {kElems});
      std::fill_n(m.data<float>(), kElems, 0.5f * r);
      ASSERT_TRUE((*e)->BindInput("g", g).ok());
      ASSERT_TRUE((*e)->BindInput("m", m).ok());
      absl::Status s = (*e)->Run("main", RunContext{});
      ASSERT_TRUE(s.ok()) << s;
      const Tensor& out = *(*e)->buffer("p2");
      p2[r].assign(out.data<float>(), out.data<float>() + kElems);
    });
  }
  for (auto& t : threads) t.join();
  return p2;
}

// What rank r's own Adam step makes of its gradient.
float OwnUpdate(int r) {
  AdamWHyperParams hp;
  hp.learning_rate = 0.5f;
  hp.b1 = 0.9f;
  hp.b2 = 0.999f;
  hp.eps = 1e-8f;
  hp.weight_decay = 0.0f;
  float p = 0, g = static_cast<float>(r + 1), m = 0.5f * r, v = 0;
  AdamWUpdate(hp, 1, &p, &g, &m, &v, 1);
  return p;
}

TEST(SplitUpdateTest, EachReplicaComputesItsSegmentAndStoresItIntoEveryReplicasResults) {
  for (int r = 1; r < 4; ++r)
    ASSERT_NE(OwnUpdate(r), OwnUpdate(0)) << "the ranks must be told apart";
  const std::vector<std::vector<float>> p2 = RunOnFourRanks(/*replicated=*/true);
  // Segment r (elements [0,3), [3,6), [6,8), [8,10)) comes from rank r on every rank: proof that
  // the work was split (with replicated inputs, as programs guarantee, it is the same bits).
  const int owner[kElems] = {0, 0, 0, 1, 1, 1, 2, 2, 3, 3};
  for (int r = 0; r < 4; ++r) {
    for (int64_t i = 0; i < kElems; ++i) {
      EXPECT_EQ(p2[r][i], OwnUpdate(owner[i])) << "rank " << r << " element " << i;
    }
  }
}

TEST(SplitUpdateTest, WithoutReplicaAxesEveryRankUpdatesAllOfItsOwn) {
  const std::vector<std::vector<float>> p2 = RunOnFourRanks(/*replicated=*/false);
  for (int r = 0; r < 4; ++r) EXPECT_THAT(p2[r], ::testing::Each(OwnUpdate(r))) << "rank " << r;
}

}  // namespace
}  // namespace meshrun
