// libFuzzer target for the Coordinator service: the fuzzer's bytes are parsed as one message
// (bookworm has no libprotobuf-mutator), the first byte choosing what it is.
//  - Without a worker: a Jit request's global program partitioned on a 2x2 mesh (sharding
//    propagation, collectives, the VJP: server/partitioner.h); a PutArray's array and spec (size
//    and layout checks); a job config as the client validates it (core/config/job_config.h); a
//    checkpoint manifest as a restore reads it (core/checkpoint/checkpoint.h).
//  - Through the handlers that reach workers: a real coordinator (RunCoordinator) and one real
//    worker (RunWorker) run in this process on loopback, Mesh('data': 1, 'model': 1), without TLS,
//    the worker with a 64 MiB memory budget, both with their checkpoint root under $TMPDIR; the
//    request is sent to the coordinator over gRPC as a client would: PutArray and GetArray, served
//    raw, get the fuzzer's bytes as they are; DeleteArray, ListArrays, GetStatus, ShardMap, Jit,
//    OpenInput, CloseInput, SaveCheckpoint, RestoreCheckpoint and SubmitJob get them if they parse
//    as the request. Where a request could ask for unbounded work
//    the target bounds it first (a job's steps, a call's runs, its collective timeout) and points
//    data paths at a small .npy dataset; Register, Heartbeat and Shutdown (a node's and an
//    operator's RPCs) are left out, as they would end the cluster the next inputs need.
// A crash, a sanitizer report or a hang (libFuzzer's -timeout) is a bug; an error Status is not.
// The suite checks it for leaks as the process exits, not after every input
// (tests/fuzz/CMakeLists.txt says why).
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/checkpoint/checkpoint.h"
#include "core/config/job_config.h"
#include "core/sharding/named_sharding.h"
#include "core/tensor.h"
#include "grpcpp/grpcpp.h"
#include "meshrun/v1/coordinator.grpc.pb.h"
#include "net/credentials.h"
#include "net/grpc_util.h"
#include "server/coordinator_runner.h"
#include "server/partitioner.h"
#include "tests/fuzz/npy.h"
#include "worker/worker_runner.h"

namespace meshrun {
namespace {

// A coordinator and one worker, started once; they run until the process exits.
class Cluster {
 public:
  Cluster() {
    SetProcessCredentials(Credentials::Insecure());
    const char* tmp = std::getenv("TMPDIR");
    root_ = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/meshrun-fuzz-coordinator-", getpid());
    std::filesystem::create_directories(root_);
    data_ = root_ + "/data";
    std::filesystem::create_directories(data_);
    // x f32 [16, 3], y i32 [16]; and the main job's fields, image u8 [16, 784], label u8 [16]
    // (the seed corpus's job trains on them).
    WriteNpy(data_ + "/x.npy", "<f4", "(16, 3)", std::string(16 * 3 * 4, '\1'));
    WriteNpy(data_ + "/y.npy", "<i4", "(16,)", std::string(16 * 4, '\2'));
    WriteNpy(data_ + "/image.npy", "|u1", "(16, 784)", std::string(16 * 784, '\7'));
    WriteNpy(data_ + "/label.npy", "|u1", "(16,)", std::string(16, '\2'));

    CoordinatorOptions co;
    co.mesh = "data=1,model=1";
    co.port = 0;
    co.port_file = root_ + "/port";
    co.heartbeat_timeout = absl::Seconds(60);  // a slow (instrumented) process is not a dead one
    co.process_checks = false;
    co.metrics_port = -1;
    co.checkpoint_root = root_;
    std::thread([co] { (void)RunCoordinator(co); }).detach();
    int port = 0;
    for (int i = 0; i < 600 && port == 0; ++i) {
      absl::SleepFor(absl::Milliseconds(50));
      std::ifstream(co.port_file) >> port;
    }
    if (port == 0) std::abort();  // the coordinator did not start: nothing to fuzz
    address_ = absl::StrCat("127.0.0.1:", port);

    WorkerRunnerOptions wo;
    wo.coordinator = address_;
    wo.compute_threads = 1;
    wo.heartbeat_interval = absl::Seconds(1);
    wo.orphan_timeout = absl::Hours(1);
    wo.metrics_port = -1;
    wo.shm_transport = false;
    wo.memory_budget_bytes = int64_t{64} << 20;
    wo.checkpoint_root = root_;
    std::thread([wo] { (void)RunWorker(wo); }).detach();

    channel_ = grpc::CreateChannel(address_, grpc::InsecureChannelCredentials());
    stub_ = v1::Coordinator::NewStub(channel_);
    for (int i = 0; i < 1200; ++i) {  // until the worker has joined
      grpc::ClientContext ctx;
      v1::GetStatusResponse status;
      if (stub_->GetStatus(&ctx, v1::GetStatusRequest(), &status).ok() &&
          status.workers_size() == 1 && status.workers(0).alive()) {
        return;
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
    std::abort();  // the worker did not join
  }

  v1::Coordinator::Stub& stub() { return *stub_; }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  const std::string& root() const { return root_; }
  const std::string& data() const { return data_; }

 private:
  std::string root_, data_, address_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

// A call's context: a deadline well inside libFuzzer's -timeout.
std::unique_ptr<grpc::ClientContext> Context() {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  return ctx;
}

// What one call may ask of the workers: a few runs, a short collective timeout.
template <typename Request>
void BoundRuns(Request& req) {
  while (req.more_runs_size() > 2) req.mutable_more_runs()->RemoveLast();
  if (!(req.collective_timeout_seconds() >= 0 && req.collective_timeout_seconds() <= 2))
    req.set_collective_timeout_seconds(2);
}

void BoundInput(const Cluster& c, v1::InputSpec* spec) {
  spec->set_path(c.data());  // never another path: the fuzzer reads nothing else
}

// A job that ends within the deadline: at most 2 steps, no evaluation, no recovery, no waiting
// for another job, checkpoints (if any) under the root.
void BoundJob(const Cluster& c, v1::JobSpec* job) {
  v1::TrainSchedule* s = job->mutable_schedule();
  s->set_total_steps(job->schedule().total_steps() % 3);
  s->set_epochs(0);
  if (s->log_every() < 0 || s->log_every() > 2) s->set_log_every(1);
  if (!(s->collective_timeout_seconds() >= 0 && s->collective_timeout_seconds() <= 2))
    s->set_collective_timeout_seconds(2);
  s->set_evaluate(false);
  s->set_when_busy("refuse");
  job->clear_recovery();
  if (job->has_train_input()) BoundInput(c, job->mutable_train_input());
  if (job->has_eval_input()) BoundInput(c, job->mutable_eval_input());
  v1::CheckpointPolicy* ck = job->mutable_checkpoint();
  if (!ck->dir().empty()) ck->set_dir(c.root() + "/jobs");
  ck->set_async(false);
}

// With MESHRUN_FUZZ_VERBOSE set, each call's outcome goes to stderr (to see what a seed reaches).
void Report(const char* rpc, const grpc::Status& status) {
  static const bool verbose = std::getenv("MESHRUN_FUZZ_VERBOSE") != nullptr;
  if (verbose)
    std::fprintf(stderr, "%s: %d %s\n", rpc, status.error_code(), status.error_message().c_str());
}

template <typename Request>
bool Parse(const std::string& bytes, Request* req) {
  return req->ParseFromString(bytes);
}

// The requests sent to the running coordinator; `which` picks the RPC.
void CallCluster(Cluster& c, int which, const std::string& bytes) {
  v1::Coordinator::Stub& stub = c.stub();
  std::unique_ptr<grpc::ClientContext> ctx = Context();
  switch (which) {
    case 0:
    case 1: {
      // Served raw (ParseWithTensor, ParseMessage): the bytes go as they are, a message or not.
      const grpc::Slice slice(bytes);
      grpc::ByteBuffer response;
      const char* rpc = which == 0 ? "PutArray" : "GetArray";
      Report(rpc, RawUnaryCall(c.channel(), ctx.get(),
                               MethodPath(v1::Coordinator::service_full_name(), rpc),
                               grpc::ByteBuffer(&slice, 1), &response));
      break;
    }
    case 2: {
      v1::DeleteArrayRequest req;
      v1::DeleteArrayResponse resp;
      if (Parse(bytes, &req)) Report("DeleteArray", stub.DeleteArray(ctx.get(), req, &resp));
      break;
    }
    case 3: {
      v1::ShardMapRequest req;
      v1::ShardMapResponse resp;
      if (!Parse(bytes, &req)) break;
      BoundRuns(req);
      if (req.has_feed()) req.mutable_feed()->set_step(req.feed().step() % 64);
      Report("ShardMap", stub.ShardMap(ctx.get(), req, &resp));
      break;
    }
    case 4: {
      v1::JitRequest req;
      v1::JitResponse resp;
      if (!Parse(bytes, &req)) break;
      BoundRuns(req);
      if (req.has_feed()) req.mutable_feed()->set_step(req.feed().step() % 64);
      Report("Jit", stub.Jit(ctx.get(), req, &resp));
      break;
    }
    case 5: {
      v1::OpenInputRequest req;
      v1::OpenInputResponse resp;
      if (!Parse(bytes, &req)) break;
      BoundInput(c, req.mutable_spec());
      Report("OpenInput", stub.OpenInput(ctx.get(), req, &resp));
      break;
    }
    case 6: {
      v1::CloseInputRequest req;
      v1::CloseInputResponse resp;
      if (Parse(bytes, &req)) Report("CloseInput", stub.CloseInput(ctx.get(), req, &resp));
      break;
    }
    case 7: {  // a root outside the checkpoint root must be refused
      v1::SaveCheckpointRequest req;
      v1::SaveCheckpointResponse resp;
      if (!Parse(bytes, &req)) break;
      // A relative root, or one under the checkpoint root, is one directory there (bounded disk
      // use, at most 2 checkpoints in it); any other is left as it is, to be refused.
      if (req.root().empty() || req.root()[0] != '/' || absl::StartsWith(req.root(), c.root()))
        req.set_root(c.root() + "/ckpt");
      if (req.keep() <= 0 || req.keep() > 2) req.set_keep(2);
      Report("SaveCheckpoint", stub.SaveCheckpoint(ctx.get(), req, &resp));
      break;
    }
    case 8: {
      v1::RestoreCheckpointRequest req;
      v1::RestoreCheckpointResponse resp;
      if (!Parse(bytes, &req)) break;
      // A relative path names one under that directory ("../" included, to be refused).
      if (!req.path().empty() && req.path()[0] != '/')
        req.set_path(absl::StrCat(c.root(), "/ckpt/", req.path()));
      Report("RestoreCheckpoint", stub.RestoreCheckpoint(ctx.get(), req, &resp));
      break;
    }
    case 9: {
      v1::SubmitJobRequest req;
      if (!Parse(bytes, &req)) break;
      BoundJob(c, req.mutable_job());
      std::unique_ptr<grpc::ClientReader<v1::JobEvent>> reader = stub.SubmitJob(ctx.get(), req);
      v1::JobEvent event;
      while (reader->Read(&event)) {
      }
      Report("SubmitJob", reader->Finish());
      break;
    }
    case 10: {
      v1::ListArraysRequest req;
      v1::ListArraysResponse resp;
      if (Parse(bytes, &req)) Report("ListArrays", stub.ListArrays(ctx.get(), req, &resp));
      break;
    }
    default: {
      v1::GetStatusRequest req;
      v1::GetStatusResponse resp;
      if (Parse(bytes, &req)) Report("GetStatus", stub.GetStatus(ctx.get(), req, &resp));
      break;
    }
  }
}

// What the coordinator does before a worker is involved; `which` picks it.
void CallWithoutWorkers(int which, const std::string& bytes) {
  static const Mesh* mesh = new Mesh(*Mesh::Parse("data=2,model=2"));
  static Partitioner* partitioner = new Partitioner(*mesh, 2);
  switch (which) {
    case 0: {
      v1::JitRequest req;
      if (req.ParseFromString(bytes)) (void)partitioner->Partition(req.program());
      break;
    }
    case 1: {
      v1::PutArrayRequest req;
      if (!req.ParseFromString(bytes)) break;
      absl::StatusOr<Tensor> t = Tensor::FromProto(req.array());
      if (t.ok())
        (void)NamedSharding(*mesh, PartitionSpec::FromProto(req.spec())).Validate(t->dims());
      break;
    }
    case 2:
      (void)ParseJobConfig(bytes);
      break;
    default:
      (void)checkpoint::ParseManifest(bytes);
      break;
  }
}

}  // namespace
}  // namespace meshrun

// The first byte: 0-3 (mod 16) without workers, as the seed corpus's first entries; 4-15 a
// request to the running cluster.
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshrun;
  if (size == 0) return 0;
  const int which = data[0] % 16;
  const std::string bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  if (which < 4) {
    CallWithoutWorkers(which, bytes);
    return 0;
  }
  static Cluster* cluster = new Cluster();
  CallCluster(*cluster, which - 4, bytes);
  return 0;
}
