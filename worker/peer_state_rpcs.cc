// WorkerService's peers' in-memory TrainState RPCs (worker.proto's KeepPeerState and the rest;
// worker/peer_state.h holds the copies).
#include "absl/strings/str_cat.h"
#include "core/sharding/named_sharding.h"
#include "net/grpc_util.h"
#include "worker/worker_service.h"

namespace meshrun {
namespace {

absl::Duration TimeoutOr60s(double seconds) {
  return seconds > 0 ? absl::Seconds(seconds) : absl::Seconds(60);
}

std::unique_ptr<v1::Worker::Stub> SuccessorStub(const Membership& m) {
  return v1::Worker::NewStub(CreateChannel(m.addresses[(m.rank + 1) % m.mesh.size()]));
}

}  // namespace

grpc::Status WorkerService::KeepPeerState(grpc::ServerContext*, const v1::KeepPeerStateRequest* req,
                                          v1::KeepPeerStateResponse* resp) {
  absl::StatusOr<Membership> joined = JoinedMembership();
  if (!joined.ok()) return Error(joined.status());
  const Membership& m = *joined;
  if (req->key().job().empty())
    return Error(absl::InvalidArgumentError("keep peer state: empty job token"));
  v1::PeerStateKey key = req->key();
  key.set_owner_rank(m.rank);
  key.set_mesh(m.mesh.ToString());
  // The blocks are copied now: a later step donates them and overwrites them in place.
  std::vector<v1::PeerStateBlock> blocks;
  int64_t bytes = 0;
  for (const v1::SaveItem& item : req->items()) {
    absl::StatusOr<std::shared_ptr<const Tensor>> shard = shards_.Get(item.array_id());
    if (!shard.ok()) return Error(shard.status());
    bytes += static_cast<int64_t>((*shard)->size_bytes());
    if (absl::Status s = CheckMemoryBudget("this worker's copy of its state", bytes); !s.ok())
      return Error(s);
    v1::PeerStateBlock b;
    b.set_name(item.name());
    *b.mutable_block() = (*shard)->ToProto();
    blocks.push_back(std::move(b));
  }
  if (m.mesh.size() > 1) {
    const absl::Time deadline = absl::Now() + TimeoutOr60s(req->timeout_seconds());
    std::unique_ptr<v1::Worker::Stub> next = SuccessorStub(m);
    const int next_rank = (m.rank + 1) % m.mesh.size();
    for (size_t i = 0; i <= blocks.size(); ++i) {  // one array a call, then the commit
      v1::HoldPeerStateRequest hold;
      *hold.mutable_key() = key;
      if (i < blocks.size()) {
        *hold.mutable_block() = blocks[i];
      } else {
        hold.set_commit(true);
      }
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(deadline));
      v1::HoldPeerStateResponse ignored;
      if (grpc::Status s = next->HoldPeerState(&ctx, hold, &ignored); !s.ok()) {
        return Error(FromGrpcStatus(s, absl::StrCat("keeping a copy of the state on rank ",
                                                    next_rank, " (", m.addresses[next_rank], ")")));
      }
    }
  }
  for (v1::PeerStateBlock& b : blocks) peer_state_.Add(key, std::move(b));
  if (absl::Status s = peer_state_.Commit(key); !s.ok()) return Error(s);
  resp->set_bytes(bytes);
  return grpc::Status::OK;
}

grpc::Status WorkerService::HoldPeerState(grpc::ServerContext*, const v1::HoldPeerStateRequest* req,
                                          v1::HoldPeerStateResponse*) {
  absl::StatusOr<Membership> joined = JoinedMembership();
  if (!joined.ok()) return Error(joined.status());
  const int n = joined->mesh.size();
  if (req->key().owner_rank() < 0 || req->key().owner_rank() >= n) {
    return Error(absl::InvalidArgumentError(absl::StrCat(
        "hold peer state: owner rank ", req->key().owner_rank(), " is not in [0, ", n, ")")));
  }
  if (req->commit()) {
    absl::Status s = peer_state_.Commit(req->key());
    return s.ok() ? grpc::Status::OK : Error(s);
  }
  if (absl::Status s =
          CheckMemoryBudget(absl::StrCat("rank ", req->key().owner_rank(), "'s state copy"),
                            static_cast<int64_t>(req->block().ByteSizeLong()));
      !s.ok())
    return Error(s);
  peer_state_.Add(req->key(), req->block());
  return grpc::Status::OK;
}

grpc::Status WorkerService::PeerStateInfo(grpc::ServerContext*, const v1::PeerStateInfoRequest*,
                                          v1::PeerStateInfoResponse* resp) {
  *resp = peer_state_.Info();
  return grpc::Status::OK;
}

grpc::Status WorkerService::DropPeerState(grpc::ServerContext*, const v1::DropPeerStateRequest* req,
                                          v1::DropPeerStateResponse* resp) {
  resp->set_bytes(peer_state_.Drop(req->job()));
  return grpc::Status::OK;
}

grpc::Status WorkerService::FetchPeerState(grpc::ServerContext*,
                                           const v1::FetchPeerStateRequest* req,
                                           v1::FetchPeerStateResponse* resp) {
  for (const std::string& name : req->names()) {
    absl::StatusOr<v1::PeerStateBlock> b = peer_state_.Find(req->key(), name);
    if (!b.ok()) return Error(b.status());
    *resp->add_blocks() = *std::move(b);
  }
  return grpc::Status::OK;
}

absl::StatusOr<std::vector<v1::PeerStateBlock>> WorkerService::FetchFromSuccessor(
    const Membership& m, const v1::PeerStateKey& key, const std::vector<std::string>& names,
    absl::Time deadline) {
  const int next_rank = (m.rank + 1) % m.mesh.size();
  if (next_rank == m.rank) {
    return absl::NotFoundError(absl::StrCat("no copy of ", DescribePeerStateKey(key),
                                            " is held here, and there is no other rank"));
  }
  v1::FetchPeerStateRequest fetch;
  *fetch.mutable_key() = key;
  for (const std::string& name : names) fetch.add_names(name);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  v1::FetchPeerStateResponse got;
  grpc::Status s = SuccessorStub(m)->FetchPeerState(&ctx, fetch, &got);
  if (!s.ok()) {
    return FromGrpcStatus(
        s, absl::StrCat("fetching ", names.size(), " blocks of ", DescribePeerStateKey(key),
                        " from successor rank ", next_rank, " (", m.addresses[next_rank], ")"));
  }
  if (got.blocks_size() != static_cast<int>(names.size())) {
    return absl::DataLossError(absl::StrCat("successor rank ", next_rank, " sent ",
                                            got.blocks_size(), " blocks for ", names.size(),
                                            " names"));
  }
  return std::vector<v1::PeerStateBlock>(std::make_move_iterator(got.mutable_blocks()->begin()),
                                         std::make_move_iterator(got.mutable_blocks()->end()));
}

grpc::Status WorkerService::RestorePeerState(grpc::ServerContext*,
                                             const v1::RestorePeerStateRequest* req,
                                             v1::RestorePeerStateResponse* resp) {
  absl::StatusOr<Membership> joined = JoinedMembership();
  if (!joined.ok()) return Error(joined.status());
  const Membership& m = *joined;
  if (req->key().owner_rank() != m.rank || req->key().mesh() != m.mesh.ToString()) {
    return Error(absl::InvalidArgumentError(
        absl::StrCat("restore peer state: ", DescribePeerStateKey(req->key()), " is not rank ",
                     m.rank, "'s on mesh ", m.mesh.ToString())));
  }
  // This worker's own copy first (kept over its restart); what it lacks (it is the replacement
  // of a lost worker) from its successor's in one call.
  std::vector<v1::PeerStateBlock> blocks(req->items_size());
  std::vector<bool> from_successor(req->items_size());
  std::vector<std::string> missing;
  std::vector<int> missing_at;
  for (int i = 0; i < req->items_size(); ++i) {
    absl::StatusOr<v1::PeerStateBlock> b = peer_state_.Find(req->key(), req->items(i).name());
    if (b.ok()) {
      blocks[i] = *std::move(b);
    } else {
      missing.push_back(req->items(i).name());
      missing_at.push_back(i);
    }
  }
  if (!missing.empty()) {
    absl::StatusOr<std::vector<v1::PeerStateBlock>> fetched = FetchFromSuccessor(
        m, req->key(), missing, absl::Now() + TimeoutOr60s(req->timeout_seconds()));
    if (!fetched.ok()) return Error(fetched.status());
    for (size_t j = 0; j < missing.size(); ++j) {
      blocks[missing_at[j]] = std::move((*fetched)[j]);
      from_successor[missing_at[j]] = true;
    }
  }
  // Everything is checked before anything is stored: a failure stores nothing.
  std::vector<std::pair<std::string, Tensor>> restored;
  for (int i = 0; i < req->items_size(); ++i) {
    const v1::LoadItem& item = req->items(i);
    const Dims global(item.global_shape().dims().begin(), item.global_shape().dims().end());
    const NamedSharding sharding(m.mesh, PartitionSpec::FromProto(item.spec()));
    if (absl::Status s = sharding.Validate(global); !s.ok()) {
      return Error(
          absl::InvalidArgumentError(absl::StrCat("array ", item.name(), ": ", s.message())));
    }
    absl::StatusOr<Tensor> block = Tensor::FromProto(blocks[i].block());
    if (!block.ok()) return Error(block.status());
    const Dims want = sharding.ShardDims(global);
    if (block->dtype() != item.dtype() || block->dims() != want) {
      return Error(absl::InvalidArgumentError(
          absl::StrCat("array ", item.name(), ": the copy of ", DescribePeerStateKey(req->key()),
                       " holds ", DTypeName(block->dtype()), DimsToString(block->dims()), "; rank ",
                       m.rank, "'s block is ", DTypeName(item.dtype()), DimsToString(want))));
    }
    restored.emplace_back(item.array_id(), *std::move(block));
  }
  int64_t from_peer = 0, total = 0;
  for (int i = 0; i < req->items_size(); ++i) {
    const auto bytes = static_cast<int64_t>(restored[i].second.size_bytes());
    total += bytes;
    if (from_successor[i]) from_peer += bytes;
  }
  resp->set_bytes_local(total - from_peer);
  resp->set_bytes_from_peer(from_peer);
  for (auto& [id, t] : restored) shards_.Put(id, std::move(t));
  return grpc::Status::OK;
}

}  // namespace meshrun
