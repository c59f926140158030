#include "worker/worker_service.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/port/process.h"
#include "glog/logging.h"
#include "net/grpc_util.h"
#include "net/tensor_wire.h"
#include "worker/kernels/kernel.h"

namespace meshrun {

WorkerService::WorkerService(int compute_threads, WorkerMetrics* metrics, ShmArena* arena,
                             int64_t memory_budget_bytes, std::string checkpoint_root)
    : compute_threads_(compute_threads),
      memory_budget_bytes_(memory_budget_bytes > 0 ? memory_budget_bytes : PhysicalMemoryBytes()),
      checkpoint_root_(checkpoint_root, "this worker's"),
      metrics_(metrics),
      arena_(arena) {}

absl::Status WorkerService::CheckMemoryBudget(const std::string& what, int64_t bytes) {
  const int64_t held = shards_.TotalBytes() + peer_state_.bytes();
  if (bytes <= memory_budget_bytes_ - held) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat(what, " needs ", bytes, " bytes; this worker holds ", held,
                   " bytes of shards and state copies and its memory budget is ",
                   memory_budget_bytes_, " bytes (--memory_budget_bytes)"));
}

WorkerService::~WorkerService() {
  absl::MutexLock lock(&job_mu_);
  executors_.clear();  // before the transport their collectives use
}

void WorkerService::Join(Membership membership, RingService* ring) {
  absl::MutexLock lock(&join_mu_);
  membership_ = std::move(membership);
  mailbox_ = std::make_unique<Mailbox>(membership_.mesh.size(), absl::Seconds(2),
                                       collective_defaults_.receive_spin);
  transport_ =
      std::make_unique<GrpcTransport>(membership_.rank, membership_.addresses,
                                      membership_.cluster_id, mailbox_.get(), grpc_stripes_);
  if (membership_.shm_peers.size() == membership_.addresses.size()) {
    ShmTransport::Options options;
    options.arena = arena_;
    absl::StatusOr<std::unique_ptr<ShmTransport>> shm =
        ShmTransport::Create(membership_.rank, membership_.cluster_id, membership_.shm_peers,
                             mailbox_.get(), std::move(transport_), options);
    CHECK(shm.ok())
        << shm.status();  // only a malformed membership fails, and Join's caller built it
    std::vector<int> local;
    for (int r = 0; r < (*shm)->world_size(); ++r) {
      if ((*shm)->CoLocated(r)) local.push_back(r);
    }
    LOG(INFO) << "shared-memory links to the ranks on this host: [" << absl::StrJoin(local, ", ")
              << "]; gRPC to the others";
    transport_ = *std::move(shm);
  }
  ring->Attach(mailbox_.get(), membership_.mesh.size(), membership_.cluster_id);
  joined_ = true;
}

grpc::Status WorkerService::Error(const absl::Status& s) const {
  return ToGrpcStatus(
      absl::Status(s.code(), absl::StrCat("rank ", membership_.rank, ": ", s.message())));
}

grpc::Status WorkerService::RunShardMap(grpc::ServerContext*, const v1::RunShardMapRequest* req,
                                        v1::RunShardMapResponse* resp) {
  {
    absl::MutexLock lock(&join_mu_);
    if (!joined_)
      return grpc::Status(grpc::FAILED_PRECONDITION, "worker has not joined a cluster yet");
  }
  EndEarlierEpochs(req->epoch());
  absl::MutexLock lock(&job_mu_);
  if (absl::Status s = EnterEpoch(req->epoch()); !s.ok()) return Error(s);
  grpc::Status status;
  compute_.Run([&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { status = RunProgram(req, resp); });
  return status;
}

absl::StatusOr<WorkerService::CachedExecutor*> WorkerService::ExecutorFor(
    const v1::RunShardMapRequest& req) {
  std::string fingerprint = req.program();
  absl::StrAppend(&fingerprint, "|", req.collective_timeout_seconds());
  auto cached = std::find_if(executors_.begin(), executors_.end(),
                             [&](const CachedExecutor& c) { return c.fingerprint == fingerprint; });
  if (cached != executors_.end()) return &*cached;
  v1::ShardMapProgram p;
  if (!p.ParseFromString(req.program())) {
    return absl::InvalidArgumentError(
        absl::StrCat("the program's ", req.program().size(), " bytes are not a ShardMapProgram"));
  }
  absl::StatusOr<int64_t> bytes = Executor::BufferBytes(p.program());
  if (!bytes.ok()) return bytes.status();
  if (absl::Status s = CheckMemoryBudget("the shard_map program's buffers", *bytes); !s.ok()) {
    return s;
  }
  Executor::Options eo;
  eo.mesh = &membership_.mesh;
  eo.rank = membership_.rank;
  eo.transport = transport_.get();
  eo.collectives = collective_defaults_;
  eo.collectives.timeout =
      absl::Seconds(req.collective_timeout_seconds() > 0 ? req.collective_timeout_seconds() : 30);
  eo.observer = metrics_;
  eo.results.assign(p.outputs().begin(), p.outputs().end());
  absl::StatusOr<std::unique_ptr<Executor>> compiled = Executor::Create(p.program(), eo);
  if (!compiled.ok()) return compiled.status();
  constexpr size_t kMaxCachedPrograms = 4;
  if (executors_.size() >= kMaxCachedPrograms) executors_.erase(executors_.begin());
  executors_.push_back({std::move(fingerprint), std::move(p), *std::move(compiled)});
  return &executors_.back();
}

grpc::ServerUnaryReactor* WorkerService::PutShard(grpc::CallbackServerContext* ctx,
                                                  const grpc::ByteBuffer* request,
                                                  grpc::ByteBuffer* response) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  auto put = [this, reactor, request, response] {
    absl::Status s = PutShardBytes(*request);
    if (s.ok()) {
      const grpc::Slice empty;  // PutShardResponse has no fields
      *response = grpc::ByteBuffer(&empty, 1);
    }
    reactor->Finish(s.ok() ? grpc::Status::OK : Error(s));
  };
  if (request->Length() >= kPutShardInlineBytes) {
    put_threads_.Start(put);
  } else {
    put();
  }
  return reactor;
}

absl::Status WorkerService::PutShardBytes(const grpc::ByteBuffer& request) {
  v1::PutShardRequest rest;
  Tensor t;
  if (absl::Status s = ParseWithTensor(request, /*PutShardRequest.shard*/ 2, &rest, &t); !s.ok())
    return s;
  if (rest.array_id().empty()) return absl::InvalidArgumentError("PutShard: empty array id");
  const std::shared_ptr<const Tensor> replaced = shards_.Get(rest.array_id()).value_or(nullptr);
  const int64_t freed = replaced ? static_cast<int64_t>(replaced->size_bytes()) : 0;
  if (absl::Status s = CheckMemoryBudget(absl::StrCat("PutShard of '", rest.array_id(), "'"),
                                         static_cast<int64_t>(t.size_bytes()) - freed);
      !s.ok()) {
    return s;
  }
  shards_.Put(rest.array_id(), std::move(t));
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* WorkerService::GetShard(grpc::CallbackServerContext* ctx,
                                                  const grpc::ByteBuffer* request,
                                                  grpc::ByteBuffer* response) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  v1::GetShardRequest req;
  if (absl::Status s = ParseMessage(*request, &req); !s.ok()) {
    reactor->Finish(Error(s));
    return reactor;
  }
  absl::StatusOr<grpc::ByteBuffer> out = GetShardBytes(req);
  if (!out.ok()) {
    reactor->Finish(Error(out.status()));
    return reactor;
  }
  *response = *std::move(out);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

absl::StatusOr<grpc::ByteBuffer> WorkerService::GetShardBytes(const v1::GetShardRequest& req) {
  absl::StatusOr<std::shared_ptr<const Tensor>> t = shards_.Get(req.array_id());
  if (!t.ok()) return t.status();
  const Tensor& shard = **t;
  grpc::Slice slices[2] = {
      grpc::Slice(TensorFieldPrefix(/*GetShardResponse.shard*/ 1, shard.dtype(), shard.dims(),
                                    shard.size_bytes())),
      grpc::Slice()};
  if (shard.size_bytes() == 0) return grpc::ByteBuffer(slices, 1);
  const void* data = shard.raw();
  const size_t bytes = shard.size_bytes();
  slices[1] = BorrowedSlice(*std::move(t), data, bytes);
  return grpc::ByteBuffer(slices, 2);
}

grpc::Status WorkerService::DeleteShard(grpc::ServerContext*, const v1::DeleteShardRequest* req,
                                        v1::DeleteShardResponse*) {
  std::vector<std::string> unknown;
  for (const std::string& id : req->array_ids()) {
    if (!shards_.Delete(id).ok()) unknown.push_back(absl::StrCat("'", id, "'"));
  }
  if (!unknown.empty()) {
    return Error(absl::NotFoundError(
        absl::StrCat("no array ", absl::StrJoin(unknown, ", "), " on this worker")));
  }
  return grpc::Status::OK;
}

grpc::Status WorkerService::BenchmarkCollective(grpc::ServerContext*,
                                                const v1::BenchmarkCollectiveRequest* req,
                                                v1::BenchmarkCollectiveResponse* resp) {
  {
    absl::MutexLock lock(&join_mu_);
    if (!joined_)
      return grpc::Status(grpc::FAILED_PRECONDITION, "worker has not joined a cluster yet");
  }
  EndEarlierEpochs(req->epoch());
  absl::MutexLock lock(&job_mu_);
  if (absl::Status s = EnterEpoch(req->epoch()); !s.ok()) return Error(s);
  if (req->num_bytes() < 0 || req->iters() < 1) {
    return Error(absl::InvalidArgumentError(absl::StrCat(
        "num_bytes ", req->num_bytes(), " and iters ", req->iters(), "; expected >= 0 and >= 1")));
  }
  const Mesh& mesh = membership_.mesh;
  std::vector<std::string> names(req->axis_names().begin(), req->axis_names().end());
  if (names.empty()) {
    for (int a = 0; a < mesh.num_axes(); ++a) names.push_back(mesh.axis_name(a));
  }
  absl::StatusOr<std::vector<int>> axes = mesh.AxisIndices(names);
  if (!axes.ok()) return Error(axes.status());
  std::vector<int> world(mesh.size());
  std::iota(world.begin(), world.end(), 0);
  CollectiveOptions options = collective_defaults_;
  if (req->algorithm() == "ring") {
    options.small_message_bytes = 0;
    options.one_shot_max_bytes = 0;
  } else if (req->algorithm() == "recursive_doubling") {
    options.small_message_bytes = options.chunk_bytes;
    options.one_shot_max_bytes = 0;
  } else if (req->algorithm() == "one_shot") {
    options.one_shot_max_bytes = options.chunk_bytes;
  } else if (!req->algorithm().empty()) {
    return Error(absl::InvalidArgumentError(
        absl::StrCat("algorithm '", req->algorithm(),
                     "'; expected ring, recursive_doubling, one_shot or empty")));
  }
  Communicator everyone(transport_.get(), world, options);
  Communicator comm(transport_.get(), mesh.AxesGroup(membership_.rank, *axes), options);
  const int64_t n = comm.size();
  const int64_t count = req->num_bytes() / 4 / n * n;  // divisible by the group for the scatters
  if (absl::Status s = CheckMemoryBudget("the benchmark's two buffers", 2 * count * 4); !s.ok()) {
    return Error(s);
  }
  // Tensors, so the buffers live where a program's would (the shared arena for large ones).
  Tensor ta(v1::DTYPE_F32, {count}), tb(v1::DTYPE_F32, {count});
  std::fill_n(ta.data<float>(), count, 1.0f);
  float* a = ta.data<float>();
  float* b = tb.data<float>();
  std::vector<std::pair<int, int>> shift;
  for (int i = 0; i < n; ++i) shift.push_back({i, static_cast<int>((i + 1) % n)});
  std::function<absl::Status()> run;
  if (req->op() == "psum") {
    run = [&] { return comm.AllReduce(a, count, v1::DTYPE_F32, ReduceOp::kSum); };
  } else if (req->op() == "all_gather") {
    run = [&] { return comm.AllGather(a, count / n, v1::DTYPE_F32, b); };
  } else if (req->op() == "psum_scatter") {
    run = [&] { return comm.ReduceScatter(a, count / n, v1::DTYPE_F32, ReduceOp::kSum, b); };
  } else if (req->op() == "ppermute") {
    run = [&] { return comm.Permute(a, count, v1::DTYPE_F32, shift, b); };
  } else {
    return Error(absl::InvalidArgumentError(
        absl::StrCat("unknown collective '", req->op(),
                     "'; allowed: psum, all_gather, psum_scatter, ppermute")));
  }
  float token = 0;
  for (int i = 0; i < req->warmup_iters() + req->iters(); ++i) {
    // A 1-element all-reduce over every worker lines them up, so each timed call starts together.
    absl::Status s = everyone.AllReduce(&token, 1, v1::DTYPE_F32, ReduceOp::kSum);
    const absl::Time start = absl::Now();
    if (s.ok()) s = run();
    if (!s.ok()) {
      AbortEpoch(s);
      return Error(s);
    }
    if (i >= req->warmup_iters()) resp->add_seconds(absl::ToDoubleSeconds(absl::Now() - start));
  }
  resp->set_group_size(static_cast<int>(n));
  return grpc::Status::OK;
}

}  // namespace meshrun
