// PeerStateStore (worker/peer_state.h): copies become visible only when committed, a newer copy
// replaces an owner's, other jobs' copies are dropped, and the copies come back after an exec.
#include "worker/peer_state.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>

#include "core/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace meshrun {
namespace {

using ::testing::HasSubstr;

v1::PeerStateKey Key(const std::string& job, int64_t step, int owner) {
  v1::PeerStateKey k;
  k.set_job(job);
  k.set_step(step);
  k.set_owner_rank(owner);
  k.set_mesh("data=4");
  return k;
}

v1::PeerStateBlock Block(const std::string& name, float value) {
  Tensor t(v1::DTYPE_F32, {2, 3});
  for (int64_t i = 0; i < t.num_elements(); ++i) t.data<float>()[i] = value + i;
  v1::PeerStateBlock b;
  b.set_name(name);
  *b.mutable_block() = t.ToProto();
  return b;
}

float First(const v1::PeerStateBlock& b) {
  absl::StatusOr<Tensor> t = Tensor::FromProto(b.block());
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? t->data<float>()[0] : -1;
}

TEST(PeerStateStoreTest, ACopyIsHeldOnlyOnceCommitted) {
  PeerStateStore store;
  store.Add(Key("j", 10, 1), Block("w", 1));
  absl::StatusOr<v1::PeerStateBlock> before = store.Find(Key("j", 10, 1), "w");
  EXPECT_EQ(before.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(store.Info().held().empty());
  ASSERT_TRUE(store.Commit(Key("j", 10, 1)).ok());
  absl::StatusOr<v1::PeerStateBlock> after = store.Find(Key("j", 10, 1), "w");
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(First(*after), 1);
  EXPECT_EQ(store.bytes(), 24);
  absl::StatusOr<v1::PeerStateBlock> other = store.Find(Key("j", 10, 1), "b");
  EXPECT_THAT(other.status().message(), HasSubstr("has no array b"));
  // Another step, mesh or owner is not this copy.
  v1::PeerStateKey other_mesh = Key("j", 10, 1);
  other_mesh.set_mesh("data=2");
  EXPECT_FALSE(store.Find(other_mesh, "w").ok());
  EXPECT_THAT(store.Find(Key("j", 15, 1), "w").status().message(),
              HasSubstr("only job 'j' step 10"));
}

TEST(PeerStateStoreTest, AnUnfinishedCopyLeavesThePreviousOneAndCannotBeCommittedUnderAnotherKey) {
  PeerStateStore store;
  store.Add(Key("j", 10, 0), Block("w", 1));
  ASSERT_TRUE(store.Commit(Key("j", 10, 0)).ok());
  store.Add(Key("j", 15, 0), Block("w", 5));  // its sender died before the commit
  EXPECT_EQ(First(*store.Find(Key("j", 10, 0), "w")), 1);
  EXPECT_EQ(store.Commit(Key("j", 20, 0)).code(), absl::StatusCode::kFailedPrecondition);
  // A newer copy starts afresh: the pending blocks of step 15 are not part of step 20's.
  store.Add(Key("j", 20, 0), Block("b", 7));
  ASSERT_TRUE(store.Commit(Key("j", 20, 0)).ok());
  EXPECT_FALSE(store.Find(Key("j", 20, 0), "w").ok());
  EXPECT_EQ(First(*store.Find(Key("j", 20, 0), "b")), 7);
  // The copy it replaced stays as the previous one (a keep cut short on other ranks falls back
  // to it); a third commit drops it.
  EXPECT_EQ(First(*store.Find(Key("j", 10, 0), "w")), 1);
  ASSERT_EQ(store.Info().held_size(), 2);
  EXPECT_EQ(store.Info().held(0).key().step(), 20);
  EXPECT_EQ(store.Info().held(1).key().step(), 10);
  store.Add(Key("j", 30, 0), Block("b", 8));
  ASSERT_TRUE(store.Commit(Key("j", 30, 0)).ok());
  EXPECT_FALSE(store.Find(Key("j", 10, 0), "w").ok());
  EXPECT_EQ(First(*store.Find(Key("j", 20, 0), "b")), 7);
  EXPECT_EQ(store.Info().held_size(), 2);
}

TEST(PeerStateStoreTest, OwnersAreKeptApartAndAnotherJobsCopiesAreDropped) {
  PeerStateStore store;
  store.Add(Key("old", 5, 2), Block("w", 9));
  ASSERT_TRUE(store.Commit(Key("old", 5, 2)).ok());
  store.Add(Key("j", 10, 0), Block("w", 1));
  store.Add(Key("j", 10, 3), Block("w", 3));
  ASSERT_TRUE(store.Commit(Key("j", 10, 0)).ok());
  ASSERT_TRUE(store.Commit(Key("j", 10, 3)).ok());
  EXPECT_FALSE(store.Find(Key("old", 5, 2), "w").ok());
  EXPECT_EQ(First(*store.Find(Key("j", 10, 0), "w")), 1);
  EXPECT_EQ(First(*store.Find(Key("j", 10, 3), "w")), 3);
  EXPECT_EQ(store.Drop("j"), 48);
  EXPECT_EQ(store.bytes(), 0);
  EXPECT_TRUE(store.Info().held().empty());
}

// The child half of the exec test below, which runs it in this binary exec'd.
TEST(PeerStateStoreTest, DISABLED_ExecChild) {
  PeerStateStore store;
  ASSERT_TRUE(store.ImportAfterExec().ok());
  EXPECT_EQ(std::getenv(kPeerStateFdEnv), nullptr);
  absl::StatusOr<v1::PeerStateBlock> b = store.Find(Key("j", 10, 2), "w");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(First(*b), 4);
}

TEST(PeerStateStoreTest, TheCopiesOutliveAnExecOfTheProcess) {
  PeerStateStore store;
  store.Add(Key("j", 10, 2), Block("w", 4));
  ASSERT_TRUE(store.Commit(Key("j", 10, 2)).ok());
  ASSERT_TRUE(store.ExportForExec().ok());
  ASSERT_NE(std::getenv(kPeerStateFdEnv), nullptr);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    execl("/proc/self/exe", "peer_state_test", "--gtest_also_run_disabled_tests",
          "--gtest_filter=PeerStateStoreTest.DISABLED_ExecChild", static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the exec'd process did not find the copy";
  // This process takes them back too (as a failed exec would leave it), and the fd is closed.
  PeerStateStore back;
  ASSERT_TRUE(back.ImportAfterExec().ok());
  EXPECT_EQ(First(*back.Find(Key("j", 10, 2), "w")), 4);
}

TEST(PeerStateStoreTest, AVariableThatNamesNoCopiesIsReportedAndIgnored) {
  setenv(kPeerStateFdEnv, "not-a-number", 1);
  PeerStateStore store;
  EXPECT_EQ(store.ImportAfterExec().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(std::getenv(kPeerStateFdEnv), nullptr);
  EXPECT_EQ(store.bytes(), 0);
}

}  // namespace
}  // namespace meshrun
