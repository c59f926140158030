// Authentication on by default (net/credentials.h), against real processes: without the
// cluster's token or certificate nothing is served; a worker with another CA's certificate cannot
// join; with the credentials everything works.
#include <sys/wait.h>

#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "meshrun/client.h"
#include "meshrun/local_cluster.h"
#include "meshrun/v1/coordinator.grpc.pb.h"
#include "meshrun/v1/worker.grpc.pb.h"
#include "net/credentials.h"
#include "net/grpc_util.h"
#include "tests/testutil/cluster.h"

namespace meshrun {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

// A channel with exactly `creds` (not the process's).
std::shared_ptr<grpc::Channel> ChannelWith(const std::string& address, const Credentials& creds) {
  grpc::ChannelArguments args;
  if (!creds.insecure) args.SetSslTargetNameOverride(kNodeName);
  return grpc::CreateCustomChannel(address, NodeChannelCredentials(creds), args);
}

grpc::Status PutArray(const std::shared_ptr<grpc::Channel>& channel) {
  auto stub = v1::Coordinator::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  v1::PutArrayRequest req;
  req.mutable_array()->set_dtype(v1::DTYPE_F32);
  req.mutable_array()->mutable_shape()->add_dims(2);
  req.mutable_array()->set_data(std::string(8, '\0'));
  v1::PutArrayResponse resp;
  return stub->PutArray(&ctx, req, &resp);
}

class AuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    LocalClusterOptions o;
    o.mesh = "data=2";
    o.log_dir = ::testing::TempDir() + "/auth";
    auto cluster = LocalCluster::Start(o);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = *std::move(cluster);
    auto creds = LoadCredentials(cluster_->tls_dir());
    ASSERT_TRUE(creds.ok()) << creds.status();
    creds_ = *std::move(creds);
  }
  void TearDown() override {
    if (cluster_) {
      EXPECT_TRUE(cluster_->Stop().ok());
    }
  }
  std::unique_ptr<LocalCluster> cluster_;
  Credentials creds_;
};

TEST_F(AuthTest, WithoutTheTokenOrACertificateTheCoordinatorServesNothing) {
  const std::string address = cluster_->coordinator_address();
  Credentials ca_only = creds_;  // TLS to the right server, but no token and no certificate
  ca_only.cert_pem.clear();
  ca_only.key_pem.clear();
  ca_only.token.clear();
  auto channel = ChannelWith(address, ca_only);
  grpc::Status s = PutArray(channel);
  EXPECT_EQ(s.error_code(), grpc::UNAUTHENTICATED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("no credentials"));
  {
    auto stub = v1::Coordinator::NewStub(channel);
    grpc::ClientContext ctx;
    v1::ShutdownResponse resp;
    EXPECT_EQ(stub->Shutdown(&ctx, v1::ShutdownRequest(), &resp).error_code(),
              grpc::UNAUTHENTICATED);
    grpc::ClientContext jctx;
    v1::JitResponse jresp;
    EXPECT_EQ(stub->Jit(&jctx, v1::JitRequest(), &jresp).error_code(), grpc::UNAUTHENTICATED);
    // GetArray is served raw on gRPC's callback API: the same check applies to it.
    grpc::ClientContext gctx;
    v1::GetArrayRequest greq;
    greq.set_id("any");
    v1::GetArrayResponse gresp;
    EXPECT_EQ(stub->GetArray(&gctx, greq, &gresp).error_code(), grpc::UNAUTHENTICATED);
  }
  Credentials wrong_token = ca_only;
  wrong_token.token = std::string(64, '0');
  s = PutArray(ChannelWith(address, wrong_token));
  EXPECT_EQ(s.error_code(), grpc::UNAUTHENTICATED);
  EXPECT_THAT(s.error_message(), HasSubstr("not this cluster's"));
  // Plaintext to a TLS port: no answer at all.
  EXPECT_FALSE(PutArray(ChannelWith(address, Credentials::Insecure())).ok());

  // The token alone (what a client holds) is enough.
  Credentials client = ca_only;
  client.token = creds_.token;
  s = PutArray(ChannelWith(address, client));
  EXPECT_TRUE(s.ok()) << s.error_message();
  // And the cluster still serves its own clients; Shutdown was refused above.
  auto c = Client::Connect(address);
  ASSERT_TRUE(c.ok()) << c.status();
  auto status = (*c)->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->workers_size(), 2);
}

TEST_F(AuthTest, WorkersServeOnlyHoldersOfTheClustersCertificate) {
  auto c = Client::Connect(cluster_->coordinator_address());
  ASSERT_TRUE(c.ok()) << c.status();
  auto status = (*c)->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  const std::string worker = status->workers(0).peer().address();
  const std::string target = ::testing::TempDir() + "/auth-escape.safetensors";
  std::filesystem::remove(target);
  Credentials token_only = creds_;  // a client: the token, no node certificate
  token_only.cert_pem.clear();
  token_only.key_pem.clear();
  const std::string other_dir = ::testing::TempDir() + "/auth-other-ca";
  std::filesystem::remove_all(other_dir);
  ASSERT_TRUE(InitCredentials(other_dir).ok());
  auto other = LoadCredentials(other_dir);
  ASSERT_TRUE(other.ok());
  for (const Credentials& creds : {token_only, *other}) {
    auto stub = v1::Worker::NewStub(ChannelWith(worker, creds));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    v1::SaveShardsRequest req;
    req.set_path(target);
    v1::SaveShardsResponse resp;
    grpc::Status s = stub->SaveShards(&ctx, req, &resp);
    EXPECT_THAT(s.error_code(), AnyOf(grpc::UNAVAILABLE, grpc::UNAUTHENTICATED))
        << s.error_message();
    // GetShard, served raw on the callback API, is refused the same way.
    grpc::ClientContext gctx;
    gctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    v1::GetShardRequest greq;
    greq.set_array_id("any");
    v1::GetShardResponse gresp;
    s = stub->GetShard(&gctx, greq, &gresp);
    EXPECT_THAT(s.error_code(), AnyOf(grpc::UNAVAILABLE, grpc::UNAUTHENTICATED))
        << s.error_message();
  }
  EXPECT_FALSE(std::filesystem::exists(target));

  // A worker whose certificate comes from another CA cannot join.
  const pid_t pid = fork();
  if (pid == 0) {
    const std::string bin = ExecutableDir() + "/meshrun-worker";
    execl(bin.c_str(), bin.c_str(), ("--coordinator=" + cluster_->coordinator_address()).c_str(),
          ("--tls_dir=" + other_dir).c_str(), "--join_timeout=3s", "--metrics_port=-1", nullptr);
    _exit(127);
  }
  int wstatus = 0;
  ASSERT_EQ(waitpid(pid, &wstatus, 0), pid);
  EXPECT_TRUE(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) != 0) << "the stranger worker was let in";
  status = (*c)->GetStatus();
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->workers_size(), 2);
}

// The coordinator and the workers read and write checkpoints under their --checkpoint_root only,
// whatever they are asked: the coordinator refuses first, creating nothing outside.
TEST(CheckpointRootTest, APathOutsideTheRootIsRefused) {
  const std::string root = ::testing::TempDir() + "/ckroot";
  std::filesystem::remove_all(root);
  std::filesystem::create_directories(root + "/inside");
  LocalClusterOptions o;
  o.mesh = "data=2";
  o.log_dir = ::testing::TempDir() + "/ckroot-logs";
  o.checkpoint_root = root;
  auto cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto c = Client::Connect((*cluster)->coordinator_address());
  ASSERT_TRUE(c.ok()) << c.status();
  Tensor x(v1::DTYPE_F32, {4});
  ASSERT_TRUE((*c)->Put(x, PartitionSpec::Of({"data"}), "x").ok());
  v1::SaveCheckpointRequest req;
  req.set_step(1);
  v1::CheckpointArray* a = req.add_arrays();
  a->set_name("x");
  a->set_id("x");
  for (const std::string& outside :
       {::testing::TempDir() + "/ckroot-outside", root + "/inside/../../ckroot-escape"}) {
    std::filesystem::remove_all(outside);  // an earlier run's
    req.set_root(outside);
    auto saved = (*c)->SaveCheckpoint(req);
    ASSERT_FALSE(saved.ok()) << outside;
    EXPECT_EQ(saved.status().code(), absl::StatusCode::kPermissionDenied) << saved.status();
    EXPECT_THAT(std::string(saved.status().message()),
                HasSubstr("outside the coordinator's checkpoint root"));
    EXPECT_FALSE(std::filesystem::exists(outside)) << outside << " was created";
  }
  v1::RestoreCheckpointRequest restore;
  restore.set_path("/etc");
  auto restored = (*c)->RestoreCheckpoint(restore);
  EXPECT_EQ(restored.status().code(), absl::StatusCode::kPermissionDenied) << restored.status();
  // A worker asked directly (by a node of the cluster) checks its own root as well.
  auto status = (*c)->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  auto stub = v1::Worker::NewStub(CreateChannel(status->workers(0).peer().address()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  v1::SaveShardsRequest shards;
  shards.set_path(::testing::TempDir() + "/ckroot-worker-escape.safetensors");
  v1::SaveItem* item = shards.add_items();
  item->set_array_id("x");
  item->set_name("x");
  item->mutable_global_shape()->add_dims(4);
  *item->mutable_spec() = PartitionSpec::Of({"data"}).ToProto();
  v1::SaveShardsResponse shards_resp;
  grpc::Status s = stub->SaveShards(&ctx, shards, &shards_resp);
  EXPECT_EQ(s.error_code(), grpc::PERMISSION_DENIED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("outside this worker's checkpoint root"));
  EXPECT_FALSE(std::filesystem::exists(shards.path()));
  req.set_root(root + "/inside");
  auto saved = (*c)->SaveCheckpoint(req);
  EXPECT_TRUE(saved.ok()) << saved.status();
  ASSERT_TRUE((*cluster)->Stop().ok());
}

}  // namespace
}  // namespace meshrun
