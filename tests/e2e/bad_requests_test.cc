// Requests that once crashed or exhausted a host, sent as raw gRPC messages to a real cluster:
// each gets a clear error naming the offending value, and the cluster serves the next valid one.
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "meshrun/client.h"
#include "meshrun/jit.h"
#include "meshrun/local_cluster.h"
#include "meshrun/v1/coordinator.grpc.pb.h"
#include "meshrun/v1/worker.grpc.pb.h"
#include "net/grpc_util.h"
#include "tests/testutil/cluster.h"

namespace meshrun {
namespace {

using ::testing::HasSubstr;

v1::PutArrayRequest PutRequest(DType dtype, const Dims& dims, std::string data,
                               const std::string& id) {
  v1::PutArrayRequest req;
  req.mutable_array()->set_dtype(dtype);
  for (int64_t d : dims) req.mutable_array()->mutable_shape()->add_dims(d);
  req.mutable_array()->set_data(std::move(data));
  req.set_id(id);
  return req;
}

TEST(BadRequestsTest, HugeShapesAndBudgetsAreClearErrorsAndTheClusterServesOn) {
  LocalClusterOptions options;
  options.mesh = "data=2";
  options.worker_memory_budget_bytes = 1 << 20;  // 1 MiB per worker
  options.log_dir = ::testing::TempDir() + "/bad_requests";
  auto cluster = LocalCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto stub = v1::Coordinator::NewStub(CreateChannel((*cluster)->coordinator_address()));
  auto put = [&](const v1::PutArrayRequest& req) {
    grpc::ClientContext ctx;
    SetTimeout(ctx, absl::Seconds(30));
    v1::PutArrayResponse resp;
    return stub->PutArray(&ctx, req, &resp);
  };

  // f32[2^40] with no data: refused before anything is allocated.
  grpc::Status s = put(PutRequest(v1::DTYPE_F32, {int64_t{1} << 40}, "", "huge"));
  EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("f32[1099511627776] needs 4398046511104 bytes, got 0"));
  // A byte size that overflows int64 is not an empty array.
  s = put(PutRequest(v1::DTYPE_I32, {int64_t{1} << 62, 4}, "", "overflow"));
  EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("larger than the limit"));
  // 2 MiB replicated on every worker: past each worker's 1 MiB budget.
  s = put(PutRequest(v1::DTYPE_F32, {512 * 1024}, std::string(2 << 20, '\0'), "over_budget"));
  EXPECT_EQ(s.error_code(), grpc::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("needs 2097152 bytes"));
  EXPECT_THAT(s.error_message(), HasSubstr("--memory_budget_bytes"));

  auto client = Client::Connect((*cluster)->coordinator_address());
  ASSERT_TRUE(client.ok()) << client.status();
  // A worker's LoadShards of a 2 MiB replicated block from a 2 MiB saved one: past the budget
  // before any file is opened (it names none that exists).
  auto status = (*client)->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  auto worker = v1::Worker::NewStub(CreateChannel(status->workers(0).peer().address()));
  v1::LoadShardsRequest load;
  v1::LoadItem* item = load.add_items();
  item->set_array_id("loaded");
  item->set_name("w");
  item->set_dtype(v1::DTYPE_F32);
  item->mutable_global_shape()->add_dims(512 * 1024);
  v1::BlockSource* src = item->add_sources();
  src->set_file("/nonexistent/meshrun-block.safetensors");
  src->add_offsets(0);
  src->add_shape(512 * 1024);
  src->set_nbytes(2 << 20);
  grpc::ClientContext load_ctx;
  SetTimeout(load_ctx, absl::Seconds(30));
  v1::LoadShardsResponse loaded;
  s = worker->LoadShards(&load_ctx, load, &loaded);
  EXPECT_EQ(s.error_code(), grpc::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("LoadShards of 1 arrays needs 4194304 bytes"));
  auto listed = (*client)->ListArrays();
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_TRUE(listed->empty()) << "a refused Put leaves no array registered";
  Tensor x(v1::DTYPE_F32, {4});
  for (int i = 0; i < 4; ++i) x.data<float>()[i] = static_cast<float>(i + 1);
  ASSERT_TRUE((*client)->Put(x, PartitionSpec::Of({"data"}), "x").ok());
  auto back = (*client)->Get("x");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->data<float>()[3], 4.0f);

  // A run every worker refuses for its budget (before taking its arguments) consumes the donated
  // argument on the workers too, not only in the coordinator's registry: an array of the same
  // size fits afterwards. 640 KiB of a per worker; the run needs a, a + a and (a + a) * a.
  const int64_t n = 2 * 160 * 1024;
  Tensor a(v1::DTYPE_F32, {n});
  for (int64_t i = 0; i < n; ++i) a.data<float>()[i] = 1.0f;
  ASSERT_TRUE((*client)->Put(a, PartitionSpec::Of({"data"}), "a").ok());
  JitBuilder jit(*Mesh::Parse("data=2"));
  auto in = jit.Input(v1::DTYPE_F32, {n}, PartitionSpec::Of({"data"}));
  jit.Output(jit.Binary("mul", jit.Binary("add", in, in), in), PartitionSpec::Of({"data"}));
  auto run = (*client)->Jit(jit.global_program(), {"a"}, {}, absl::Seconds(30), {0});
  ASSERT_EQ(run.status().code(), absl::StatusCode::kResourceExhausted) << run.status();
  EXPECT_THAT(std::string(run.status().message()),
              HasSubstr("the donated arrays (a) are consumed"));
  EXPECT_TRUE((*client)->Put(a, PartitionSpec::Of({"data"}), "a2").ok())
      << "the refused run's donated array still holds the workers' memory";
  ASSERT_TRUE((*cluster)->Stop().ok());
}

// A worker gets its program as bytes (RunShardMapRequest.program) and parses them only when no
// compiled program has them: bytes that are no ShardMapProgram are refused by size, and the
// worker runs the next valid program.
TEST(BadRequestsTest, ProgramBytesThatAreNoProgramAreRefusedByTheWorkerWhichServesOn) {
  LocalClusterOptions options;
  options.mesh = "data=2";
  options.log_dir = ::testing::TempDir() + "/bad_program_bytes";
  auto cluster = LocalCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto client = Client::Connect((*cluster)->coordinator_address());
  ASSERT_TRUE(client.ok()) << client.status();
  auto status = (*client)->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  auto worker = v1::Worker::NewStub(CreateChannel(status->workers(0).peer().address()));
  v1::RunShardMapRequest bad;
  bad.set_program(std::string("\x0a\xff\xff\xff", 4));  // a field whose length runs past the end
  grpc::ClientContext ctx;
  SetTimeout(ctx, absl::Seconds(30));
  v1::RunShardMapResponse resp;
  grpc::Status s = worker->RunShardMap(&ctx, bad, &resp);
  EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("the program's 4 bytes are not a ShardMapProgram"));

  // x * 2 on each block, twice: the second run finds the compiled program by its bytes.
  Tensor x(v1::DTYPE_F32, {4});
  for (int i = 0; i < 4; ++i) x.data<float>()[i] = static_cast<float>(i + 1);
  ASSERT_TRUE((*client)->Put(x, PartitionSpec::Of({"data"}), "x").ok());
  v1::ShardMapProgram program;
  v1::ShardMapProgram* p = &program;
  for (const char* name : {"x", "y"}) {
    v1::BufferDecl* b = p->mutable_program()->add_buffers();
    b->set_name(name);
    b->set_dtype(v1::DTYPE_F32);
    b->mutable_shape()->add_dims(2);
  }
  v1::Function* f = p->mutable_program()->add_functions();
  f->set_name("main");
  v1::Op* op = f->add_ops();
  op->set_kind(v1::OP_BINARY);
  op->set_fn("add");
  op->add_inputs("x");
  op->add_inputs("x");
  op->add_outputs("y");
  p->add_inputs("x");
  p->add_outputs("y");
  *p->add_in_specs() = PartitionSpec::Of({"data"}).ToProto();
  *p->add_out_specs() = PartitionSpec::Of({"data"}).ToProto();
  for (const char* out : {"y1", "y2"}) {
    auto run = (*client)->ShardMap(program, {"x"}, {out});
    ASSERT_TRUE(run.ok()) << run.status();
    auto y = (*client)->Get(out);
    ASSERT_TRUE(y.ok()) << y.status();
    for (int i = 0; i < 4; ++i) EXPECT_EQ(y->data<float>()[i], 2.0f * (i + 1)) << out << " " << i;
  }
  ASSERT_TRUE((*cluster)->Stop().ok());
}

}  // namespace
}  // namespace meshrun
