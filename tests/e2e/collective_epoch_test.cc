// Collective epochs through real clusters: a collective that only part of its group reached is
// aborted, and every later collective returns the right result, never one that sums or copies
// what the aborted call left in flight (over the gRPC ring, the shared-memory rings and the
// single-copy path through peers' memory).
#include <signal.h>

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/spmd/shard_map.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "meshrun/client.h"
#include "meshrun/local_cluster.h"
#include "tests/testutil/cluster.h"

namespace meshrun {
namespace {

using ::testing::HasSubstr;

constexpr int kRanks = 4;

// One collective under test: applies it to this rank's piece (`n` elements) in `sm`, and computes
// the expected global result on the host from every rank's piece.
struct CollectiveCase {
  std::string name;
  std::function<ShardMapBuilder::Value(ShardMapBuilder&, ShardMapBuilder::Value)> apply;
  PartitionSpec out_spec;
  std::function<std::vector<float>(const std::vector<std::vector<float>>&)> expected;
};

std::vector<CollectiveCase> Cases() {
  const PartitionSpec over_i = PartitionSpec::Of({"i"});
  std::vector<CollectiveCase> cases;
  cases.push_back({"psum",
                   [](ShardMapBuilder& sm, ShardMapBuilder::Value v) { return sm.Psum(v, {"i"}); },
                   PartitionSpec(),
                   [](const std::vector<std::vector<float>>& pieces) {
                     std::vector<float> sum(pieces[0].size(), 0.0f);
                     for (const auto& p : pieces)
                       for (size_t k = 0; k < p.size(); ++k) sum[k] += p[k];
                     return sum;
                   }});
  cases.push_back({"all_gather",
                   [](ShardMapBuilder& sm, ShardMapBuilder::Value v) {
                     return sm.AllGather(v, {"i"}, 0, true);
                   },
                   PartitionSpec(),
                   [](const std::vector<std::vector<float>>& pieces) {
                     std::vector<float> all;
                     for (const auto& p : pieces) all.insert(all.end(), p.begin(), p.end());
                     return all;
                   }});
  cases.push_back({"psum_scatter",
                   [](ShardMapBuilder& sm, ShardMapBuilder::Value v) {
                     return sm.PsumScatter(v, {"i"}, 0, true);
                   },
                   over_i,
                   [](const std::vector<std::vector<float>>& pieces) {
                     std::vector<float> sum(pieces[0].size(), 0.0f);
                     for (const auto& p : pieces)
                       for (size_t k = 0; k < p.size(); ++k) sum[k] += p[k];
                     return sum;  // block r of the result is block r of the sum
                   }});
  cases.push_back({"ppermute",
                   [](ShardMapBuilder& sm, ShardMapBuilder::Value v) {
                     return sm.Ppermute(v, {"i"}, {{0, 1}, {1, 2}, {2, 3}, {3, 0}});
                   },
                   over_i,
                   [](const std::vector<std::vector<float>>& pieces) {
                     std::vector<float> out;
                     for (int r = 0; r < kRanks; ++r) {
                       const auto& from = pieces[(r + kRanks - 1) % kRanks];
                       out.insert(out.end(), from.begin(), from.end());
                     }
                     return out;
                   }});
  cases.push_back(
      {"all_to_all",
       [](ShardMapBuilder& sm, ShardMapBuilder::Value v) { return sm.AllToAll(v, {"i"}, 0, 0); },
       over_i,
       [](const std::vector<std::vector<float>>& pieces) {
         // Rank r receives chunk r of every rank's piece, in rank order.
         const size_t chunk = pieces[0].size() / kRanks;
         std::vector<float> out;
         for (int r = 0; r < kRanks; ++r)
           for (int q = 0; q < kRanks; ++q)
             out.insert(out.end(), pieces[q].begin() + r * chunk,
                        pieces[q].begin() + (r + 1) * chunk);
         return out;
       }});
  return cases;
}

struct Transport {
  const char* name;
  bool shm;
  // Elements per rank. Over 64K (f32: more than the 256 KiB up to which a psum is a butterfly of
  // messages), every collective here is single-copy among co-located ranks.
  int64_t piece;
  // > 1: the gRPC ring stripes every message of 8 bytes or more over up to this many streams.
  int stripes = 1;
  std::vector<std::string> WorkerFlags() const {
    if (stripes <= 1) return {};
    return {absl::StrCat("--grpc_stripes=", stripes), "--grpc_stripe_bytes=8"};
  }
};

void PrintTo(const Transport& t, std::ostream* os) { *os << t.name; }

class CollectiveEpochTest : public ::testing::TestWithParam<Transport> {};

// Each rank holds a block of 2 * piece distinct values of x (PartitionSpec('i')). The aborted
// program slices piece number AxisIndex out of its block, so ranks 2 and 3 fail before the
// collective while ranks 0 and 1 enter it (and send) with values offset by 1e6; the valid
// program runs the same collective on the first piece of every block.
TEST_P(CollectiveEpochTest, AValidCollectiveAfterAnAbortedOneIsRight) {
  const Transport t = GetParam();
  auto cluster = testing::StartCluster("i=4", absl::StrCat("epoch_", t.name), t.shm,
                                       /*process_checks=*/true, t.WorkerFlags());
  ASSERT_NE(cluster, nullptr);
  auto client = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(client.ok()) << client.status();
  const Mesh mesh = *Mesh::Parse("i=4");
  const int64_t block = 2 * t.piece;
  Tensor x(v1::DTYPE_F32, {kRanks * block});
  for (int64_t k = 0; k < x.num_elements(); ++k)
    x.data<float>()[k] = static_cast<float>(k % 4099 + k / 4099);
  ASSERT_TRUE((*client)->Put(x, PartitionSpec::Of({"i"}), "x").ok());
  std::vector<std::vector<float>> pieces(kRanks);
  for (int r = 0; r < kRanks; ++r)
    pieces[r].assign(x.data<float>() + r * block, x.data<float>() + r * block + t.piece);

  for (const CollectiveCase& c : Cases()) {
    SCOPED_TRACE(c.name);
    for (int round = 0; round < 2; ++round) {
      ShardMapBuilder bad(mesh);
      auto bx = bad.Input(v1::DTYPE_F32, {kRanks * block}, PartitionSpec::Of({"i"}));
      auto mine =
          bad.DynamicSliceInDim(bx, bad.AxisIndex({"i"}), t.piece, 0);  // pieces 2, 3 do not exist
      bad.Output(c.apply(bad, bad.Add(mine, bad.Full(v1::DTYPE_F32, {t.piece}, 1e6))), c.out_spec);
      auto failed = (*client)->ShardMap(*bad.Build(), {"x"}, {}, absl::Seconds(20));
      ASSERT_FALSE(failed.ok());
      EXPECT_THAT(std::string(failed.status().message()),
                  HasSubstr("shard_map failed on ranks 2, 3"));

      ShardMapBuilder good(mesh);
      auto gx = good.Input(v1::DTYPE_F32, {kRanks * block}, PartitionSpec::Of({"i"}));
      good.Output(c.apply(good, good.Slice(gx, {0}, {t.piece})), c.out_spec);
      auto outs = (*client)->ShardMap(*good.Build(), {"x"});
      ASSERT_TRUE(outs.ok()) << outs.status();
      auto got = (*client)->Get((*outs)[0].id());
      ASSERT_TRUE(got.ok()) << got.status();
      const std::vector<float> want = c.expected(pieces);
      ASSERT_EQ(got->num_elements(), static_cast<int64_t>(want.size()));
      int64_t wrong = 0, first_wrong = -1;
      for (size_t k = 0; k < want.size(); ++k) {
        if (got->data<float>()[k] != want[k]) {
          if (first_wrong < 0) first_wrong = static_cast<int64_t>(k);
          ++wrong;
        }
      }
      EXPECT_EQ(wrong, 0) << "round " << round << ": first wrong element " << first_wrong
                          << ": got " << (first_wrong >= 0 ? got->data<float>()[first_wrong] : 0)
                          << ", want " << (first_wrong >= 0 ? want[first_wrong] : 0);
      ASSERT_TRUE((*client)->Delete((*outs)[0].id()).ok());
    }
  }
  ASSERT_TRUE(cluster->Stop().ok());
}

// The timeout variant: rank 3 is stopped (SIGSTOP) while the others enter a psum with a 1 s
// deadline; they time out, and rank 3, continued, runs its part of that psum late and sends its
// contributions. The next psum, in the new epoch, must sum only the new contributions. The
// coordinator does not look at the processes (--process_checks=false), as with a worker on
// another host: the collectives' deadline, not the coordinator, ends the psum.
class CollectiveEpochTimeoutTest : public ::testing::TestWithParam<Transport> {};

TEST_P(CollectiveEpochTimeoutTest, AfterAStoppedRankTimesOutTheNextCollectiveIsRight) {
  const Transport t = GetParam();
  auto cluster = testing::StartCluster("i=4", absl::StrCat("epoch_timeout_", t.name), t.shm,
                                       /*process_checks=*/false, t.WorkerFlags());
  ASSERT_NE(cluster, nullptr);
  auto client = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(client.ok()) << client.status();
  const Mesh mesh = *Mesh::Parse("i=4");
  Tensor x(v1::DTYPE_F32, {kRanks * 4});
  for (int64_t k = 0; k < x.num_elements(); ++k) x.data<float>()[k] = static_cast<float>(k + 1);
  ASSERT_TRUE((*client)->Put(x, PartitionSpec::Of({"i"}), "x").ok());
  auto psum_program = [&](float offset) {
    ShardMapBuilder sm(mesh);
    auto v = sm.Input(v1::DTYPE_F32, {kRanks * 4}, PartitionSpec::Of({"i"}));
    sm.Output(sm.Psum(sm.Add(v, sm.Full(v1::DTYPE_F32, {4}, offset)), {"i"}), PartitionSpec());
    return *sm.Build();
  };
  const pid_t stopped = cluster->worker_pids()[3];
  ASSERT_EQ(kill(stopped, SIGSTOP), 0);
  absl::StatusOr<std::vector<v1::ArrayInfo>> late;
  std::thread call(
      [&] { late = (*client)->ShardMap(psum_program(1e6), {"x"}, {}, absl::Seconds(1)); });
  absl::SleepFor(absl::Seconds(3));  // the others time out meanwhile
  ASSERT_EQ(kill(stopped, SIGCONT), 0);
  call.join();
  ASSERT_FALSE(late.ok());
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded) << late.status();
  // The straggler ledger names who never arrived and how long the others waited.
  auto status = (*client)->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  int stopped_rank = -1;
  for (const auto& w : status->workers()) {
    if (w.peer().pid() == stopped) stopped_rank = w.peer().rank();
  }
  EXPECT_THAT(late.status().message(),
              HasSubstr(absl::StrCat("waited 1 s in a collective for ranks ", stopped_rank,
                                     ", which had not arrived")))
      << std::string(late.status().message());

  for (int round = 0; round < 3; ++round) {
    auto outs = (*client)->ShardMap(psum_program(0), {"x"});
    ASSERT_TRUE(outs.ok()) << "round " << round << ": " << outs.status();
    auto got = (*client)->Get((*outs)[0].id());
    ASSERT_TRUE(got.ok()) << got.status();
    for (int k = 0; k < 4; ++k) {
      float want = 0;
      for (int r = 0; r < kRanks; ++r) want += x.data<float>()[r * 4 + k];
      EXPECT_EQ(got->data<float>()[k], want) << "round " << round << ", element " << k;
    }
    ASSERT_TRUE((*client)->Delete((*outs)[0].id()).ok());
  }
  ASSERT_TRUE(cluster->Stop().ok());
}

INSTANTIATE_TEST_SUITE_P(
    Transports, CollectiveEpochTest,
    ::testing::Values(Transport{"grpc", false, 8}, Transport{"grpc_striped", false, 8, 3},
                      Transport{"shm", true, 8}, Transport{"single_copy", true, 65536 + 4}),
    [](const ::testing::TestParamInfo<Transport>& info) { return info.param.name; });

INSTANTIATE_TEST_SUITE_P(Transports, CollectiveEpochTimeoutTest,
                         ::testing::Values(Transport{"grpc", false, 8},
                                           Transport{"grpc_striped", false, 8, 3},
                                           Transport{"shm", true, 8}),
                         [](const ::testing::TestParamInfo<Transport>& info) {
                           return info.param.name;
                         });

// Two clients running programs with collectives at the same time: the coordinator runs one at a
// time, so every rank runs them in the same order and each psum sums its own program's values.
TEST(ConcurrentClientsTest, TwoClientsRunningCollectivesAtOnceGetTheirOwnSums) {
  auto cluster = testing::StartCluster("i=4", "concurrent_clients", /*shm=*/true);
  ASSERT_NE(cluster, nullptr);
  const Mesh mesh = *Mesh::Parse("i=4");
  auto setup = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(setup.ok()) << setup.status();
  Tensor x(v1::DTYPE_F32, {kRanks * 4});
  for (int64_t k = 0; k < x.num_elements(); ++k) x.data<float>()[k] = static_cast<float>(k + 1);
  ASSERT_TRUE((*setup)->Put(x, PartitionSpec::Of({"i"}), "x").ok());
  constexpr int kRuns = 12;
  std::vector<std::string> errors(2);
  std::vector<std::thread> clients;
  for (int c = 0; c < 2; ++c) {
    clients.emplace_back([&, c] {
      auto client = Client::Connect(cluster->coordinator_address());
      if (!client.ok()) {
        errors[c] = std::string(client.status().message());
        return;
      }
      for (int run = 0; run < kRuns && errors[c].empty(); ++run) {
        const float offset = 1000.0f * (c + 1) + run;  // this client's and run's own values
        ShardMapBuilder sm(mesh);
        auto v = sm.Input(v1::DTYPE_F32, {kRanks * 4}, PartitionSpec::Of({"i"}));
        sm.Output(sm.Psum(sm.Add(v, sm.Full(v1::DTYPE_F32, {4}, offset)), {"i"}), PartitionSpec());
        auto outs = (*client)->ShardMap(*sm.Build(), {"x"}, {}, absl::Seconds(10));
        if (!outs.ok()) {
          errors[c] = absl::StrCat("run ", run, ": ", outs.status().message());
          break;
        }
        auto got = (*client)->Get((*outs)[0].id());
        (*client)->Delete((*outs)[0].id()).IgnoreError();
        if (!got.ok()) {
          errors[c] = absl::StrCat("run ", run, ": ", got.status().message());
          break;
        }
        for (int k = 0; k < 4; ++k) {
          float want = kRanks * offset;  // sum over ranks of x[r * 4 + k] + offset
          for (int r = 0; r < kRanks; ++r) want += static_cast<float>(r * 4 + k + 1);
          if (got->data<float>()[k] != want) {
            errors[c] = absl::StrCat("run ", run, " element ", k, ": got ", got->data<float>()[k],
                                     ", want ", want);
            break;
          }
        }
      }
    });
  }
  for (auto& t : clients) t.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

}  // namespace
}  // namespace meshrun
