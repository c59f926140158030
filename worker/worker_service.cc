#include "worker/worker_service.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/port/process.h"
#include "glog/logging.h"
#include "net/grpc_util.h"
#include "worker/kernels/kernel.h"

namespace meshrun {
namespace {

// Whether the two arrays' bytes overlap (one aliases the other's storage, or a part of it).
bool SharesMemory(const Tensor& a, const Tensor& b) {
  const char* pa = static_cast<const char*>(a.raw());
  const char* pb = static_cast<const char*>(b.raw());
  if (pa == nullptr || pb == nullptr || a.size_bytes() == 0 || b.size_bytes() == 0) return false;
  return pa < pb + b.size_bytes() && pb < pa + a.size_bytes();
}

}  // namespace

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

struct WorkerService::RunPlan {
  const v1::RunShardMapRequest* req;
  CachedExecutor* cached;
  std::set<int> returned;  // results returned in the response rather than stored
  std::set<int> donated;   // donate_argnums
  std::vector<int> fed;    // argument -> its field of the feed; -1: an array id
};

namespace {

// Checks `req`'s result and argument indices against `p`. Errors: InvalidArgument naming the
// index and the range expected.
absl::Status CheckRunRequest(const v1::ShardMapProgram& p, const v1::RunShardMapRequest& req) {
  if (p.inputs_size() != req.input_ids_size() || p.outputs_size() != req.output_ids_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("program takes ", p.inputs_size(), " arguments and returns ", p.outputs_size(),
                     "; got ", req.input_ids_size(), " and ", req.output_ids_size(), " array ids"));
  }
  for (int i : req.return_outputs()) {
    if (i < 0 || i >= p.outputs_size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "return_outputs: ", i, " is not a result index (0..", p.outputs_size() - 1, ")"));
    }
  }
  std::set<int> seen;
  for (int a : req.feed().argnums()) {
    if (a < 0 || a >= p.inputs_size() || !seen.insert(a).second) {
      return absl::InvalidArgumentError(absl::StrCat("feed argnums: ", a,
                                                     " is not an argument index (0..",
                                                     p.inputs_size() - 1, ") or is given twice"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

grpc::Status WorkerService::RunProgram(const v1::RunShardMapRequest* req,
                                       v1::RunShardMapResponse* resp) {
  SetComputeThreads(compute_threads_);
  absl::StatusOr<CachedExecutor*> found = ExecutorFor(*req);
  if (!found.ok()) return Error(found.status());
  const v1::ShardMapProgram& p = (*found)->program;
  if (absl::Status s = CheckRunRequest(p, *req); !s.ok()) return Error(s);
  RunPlan plan{req,
               *found,
               {req->return_outputs().begin(), req->return_outputs().end()},
               {req->donate_argnums().begin(), req->donate_argnums().end()},
               std::vector<int>(p.inputs_size(), -1)};
  for (int j = 0; j < req->feed().argnums_size(); ++j) plan.fed[req->feed().argnums(j)] = j;
  // Keras's steps_per_execution: the runs go back to back, each over the arrays the one before
  // left (a TrainState's donated ids are its results' ids).
  for (int k = 0; k <= req->more_runs_size(); ++k) {
    absl::Status s =
        RunOnce(plan, k == 0 ? req->input_ids() : req->more_runs(k - 1).input_ids(), k, resp);
    if (!s.ok()) {
      AbortEpoch(s);  // peers may be waiting in a collective this rank never reached
      return Error(
          req->more_runs_size() == 0
              ? s
              : absl::Status(s.code(), absl::StrCat("run ", k, " of ", req->more_runs_size() + 1,
                                                    ": ", s.message())));
    }
  }
  return grpc::Status::OK;
}

absl::Status WorkerService::RunOnce(const RunPlan& plan,
                                    const google::protobuf::RepeatedPtrField<std::string>& ids,
                                    int k, v1::RunShardMapResponse* resp) {
  const v1::ShardMapProgram& p = plan.cached->program;
  Executor& executor = *plan.cached->executor;
  if (ids.size() != p.inputs_size()) {
    return absl::InvalidArgumentError(absl::StrCat("program takes ", p.inputs_size(),
                                                   " arguments; got ", ids.size(), " array ids"));
  }
  std::vector<Tensor> blocks;  // bound below: alive until the run ends
  // Arguments that stay in the store: a result sharing their memory (one returned as is, or a
  // view of one) is stored as a copy, so that donating either later never writes over the other.
  std::vector<std::shared_ptr<const Tensor>> kept;
  if (absl::Status s = BindArguments(plan, ids, k, blocks, kept); !s.ok()) return s;
  const absl::Time start = absl::Now();
  const absl::Duration collective_before = executor.collective_time();
  if (absl::Status s = executor.Run("main", RunContext{}); !s.ok()) {
    // Recompiled on the next call, from a clean state.
    executors_.erase(executors_.begin() + (plan.cached - executors_.data()));
    return s;
  }
  resp->add_run_seconds(absl::ToDoubleSeconds(absl::Now() - start));
  resp->add_collective_seconds(
      absl::ToDoubleSeconds(executor.collective_time() - collective_before));
  for (const Executor::Arrival& a : executor.TakeArrivals()) {
    if (resp->arrivals_size() >= static_cast<int>(Executor::kMaxArrivals)) break;
    v1::CollectiveArrival* out = resp->add_arrivals();
    out->set_run(k);
    out->set_index(a.index);
    out->set_op(*a.op);
    out->set_axes(*a.axes);
    out->set_unix_micros(absl::ToUnixMicros(a.when));
  }
  if (plan.req->train_steps() && metrics_ != nullptr) metrics_->OnStep();
  return StoreResults(plan, ids, kept, resp);
}

absl::Status WorkerService::BindArguments(
    const RunPlan& plan, const google::protobuf::RepeatedPtrField<std::string>& ids, int k,
    std::vector<Tensor>& blocks, std::vector<std::shared_ptr<const Tensor>>& kept) {
  const v1::RunShardMapRequest& req = *plan.req;
  const v1::ShardMapProgram& p = plan.cached->program;
  Executor& executor = *plan.cached->executor;
  if (req.feed().argnums_size() > 0) {
    absl::StatusOr<std::vector<Tensor>> b = FeedBlocks(req.feed(), k);
    if (!b.ok()) return b.status();
    blocks = *std::move(b);
  }
  for (int i = 0; i < p.inputs_size(); ++i) {
    if (plan.fed[i] >= 0) {
      if (absl::Status s = executor.BindInput(p.inputs(i), blocks[plan.fed[i]], true); !s.ok()) {
        return absl::Status(s.code(), absl::StrCat("argument ", i, " (fed from input '",
                                                   req.feed().input_id(), "'): ", s.message()));
      }
      continue;
    }
    // A donated argument leaves the store; if no one else holds it (a concurrent GetShard), the
    // program may write its results over it. Passed twice or returned as is, it is only read.
    const bool donate = plan.donated.count(i) && std::count(ids.begin(), ids.end(), ids[i]) == 1 &&
                        std::count(p.outputs().begin(), p.outputs().end(), p.inputs(i)) == 0;
    absl::StatusOr<std::shared_ptr<const Tensor>> shard =
        donate ? shards_.Take(ids[i]) : shards_.Get(ids[i]);
    if (!shard.ok()) return shard.status();
    const bool sole_owner = shard->use_count() == 1;
    if (!(donate && sole_owner)) kept.push_back(*shard);
    if (absl::Status s = executor.BindInput(p.inputs(i), **shard, donate && sole_owner); !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("argument ", i, " (array '", ids[i], "'): ", s.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status WorkerService::StoreResults(const RunPlan& plan,
                                         const google::protobuf::RepeatedPtrField<std::string>& ids,
                                         const std::vector<std::shared_ptr<const Tensor>>& kept,
                                         v1::RunShardMapResponse* resp) {
  const v1::RunShardMapRequest& req = *plan.req;
  const v1::ShardMapProgram& p = plan.cached->program;
  Executor& executor = *plan.cached->executor;
  for (int i : req.return_outputs()) {
    absl::StatusOr<Tensor> result = executor.TakeOutput(p.outputs(i));
    if (!result.ok()) return result.status();
    *resp->add_outputs() = result->ToProto();
  }
  for (int i = 0; i < p.outputs_size(); ++i) {
    if (plan.returned.count(i)) continue;
    absl::StatusOr<Tensor> result = executor.TakeOutput(p.outputs(i));
    if (!result.ok()) return result.status();
    const bool shares = std::any_of(kept.begin(), kept.end(),
                                    [&](const auto& arg) { return SharesMemory(*arg, *result); });
    shards_.Put(req.output_ids(i), shares ? Tensor(*result) : *std::move(result));
  }
  // As jax.jit's donation, a donated argument is consumed, also where it was only read (passed
  // twice, returned as is): its id lives on only as a stored result's.
  for (int i : plan.donated) {
    if (i < 0 || i >= ids.size() || plan.fed[i] >= 0) continue;
    bool replaced = false;
    for (int j = 0; j < p.outputs_size(); ++j)
      replaced |= !plan.returned.count(j) && req.output_ids(j) == ids[i];
    if (!replaced) shards_.Delete(ids[i]).IgnoreError();  // NotFound: taken when bound
  }
  return absl::OkStatus();
}

grpc::Status WorkerService::PutShard(grpc::ServerContext*, const v1::PutShardRequest* req,
                                     v1::PutShardResponse*) {
  if (req->array_id().empty()) return Error(absl::InvalidArgumentError("PutShard: empty array id"));
  absl::StatusOr<Tensor> t = Tensor::FromProto(req->shard());
  if (!t.ok()) return Error(t.status());
  const std::shared_ptr<const Tensor> replaced = shards_.Get(req->array_id()).value_or(nullptr);
  const int64_t freed = replaced ? static_cast<int64_t>(replaced->size_bytes()) : 0;
  if (absl::Status s = CheckMemoryBudget(absl::StrCat("PutShard of '", req->array_id(), "'"),
                                         static_cast<int64_t>(t->size_bytes()) - freed);
      !s.ok()) {
    return Error(s);
  }
  shards_.Put(req->array_id(), *std::move(t));
  return grpc::Status::OK;
}

grpc::Status WorkerService::GetShard(grpc::ServerContext*, const v1::GetShardRequest* req,
                                     v1::GetShardResponse* resp) {
  absl::StatusOr<std::shared_ptr<const Tensor>> t = shards_.Get(req->array_id());
  if (!t.ok()) return Error(t.status());
  *resp->mutable_shard() = (*t)->ToProto();
  return grpc::Status::OK;
}

grpc::Status WorkerService::DeleteShard(grpc::ServerContext*, const v1::DeleteShardRequest* req,
                                        v1::DeleteShardResponse*) {
  if (absl::Status s = shards_.Delete(req->array_id()); !s.ok()) return Error(s);
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
