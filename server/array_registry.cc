#include "server/array_registry.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/sharding/shard_layout.h"
#include "core/spmd/jit.h"
#include "glog/logging.h"
#include "grpc/slice.h"
#include "net/grpc_util.h"
#include "net/tensor_wire.h"

namespace meshrun {
namespace {

// `spec` with the mesh axes it leaves out (those whose devices hold the same block) appended to
// the first dim of the block that their product divides, so each holder of a block gets 1/k of
// it; nullopt when no axis is left out or no dim divides.
std::optional<PartitionSpec> SplitAmongHolders(const Mesh& mesh, const Dims& dims,
                                               const PartitionSpec& spec) {
  std::vector<PartitionSpec::Entry> entries = spec.Padded(dims.size());
  std::set<std::string> used;
  for (const PartitionSpec::Entry& e : entries) used.insert(e.begin(), e.end());
  PartitionSpec::Entry left_out;
  int64_t holders = 1;
  for (int i = 0; i < mesh.num_axes(); ++i) {
    if (mesh.axis_size(i) == 1 || used.count(mesh.axis_name(i))) continue;
    left_out.push_back(mesh.axis_name(i));
    holders *= mesh.axis_size(i);
  }
  if (left_out.empty()) return std::nullopt;
  const Dims block = NamedSharding(mesh, spec).ShardDims(dims);
  for (size_t d = 0; d < block.size(); ++d) {
    if (block[d] < holders || block[d] % holders != 0) continue;
    entries[d].insert(entries[d].end(), left_out.begin(), left_out.end());
    return PartitionSpec(std::move(entries));
  }
  return std::nullopt;
}

}  // namespace

void ArrayRegistry::ForgetIfReformed() {
  if (stubs_ == nullptr || workers_->generation() == stubs_generation_) return;
  // The cluster re-formed: its workers started afresh, so the arrays and inputs they held are
  // gone, and they may listen elsewhere.
  LOG(WARNING) << "the cluster re-formed: " << arrays_.size() << " arrays and " << inputs_.size()
               << " inputs of the previous workers are gone";
  stubs_.reset();
  gone_.clear();
  for (const auto& [id, info] : arrays_) gone_.insert(id);
  arrays_.clear();
  inputs_.clear();
}

std::string ArrayRegistry::RandomIdPrefix() {
  std::random_device random;
  return absl::StrCat("array-", absl::Hex(random(), absl::kZeroPad8), "-");
}

std::string ArrayRegistry::NewIdLocked() { return absl::StrCat(id_prefix_, next_id_++); }

absl::Status ArrayRegistry::NoSuchArray(const std::string& id) const {
  if (gone_.count(id)) {
    return absl::NotFoundError(absl::StrCat(
        "array '", id, "' is gone: the cluster re-formed after a worker was lost, and the arrays ",
        "its previous workers held went with them (put it again, or restore a checkpoint)"));
  }
  std::vector<std::string> ids;
  for (const auto& [k, v] : arrays_) ids.push_back(k);
  return absl::NotFoundError(absl::StrCat("no array '", id, "' on this cluster (arrays: ",
                                          ids.empty() ? "none" : absl::StrJoin(ids, ", "), ")"));
}

absl::StatusOr<ArrayRegistry::StubsRef> ArrayRegistry::EnsureStubs() {
  absl::MutexLock lock(&mu_);
  ForgetIfReformed();
  if (stubs_ != nullptr) return stubs_;
  if (absl::Status s = workers_->WaitUntilReady(absl::Now() + absl::Seconds(10)); !s.ok()) return s;
  auto stubs = std::make_shared<Stubs>();
  for (const auto& p : workers_->Peers()) {
    stubs->channels.push_back(CreateChannel(p.address()));
    stubs->stubs.push_back(v1::Worker::NewStub(stubs->channels.back()));
  }
  stubs_ = std::move(stubs);
  stubs_generation_ = workers_->generation();
  return stubs_;
}

absl::StatusOr<ArrayRegistry::StubsRef> ArrayRegistry::CurrentStubs() {
  absl::MutexLock lock(&mu_);
  if (stubs_ == nullptr) return absl::FailedPreconditionError("no worker has been reached yet");
  return stubs_;
}

absl::Status ArrayRegistry::ForRanks(
    const std::vector<int>& ranks,
    const std::function<grpc::Status(int, grpc::ClientContext*)>& call) {
  std::vector<grpc::Status> status(ranks.size());
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::string> dead_why(ranks.size());
  absl::Mutex mu;
  std::vector<char> done(ranks.size(), 0);
  size_t pending = ranks.size();
  std::vector<std::thread> threads;
  for (size_t i = 0; i < ranks.size(); ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    SetTimeout(*contexts.back(), rpc_timeout_);
  }
  for (size_t i = 0; i < ranks.size(); ++i) {
    threads.emplace_back([&, i] {
      grpc::Status s = call(ranks[i], contexts[i].get());
      absl::MutexLock lock(&mu);
      status[i] = std::move(s);
      done[i] = 1;
      --pending;
    });
  }
  {
    // A worker that dies or stops meanwhile fails its call at once, not at the RPC deadline.
    absl::MutexLock lock(&mu);
    auto settled = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu) { return pending == 0; };
    AwaitWatchingWorkers(mu, settled, [&](const DeadWorkers& dead) ABSL_NO_THREAD_SAFETY_ANALYSIS {
      for (const auto& [rank, why] : dead) {
        for (size_t i = 0; i < ranks.size(); ++i) {
          if (ranks[i] != rank || done[i] || !dead_why[i].empty()) continue;
          dead_why[i] = why;
          contexts[i]->TryCancel();
        }
      }
      return false;
    });
  }
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (!dead_why[i].empty() && !status[i].ok()) {
      return absl::UnavailableError(
          absl::StrCat("worker ", workers_->Describe(ranks[i]), " ", dead_why[i]));
    }
    if (!status[i].ok())
      return FromGrpcStatus(status[i], absl::StrCat("worker ", workers_->Describe(ranks[i])));
  }
  return absl::OkStatus();
}

void ArrayRegistry::AwaitWatchingWorkers(absl::Mutex& mu, const std::function<bool()>& settled,
                                         const std::function<bool(const DeadWorkers&)>& on_poll) {
  auto done = [&settled]() { return settled(); };
  while (!mu.AwaitWithTimeout(absl::Condition(&done), absl::Milliseconds(100))) {
    if (on_poll(workers_->DeadRanks(heartbeat_timeout_))) return;
  }
}

absl::StatusOr<v1::ArrayInfo> ArrayRegistry::Put(const Tensor& global, const PartitionSpec& spec,
                                                 std::string id) {
  const NamedSharding sharding(workers_->mesh(), spec);
  if (absl::Status s = sharding.Validate(global.dims()); !s.ok()) return s;
  absl::StatusOr<StubsRef> stubs = EnsureStubs();
  if (!stubs.ok()) return stubs.status();
  {
    absl::MutexLock lock(&mu_);
    if (id.empty()) id = NewIdLocked();
    if (arrays_.count(id))
      return absl::InvalidArgumentError(absl::StrCat("array id '", id, "' is in use"));
  }
  const int64_t block_bytes =
      NumElements(sharding.ShardDims(global.dims())) * DTypeSize(global.dtype());
  if (put_gather_min_bytes_ >= 0 && block_bytes >= put_gather_min_bytes_) {
    if (std::optional<PartitionSpec> split =
            SplitAmongHolders(workers_->mesh(), global.dims(), spec)) {
      absl::StatusOr<v1::ArrayInfo> gathered = PutGathered(global, spec, *split, id);
      if (gathered.ok()) return gathered;
      // The gather needs the pieces and the block at once (a worker's budget may allow only the
      // block): every holder is sent its whole block instead, as without the gather.
      LOG(WARNING) << "put of '" << id << "' in pieces failed (" << gathered.status()
                   << "); sending every holder its whole block";
    }
  }
  std::vector<int> ranks(workers_->expected());
  std::iota(ranks.begin(), ranks.end(), 0);
  absl::Status s = SendShards(**stubs, ranks, global, sharding, id);
  if (!s.ok()) {
    DropOnWorkers(**stubs, {id}).IgnoreError();
    return s;
  }
  v1::ArrayInfo info;
  info.set_id(id);
  info.set_dtype(global.dtype());
  for (int64_t d : global.dims()) info.mutable_shape()->add_dims(d);
  *info.mutable_sharding() = sharding.ToProto();
  info.set_bytes_per_worker(NumElements(sharding.ShardDims(global.dims())) *
                            DTypeSize(global.dtype()));
  absl::MutexLock lock(&mu_);
  arrays_[id] = info;
  gone_.erase(id);  // an id put again names the new array
  return info;
}

absl::StatusOr<v1::ArrayInfo> ArrayRegistry::PutGathered(const Tensor& global,
                                                         const PartitionSpec& spec,
                                                         const PartitionSpec& split,
                                                         const std::string& id) {
  absl::StatusOr<v1::ArrayInfo> pieces = Put(global, split, "");
  if (!pieces.ok()) return pieces.status();
  absl::StatusOr<v1::ShardMapResponse> run = GatherPieces(global, spec, split, pieces->id(), id);
  if (!run.ok()) {
    Delete(pieces->id()).IgnoreError();  // already gone if the run consumed it
    return run.status();
  }
  absl::MutexLock lock(&mu_);
  gone_.erase(id);  // an id put again names the new array
  return run->outputs(0);
}

absl::StatusOr<v1::ShardMapResponse> ArrayRegistry::GatherPieces(const Tensor& global,
                                                                 const PartitionSpec& spec,
                                                                 const PartitionSpec& split,
                                                                 const std::string& pieces_id,
                                                                 const std::string& id) {
  JitBuilder gather(workers_->mesh());
  gather.Output(gather.Input(global.dtype(), global.dims(), split), spec);
  absl::StatusOr<v1::ShardMapProgram> program = gather.Build();
  if (!program.ok()) return program.status();
  std::string serialized;
  if (!program->SerializeToString(&serialized))
    return absl::InternalError("the gather program does not serialize");
  v1::ShardMapRequest call;
  call.add_input_ids(pieces_id);
  call.add_output_ids(id);
  call.add_donate_argnums(0);  // the pieces' memory is freed by the run
  return ShardMap(*program, serialized, call);
}

grpc::ByteBuffer PutShardRequestBytes(const Tensor& global, const NamedSharding& sharding, int rank,
                                      const std::string& id) {
  v1::PutShardRequest head;
  head.set_array_id(id);
  const Dims dims = sharding.ShardDims(global.dims());
  const uint64_t data_bytes = NumElements(dims) * DTypeSize(global.dtype());
  std::string prefix = head.SerializeAsString();
  prefix += TensorFieldPrefix(/*PutShardRequest.shard*/ 2, global.dtype(), dims, data_bytes);
  grpc_slice slice = grpc_slice_malloc(prefix.size() + data_bytes);
  char* p = reinterpret_cast<char*>(GRPC_SLICE_START_PTR(slice));
  std::memcpy(p, prefix.data(), prefix.size());
  ExtractShardInto(global, sharding, rank, p + prefix.size());
  grpc::Slice owned(slice, grpc::Slice::STEAL_REF);
  return grpc::ByteBuffer(&owned, 1);
}

absl::Status ArrayRegistry::SendShards(const Stubs& stubs, const std::vector<int>& ranks,
                                       const Tensor& global, const NamedSharding& sharding,
                                       const std::string& id) {
  // One serialised request per distinct block, built by the first of its holders to need it; the
  // others' calls send the same bytes (a ByteBuffer shares its slices), and it is freed when the
  // last holder's call ends. Each block has its own lock, so distinct blocks are built at once.
  struct Block {
    absl::Mutex mu;
    std::optional<grpc::ByteBuffer> request ABSL_GUARDED_BY(mu);
    int calls_left ABSL_GUARDED_BY(mu) = 0;  // holders whose call has not ended
  };
  const std::vector<std::vector<int>> holders = BlockHolders(global.dims(), sharding);
  std::vector<Block> blocks(holders.size());
  std::vector<int> block_of(ranks.size(), -1);
  for (size_t b = 0; b < holders.size(); ++b) {
    for (int r : holders[b]) block_of[r] = static_cast<int>(b);
    absl::MutexLock lock(&blocks[b].mu);
    blocks[b].calls_left = static_cast<int>(holders[b].size());
  }
  // The blocks built at once are bounded by their bytes, not by the worker count.
  const int64_t shard_bytes =
      NumElements(sharding.ShardDims(global.dims())) * DTypeSize(global.dtype());
  const int64_t budget = std::max(kPutBytesInFlight, shard_bytes);
  absl::Mutex mu;
  int64_t built = 0;
  auto fits = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu) { return built + shard_bytes <= budget; };
  // Rank r's request: its block's, built under the block's lock if no holder has built it yet.
  auto request_of = [&](int r) {
    Block& block = blocks[block_of[r]];
    absl::MutexLock lock(&block.mu);
    if (!block.request.has_value()) {
      {
        absl::MutexLock budget_lock(&mu);
        mu.Await(absl::Condition(&fits));
        built += shard_bytes;
      }
      block.request = PutShardRequestBytes(global, sharding, r, id);
    }
    return *block.request;
  };
  auto call_ended = [&](int r) {
    Block& block = blocks[block_of[r]];
    absl::MutexLock lock(&block.mu);
    if (--block.calls_left > 0 || !block.request.has_value()) return;
    block.request.reset();
    absl::MutexLock budget_lock(&mu);
    built -= shard_bytes;
  };
  const std::string method = MethodPath(v1::Worker::service_full_name(), "PutShard");
  return ForRanks(ranks, [&](int r, grpc::ClientContext* ctx) {
    absl::Cleanup ended = [&] { call_ended(r); };
    const grpc::ByteBuffer request = request_of(r);
    SetTimeout(*ctx, rpc_timeout_);  // from now: the wait for the budget is not the call's
    grpc::ByteBuffer response;
    return RawUnaryCall(stubs.channels[r], ctx, method, request, &response);
  });
}

absl::StatusOr<v1::ArrayInfo> ArrayRegistry::Info(const std::string& id) {
  absl::MutexLock lock(&mu_);
  ForgetIfReformed();
  auto it = arrays_.find(id);
  if (it == arrays_.end()) return NoSuchArray(id);
  return it->second;
}

absl::StatusOr<grpc::ByteBuffer> ArrayRegistry::GetArrayBytes(const std::string& id) {
  absl::StatusOr<v1::ArrayInfo> info = Info(id);
  if (!info.ok()) return info.status();
  absl::StatusOr<StubsRef> stubs = CurrentStubs();
  if (!stubs.ok()) return stubs.status();
  absl::StatusOr<NamedSharding> sharding = NamedSharding::FromProto(info->sharding());
  if (!sharding.ok()) return sharding.status();
  const Dims dims(info->shape().dims().begin(), info->shape().dims().end());
  std::vector<int> ranks;
  for (const auto& holders : BlockHolders(dims, *sharding)) ranks.push_back(holders.front());
  v1::GetShardRequest get;
  get.set_array_id(id);
  const grpc::Slice get_bytes(get.SerializeAsString());
  const grpc::ByteBuffer request(&get_bytes, 1);
  const std::string method = MethodPath(v1::Worker::service_full_name(), "GetShard");
  std::vector<grpc::ByteBuffer> shards(workers_->expected());
  absl::Status s = ForRanks(ranks, [&](int r, grpc::ClientContext* ctx) {
    return RawUnaryCall((**stubs).channels[r], ctx, method, request, &shards[r]);
  });
  if (!s.ok()) return s;
  // GetArrayResponse{info, blocks, block_ranks}: each block is the Tensor inside a worker's
  // GetShardResponse, its slices passed on as they came.
  std::vector<grpc::Slice> out;
  AppendField(out, /*info*/ 1, {grpc::Slice(info->SerializeAsString())});
  std::string packed_ranks;
  for (int r : ranks) {
    absl::StatusOr<std::vector<grpc::Slice>> tensor = SoleFieldContents(shards[r], 1);
    if (!tensor.ok()) {  // not protobuf's own layout (an empty response): parse it
      v1::GetShardResponse parsed;
      if (absl::Status s = ParseMessage(shards[r], &parsed); !s.ok()) {
        return absl::InternalError(
            absl::StrCat("worker ", workers_->Describe(r), "'s GetShard response: ", s.message()));
      }
      tensor = std::vector<grpc::Slice>{grpc::Slice(parsed.shard().SerializeAsString())};
    }
    AppendField(out, /*blocks*/ 2, *std::move(tensor));
    AppendVarint(packed_ranks, static_cast<uint64_t>(r));
  }
  AppendField(out, /*block_ranks, packed*/ 3, {grpc::Slice(packed_ranks)});
  return grpc::ByteBuffer(out.data(), out.size());
}

absl::Status ArrayRegistry::Delete(absl::Span<const std::string> ids) {
  std::vector<std::string> known, unknown;
  absl::Status missing;  // NoSuchArray's message for a single unknown id
  {
    absl::MutexLock lock(&mu_);
    ForgetIfReformed();
    std::set<std::string> seen;
    for (const std::string& id : ids) {
      if (!seen.insert(id).second) continue;
      if (arrays_.count(id)) {
        known.push_back(id);
      } else {
        unknown.push_back(absl::StrCat("'", id, "'"));
        if (missing.ok()) missing = NoSuchArray(id);
      }
    }
  }
  if (unknown.size() > 1) {
    missing = absl::NotFoundError(
        absl::StrCat("no arrays ", absl::StrJoin(unknown, ", "), " on this cluster"));
  }
  if (known.empty()) return missing;
  absl::StatusOr<StubsRef> stubs = CurrentStubs();
  if (!stubs.ok()) return stubs.status();
  absl::Status s = DropOnWorkers(**stubs, known);
  absl::MutexLock lock(&mu_);
  for (const std::string& id : known) arrays_.erase(id);
  return s.ok() ? missing : s;
}

absl::Status ArrayRegistry::DropOnWorkers(const Stubs& stubs, const std::vector<std::string>& ids) {
  std::vector<int> ranks(workers_->expected());
  std::iota(ranks.begin(), ranks.end(), 0);
  return ForRanks(ranks, [&](int r, grpc::ClientContext* ctx) {
    v1::DeleteShardRequest req;
    *req.mutable_array_ids() = {ids.begin(), ids.end()};
    v1::DeleteShardResponse resp;
    return stubs[r]->DeleteShard(ctx, req, &resp);
  });
}

std::vector<v1::ArrayInfo> ArrayRegistry::List() {
  absl::MutexLock lock(&mu_);
  std::vector<v1::ArrayInfo> out;
  for (const auto& [id, info] : arrays_) out.push_back(info);
  return out;
}

}  // namespace meshrun
