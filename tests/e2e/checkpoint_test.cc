// Sharded checkpoints on real clusters: a TrainState saved under one layout and restored under
// others (and on another mesh) equals the original bit for bit; a run stopped, saved, restored
// and resumed produces the same losses as an uninterrupted one; corrupt, truncated and
// unknown-version checkpoints are rejected naming the array and file; uncommitted leftovers are
// ignored.
#include "core/checkpoint/checkpoint.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "meshrun/client.h"
#include "meshrun/local_cluster.h"
#include "meshrun/shard_map.h"
#include "meshrun/train_step.h"
#include "meshrun/workloads.h"
#include "tests/testutil/cluster.h"

namespace meshrun {
namespace {

namespace fs = std::filesystem;

TEST(CheckpointFormatTest, ManifestRoundTripsAndRejectsUnknownVersions) {
  checkpoint::Manifest m;
  m.step = 40;
  m.mesh = "Mesh('data': 2)";
  checkpoint::ArrayEntry a{"params/w", v1::DTYPE_F32, {4, 6}, PartitionSpec::Of({"data"}), {}};
  a.blocks.push_back({{0, 0}, {2, 6}, "shard-0.safetensors", "params/w@0,0", 128, 48, 7});
  a.blocks.push_back({{2, 0}, {2, 6}, "shard-1.safetensors", "params/w@2,0", 128, 48, 9});
  m.arrays.push_back(a);
  auto back = checkpoint::ParseManifest(checkpoint::ToJson(m));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->step, 40);
  ASSERT_NE(back->Find("params/w"), nullptr);
  EXPECT_EQ(back->Find("params/w")->spec, PartitionSpec::Of({"data"}));
  EXPECT_EQ(back->Find("params/w")->blocks[1].crc32, 9u);
  std::string json = checkpoint::ToJson(m);
  json.replace(json.find("\"format_version\": 1"), 19, "\"format_version\": 7");
  auto bad = checkpoint::ParseManifest(json);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(bad.status().message()), ::testing::HasSubstr("format_version 7"));
}

TEST(CheckpointFormatTest, CopyIntersectionMovesTheOverlap) {
  // src: rows 2..3 of a 4x4 array, dst: columns 1..2 of it.
  Tensor src(v1::DTYPE_F32, {2, 4}), dst(v1::DTYPE_F32, {4, 2});
  for (int i = 0; i < 8; ++i) src.data<float>()[i] = static_cast<float>(10 + i);
  checkpoint::CopyIntersection(src, {2, 0}, dst, {0, 1});
  const std::vector<float> want = {0, 0, 0, 0, 11, 12, 15, 16};
  EXPECT_EQ(std::vector<float>(dst.data<float>(), dst.data<float>() + 8), want);
}

class CheckpointE2ETest : public testing::MultiClusterSuite<CheckpointE2ETest> {
 public:
  static constexpr std::array<const char*, 3> kMeshes = {"data=2,model=4", "data=1,model=1",
                                                         "data=4"};
  static constexpr const char* kTag = "checkpoint";

 protected:
  void SetUp() override {
    MultiClusterSuite::SetUp();
    if (HasFatalFailure()) return;
    // Everything a test writes lives under base_: its checkpoint root and any copies.
    base_ = (fs::path(::testing::TempDir()) /
             absl::StrCat("ckpt-", ::testing::UnitTest::GetInstance()->current_test_info()->name()))
                .string();
    fs::remove_all(base_);
    root_ = base_ + "/root";
  }
  static TrainStep Step(const std::string& layout, const std::string& mesh) {
    auto w = SeedWorkload("dot_relu_dot");
    auto sharding = LayoutSharding(layout);
    auto step = BuildTrainStep(*Mesh::Parse(mesh), *sharding, w->optimizer, w->batch, w->loss, 0);
    EXPECT_TRUE(step.ok()) << step.status();
    return *step;
  }
  // Runs `n` steps of dot_relu_dot on `state`; returns the losses.
  static std::vector<float> Steps(Client& c, const TrainStep& step, TrainState& state, int n) {
    auto batch = SeedWorkloadBatch(*SeedWorkload("dot_relu_dot"));
    std::vector<std::string> ids;
    for (size_t i = 0; i < batch->size(); ++i)
      ids.push_back(c.Put((*batch)[i], step.batch[i].spec)->id());
    std::vector<float> losses;
    for (int i = 0; i < n; ++i) {
      auto loss = state.Step(ids);
      EXPECT_TRUE(loss.ok()) << loss.status();
      if (!loss.ok()) break;
      losses.push_back(*loss);
    }
    for (const auto& id : ids) c.Delete(id).IgnoreError();
    return losses;
  }

  std::string base_, root_;
};

void ExpectSameState(const TrainStep& step, const TrainState& a, const TrainState& b,
                     const std::string& what) {
  for (const PlannedArray& arr : step.state) {
    auto x = a.Get(arr.name);
    auto y = b.Get(arr.name);
    ASSERT_TRUE(x.ok() && y.ok()) << what << " " << arr.name;
    ASSERT_EQ(x->dims(), y->dims()) << what << " " << arr.name;
    EXPECT_EQ(std::memcmp(x->raw(), y->raw(), x->size_bytes()), 0)
        << what << ": " << arr.name << " differs";
  }
}

TEST_F(CheckpointE2ETest, SavedUnderDataParallelRestoresUnderOtherLayoutsAndMeshes) {
  const std::string mesh = "data=2,model=4";
  const TrainStep dp = Step("dp", mesh);
  auto state = TrainState::Init(&client(mesh), &dp, "dp_state");
  ASSERT_TRUE(state.ok()) << state.status();
  Steps(client(mesh), dp, *state, 3);
  auto path = state->Save(root_);
  ASSERT_TRUE(path.ok()) << path.status();
  EXPECT_EQ(*path, (fs::path(root_) / "step_00000003").string());
  // A replicated array is written once: the files hold one copy of the state, not eight.
  int64_t file_bytes = 0;
  for (const auto& e : fs::directory_iterator(*path))
    if (e.path().extension() == ".safetensors")
      file_bytes += static_cast<int64_t>(fs::file_size(e.path()));
  EXPECT_LT(file_bytes, dp.StateBytesPerWorker() + 64 * 1024);
  EXPECT_GE(file_bytes, dp.StateBytesPerWorker());
  for (const std::string layout : {"fsdp", "2d", "fsdp_tp"}) {
    const TrainStep other = Step(layout, mesh);
    auto restored = TrainState::Restore(&client(mesh), &other, *path, layout);
    ASSERT_TRUE(restored.ok()) << layout << ": " << restored.status();
    EXPECT_EQ(restored->steps(), 3);
    ExpectSameState(dp, *state, *restored, layout);
    // And back: saved under this layout, restored under DP, still the same values.
    auto again = restored->Save(root_ + "-" + layout);
    ASSERT_TRUE(again.ok()) << again.status();
    auto back = TrainState::Restore(&client(mesh), &dp, *again, layout + "_back");
    ASSERT_TRUE(back.ok()) << back.status();
    ExpectSameState(dp, *state, *back, layout + " -> dp");
    EXPECT_TRUE(restored->Delete().ok());
    EXPECT_TRUE(back->Delete().ok());
  }
  // On other meshes: one worker, and FSDP on 4 workers; the whole state, equal.
  for (const auto& [other_mesh, layout] :
       {std::pair<std::string, std::string>{"data=1,model=1", "single"},
        std::pair<std::string, std::string>{"data=4", "fsdp"}}) {
    const TrainStep other = Step(layout, other_mesh);
    auto there = TrainState::Restore(&client(other_mesh), &other, *path, "there");
    ASSERT_TRUE(there.ok()) << other_mesh << ": " << there.status();
    for (const PlannedArray& arr : dp.state) {
      auto x = state->Get(arr.name);
      auto y = there->Get(arr.name);
      ASSERT_TRUE(x.ok() && y.ok()) << other_mesh << " " << arr.name;
      EXPECT_EQ(std::memcmp(x->raw(), y->raw(), x->size_bytes()), 0)
          << other_mesh << ": " << arr.name;
    }
    EXPECT_TRUE(there->Delete().ok());
  }
  EXPECT_TRUE(state->Delete().ok());
}

TEST_F(CheckpointE2ETest, EachWorkerReadsOnlyItsBlocks) {
  const std::string mesh = "data=2,model=4";
  const TrainStep fsdp_tp = Step("fsdp_tp", mesh);
  auto state = TrainState::Init(&client(mesh), &fsdp_tp, "reads");
  ASSERT_TRUE(state.ok()) << state.status();
  auto path = state->Save(root_);
  ASSERT_TRUE(path.ok()) << path.status();
  v1::RestoreCheckpointRequest req;
  req.set_path(*path);
  for (const PlannedArray& a : fsdp_tp.state) {
    v1::CheckpointArray* c = req.add_arrays();
    c->set_name(a.name);
    c->set_id("reads2/" + a.name);
    *c->mutable_spec() = a.spec.ToProto();
  }
  auto resp = client(mesh).RestoreCheckpoint(req);
  ASSERT_TRUE(resp.ok()) << resp.status();
  // Same layout: every worker reads exactly its own block of every array, nothing more.
  EXPECT_EQ(resp->bytes_read(), fsdp_tp.StateBytesPerWorker() * 8);
  for (const auto& a : resp->arrays()) EXPECT_TRUE(client(mesh).Delete(a.id()).ok());
  EXPECT_TRUE(state->Delete().ok());
}

TEST_F(CheckpointE2ETest, ResumedRunEqualsUninterruptedRunBitForBit) {
  const std::string mesh = "data=2,model=4";
  const TrainStep step = Step("2d", mesh);
  auto straight = TrainState::Init(&client(mesh), &step, "straight");
  ASSERT_TRUE(straight.ok()) << straight.status();
  const std::vector<float> want = Steps(client(mesh), step, *straight, 80);
  ASSERT_EQ(want.size(), 80u);
  EXPECT_TRUE(straight->Delete().ok());

  auto first = TrainState::Init(&client(mesh), &step, "first");
  ASSERT_TRUE(first.ok()) << first.status();
  std::vector<float> got = Steps(client(mesh), step, *first, 40);
  ASSERT_TRUE(first->Save(root_, /*keep=*/1).ok());
  EXPECT_TRUE(first->Delete().ok());  // the first run is gone; only the checkpoint remains
  auto latest = checkpoint::LatestCheckpoint(root_);
  ASSERT_TRUE(latest.ok()) << latest.status();
  auto resumed = TrainState::Restore(&client(mesh), &step, *latest, "resumed");
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_EQ(resumed->steps(), 40);
  const std::vector<float> rest = Steps(client(mesh), step, *resumed, 40);
  got.insert(got.end(), rest.begin(), rest.end());
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(std::memcmp(&got[i], &want[i], sizeof(float)), 0)
        << "step " << i << ": " << got[i] << " vs " << want[i];
  }
  const absl::Status deleted = resumed->Delete();
  EXPECT_TRUE(deleted.ok()) << deleted;
}

TEST_F(CheckpointE2ETest, AsyncSaveWritesTheStateOfTheCallWhileStepsGoOn) {
  const std::string mesh = "data=2,model=4";
  const TrainStep step = Step("fsdp", mesh);
  auto state = TrainState::Init(&client(mesh), &step, "async");
  ASSERT_TRUE(state.ok()) << state.status();
  Steps(client(mesh), step, *state, 5);
  ASSERT_TRUE(state->SaveAsync(root_).ok());
  const std::vector<float> after = Steps(client(mesh), step, *state, 5);  // while it writes
  ASSERT_TRUE(state->SaveAsync(root_).ok());                              // waits for the first
  auto second = state->WaitForSave();
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(checkpoint::ListCheckpoints(root_).size(), 2u);
  // The first save holds step 5's state, not a later one: resuming from it replays steps 6..10.
  auto resumed = TrainState::Restore(&client(mesh), &step,
                                     (fs::path(root_) / "step_00000005").string(), "again");
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_EQ(resumed->steps(), 5);
  const std::vector<float> replay = Steps(client(mesh), step, *resumed, 5);
  ASSERT_EQ(replay.size(), after.size());
  for (size_t i = 0; i < after.size(); ++i) EXPECT_EQ(replay[i], after[i]) << "step " << 6 + i;
  EXPECT_TRUE(resumed->Delete().ok());
  EXPECT_TRUE(state->Delete().ok());
}

// An array a program returns as is (SaveAsync's snapshot is such an identity shard_map) is a
// copy: the next step, which donates the state and writes Adam's results over it in place, leaves
// it as it was.
TEST_F(CheckpointE2ETest, AnArrayReturnedAsIsIsNotOverwrittenByADonatingStep) {
  const std::string mesh = "data=2,model=4";
  const TrainStep step = Step("fsdp", mesh);
  auto state = TrainState::Init(&client(mesh), &step, "returned");
  ASSERT_TRUE(state.ok()) << state.status();
  Steps(client(mesh), step, *state, 2);
  ShardMapBuilder copy(step.mesh);
  std::vector<std::string> ids, copy_ids;
  for (const PlannedArray& a : step.state) {
    copy.Output(copy.Input(a.dtype, a.shape, a.spec), a.spec);
    ids.push_back(state->Id(a.name));
    copy_ids.push_back(state->Id("copy/" + a.name));
  }
  auto program = copy.Build();
  ASSERT_TRUE(program.ok()) << program.status();
  ASSERT_TRUE(client(mesh).ShardMap(*program, ids, copy_ids).ok());
  std::vector<Tensor> before;
  for (const std::string& id : ids) {
    auto t = client(mesh).Get(id);
    ASSERT_TRUE(t.ok()) << t.status();
    before.push_back(*std::move(t));
  }
  Steps(client(mesh), step, *state, 1);
  int changed = 0;
  for (size_t k = 0; k < ids.size(); ++k) {
    auto now = client(mesh).Get(ids[k]);
    auto kept = client(mesh).Get(copy_ids[k]);
    ASSERT_TRUE(now.ok() && kept.ok()) << now.status() << kept.status();
    changed += std::memcmp(now->raw(), before[k].raw(), before[k].size_bytes()) != 0;
    EXPECT_EQ(std::memcmp(kept->raw(), before[k].raw(), before[k].size_bytes()), 0)
        << step.state[k].name << " changed under its copy";
    ASSERT_TRUE(client(mesh).Delete(copy_ids[k]).ok());
  }
  EXPECT_GT(changed, 0) << "the step updated the state";
  EXPECT_TRUE(state->Delete().ok());
}

TEST_F(CheckpointE2ETest, CorruptTruncatedAndUncommittedCheckpoints) {
  const std::string mesh = "data=2,model=4";
  const TrainStep step = Step("fsdp", mesh);
  auto state = TrainState::Init(&client(mesh), &step, "faults");
  ASSERT_TRUE(state.ok()) << state.status();
  auto path = state->Save(root_);
  ASSERT_TRUE(path.ok()) << path.status();
  // An uncommitted leftover (a save killed before its rename) is not a checkpoint.
  fs::create_directories(fs::path(root_) / "step_00000099.tmp-dead");
  std::ofstream(fs::path(root_) / "step_00000099.tmp-dead" / "shard-0.safetensors") << "partial";
  EXPECT_EQ(*checkpoint::LatestCheckpoint(root_), *path);

  // A flipped byte in a block: DataLoss naming the array and the file.
  const std::string bad = root_ + "-bad";
  fs::copy(*path, bad, fs::copy_options::recursive);
  auto manifest = checkpoint::ReadManifest(bad);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  const checkpoint::ArrayEntry& w2 = *manifest->Find("params/w2");
  const checkpoint::Block& victim = w2.blocks[0];
  {
    std::fstream f(fs::path(bad) / victim.file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(victim.data_offset + 5);
    f.put('\x7f');
  }
  auto r1 = TrainState::Restore(&client(mesh), &step, bad, "bad");
  EXPECT_EQ(r1.status().code(), absl::StatusCode::kDataLoss) << r1.status();
  EXPECT_THAT(std::string(r1.status().message()), ::testing::HasSubstr("params/w2"));
  EXPECT_THAT(std::string(r1.status().message()), ::testing::HasSubstr(victim.file));
  // Nothing half-restored is left registered.
  auto listed = client(mesh).ListArrays();
  ASSERT_TRUE(listed.ok());
  for (const auto& a : *listed) EXPECT_FALSE(absl::StartsWith(a.id(), "bad/")) << a.id();

  // A truncated file.
  const std::string cut = root_ + "-cut";
  fs::copy(*path, cut, fs::copy_options::recursive);
  fs::resize_file(fs::path(cut) / victim.file, static_cast<uintmax_t>(victim.data_offset + 3));
  auto r2 = TrainState::Restore(&client(mesh), &step, cut, "cut");
  EXPECT_EQ(r2.status().code(), absl::StatusCode::kDataLoss) << r2.status();
  EXPECT_THAT(std::string(r2.status().message()), ::testing::HasSubstr("truncated"));

  // A target layout that cannot hold the saved shape: w2 [1024, 1024] over a 3-way axis does not
  // divide; here, a missing array names itself.
  v1::RestoreCheckpointRequest req;
  req.set_path(*path);
  v1::CheckpointArray* c = req.add_arrays();
  c->set_name("params/nope");
  c->set_id("nope");
  auto r3 = client(mesh).RestoreCheckpoint(req);
  EXPECT_EQ(r3.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(r3.status().message()), ::testing::HasSubstr("params/nope"));

  // The next save removes the leftover and keeps the previous checkpoint intact.
  auto next = state->Save(root_);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_FALSE(fs::exists(fs::path(root_) / "step_00000099.tmp-dead"));
  EXPECT_TRUE(state->Delete().ok());
}

// The issue's own case: a TrainState saved under 8-way data parallelism (mesh data=8) comes back
// under FSDP on the same 8 workers, under 2-D on a 2x4 data x model mesh and under FSDP on 4
// workers, every array bitwise equal (FSDP holding under a quarter of DP's bytes per worker).
TEST(CheckpointMeshTest, SavedUnderEightWayDataParallelRestoresUnderFsdp2dAndOnFourWorkers) {
  const std::string root =
      (fs::path(::testing::TempDir()) / absl::StrCat("ckpt-eight-way-", getpid())).string();
  fs::remove_all(root);
  auto w = SeedWorkload("dot_relu_dot");
  auto step_for = [&](const std::string& layout, const std::string& mesh) {
    auto step = BuildTrainStep(*Mesh::Parse(mesh), *LayoutSharding(layout), w->optimizer, w->batch,
                               w->loss, 0);
    EXPECT_TRUE(step.ok()) << step.status();
    return *step;
  };
  std::map<std::string, Tensor> saved;
  std::string path;
  const TrainStep dp = step_for("dp", "data=8");
  {
    auto cluster = testing::StartCluster("data=8", "checkpoint-8");
    ASSERT_NE(cluster, nullptr);
    auto client = Client::Connect(cluster->coordinator_address());
    ASSERT_TRUE(client.ok()) << client.status();
    auto state = TrainState::Init(client->get(), &dp, "dp8");
    ASSERT_TRUE(state.ok()) << state.status();
    auto batch = SeedWorkloadBatch(*w);
    std::vector<std::string> ids;
    for (size_t i = 0; i < batch->size(); ++i)
      ids.push_back((*client)->Put((*batch)[i], dp.batch[i].spec)->id());
    for (int i = 0; i < 2; ++i) ASSERT_TRUE(state->Step(ids).ok());
    auto saved_path = state->Save(root);
    ASSERT_TRUE(saved_path.ok()) << saved_path.status();
    path = *saved_path;
    for (const PlannedArray& a : dp.state) saved[a.name] = *state->Get(a.name);
    // FSDP on the same 8 workers.
    const TrainStep fsdp = step_for("fsdp", "data=8");
    auto restored = TrainState::Restore(client->get(), &fsdp, path, "fsdp8");
    ASSERT_TRUE(restored.ok()) << restored.status();
    for (const PlannedArray& a : fsdp.state) {
      auto got = restored->Get(a.name);
      ASSERT_TRUE(got.ok()) << a.name;
      EXPECT_EQ(std::memcmp(got->raw(), saved[a.name].raw(), got->size_bytes()), 0)
          << "fsdp: " << a.name;
    }
    EXPECT_LT(fsdp.StateBytesPerWorker(), dp.StateBytesPerWorker() / 4);
    ASSERT_TRUE(cluster->Stop().ok());
  }
  for (const auto& [mesh, layout] : {std::pair<std::string, std::string>{"data=2,model=4", "2d"},
                                     std::pair<std::string, std::string>{"data=4", "fsdp"}}) {
    auto cluster = testing::StartCluster(mesh, "checkpoint-other");
    ASSERT_NE(cluster, nullptr);
    auto client = Client::Connect(cluster->coordinator_address());
    ASSERT_TRUE(client.ok()) << client.status();
    const TrainStep other = step_for(layout, mesh);
    auto restored = TrainState::Restore(client->get(), &other, path, "other");
    ASSERT_TRUE(restored.ok()) << mesh << ": " << restored.status();
    EXPECT_EQ(restored->steps(), 2);
    for (const PlannedArray& a : other.state) {
      auto got = restored->Get(a.name);
      ASSERT_TRUE(got.ok()) << a.name;
      EXPECT_EQ(std::memcmp(got->raw(), saved[a.name].raw(), got->size_bytes()), 0)
          << mesh << ": " << a.name;
    }
    ASSERT_TRUE(cluster->Stop().ok());
  }
  fs::remove_all(root);
}

// A worker killed before a save completes: the save fails naming the worker, and the previous
// checkpoint stays committed and readable, with no leftovers.
TEST(CheckpointFaultTest, WorkerKilledDuringSaveLeavesThePreviousCheckpoint) {
  auto cluster = testing::StartCluster("data=2", "checkpoint-kill");
  ASSERT_NE(cluster, nullptr);
  auto client = Client::Connect(cluster->coordinator_address());
  ASSERT_TRUE(client.ok()) << client.status();
  auto w = SeedWorkload("dot_relu_dot");
  auto step = BuildTrainStep(*Mesh::Parse("data=2"), *LayoutSharding("fsdp"), w->optimizer,
                             w->batch, w->loss, 0);
  ASSERT_TRUE(step.ok()) << step.status();
  auto state = TrainState::Init(client->get(), &*step);
  ASSERT_TRUE(state.ok()) << state.status();
  const std::string root = (fs::path(::testing::TempDir()) / "ckpt-kill").string();
  fs::remove_all(root);
  auto first = state->Save(root);
  ASSERT_TRUE(first.ok()) << first.status();
  const pid_t victim = cluster->worker_pids()[1];
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  ::waitpid(victim, nullptr, 0);
  v1::SaveCheckpointRequest req;
  req.set_root(root);
  req.set_step(7);
  for (const PlannedArray& a : step->state) {
    v1::CheckpointArray* c = req.add_arrays();
    c->set_name(a.name);
    c->set_id(state->Id(a.name));
  }
  auto second = (*client)->SaveCheckpoint(req, absl::Seconds(60));
  ASSERT_FALSE(second.ok());
  // Named by its rank and pid (ranks follow registration, not start order).
  EXPECT_THAT(std::string(second.status().message()),
              ::testing::ContainsRegex("worker rank [01] .*pid " + std::to_string(victim)));
  EXPECT_EQ(checkpoint::ListCheckpoints(root).size(), 1u);
  for (const auto& e : fs::directory_iterator(root))
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
  auto m = checkpoint::ReadManifest(*first);
  ASSERT_TRUE(m.ok()) << m.status();
  for (const auto& a : m->arrays) EXPECT_TRUE(checkpoint::ReadArray(*first, a).ok()) << a.name;
  cluster->Stop().IgnoreError();
}

}  // namespace
}  // namespace meshrun
