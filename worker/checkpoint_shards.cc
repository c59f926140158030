// WorkerService's checkpoint RPCs: each worker writes the blocks it owns and reads back the saved
// blocks its target block needs (core/checkpoint/checkpoint.h has the format).
#include <algorithm>
#include <filesystem>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/checkpoint/checkpoint.h"
#include "core/sharding/named_sharding.h"
#include "net/grpc_util.h"
#include "worker/worker_service.h"

namespace meshrun {
namespace {

Dims ToDims(const v1::Shape& s) { return Dims(s.dims().begin(), s.dims().end()); }

// Checks each item's sharding and shapes (they come off the wire) and returns the memory the
// request takes at its peak: every block it makes, plus the largest saved block read at once.
absl::StatusOr<int64_t> LoadBytes(const Mesh& mesh, const v1::LoadShardsRequest& req) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  int64_t blocks = 0, largest_source = 0;
  for (const v1::LoadItem& item : req.items()) {
    const Dims global = ToDims(item.global_shape());
    const NamedSharding sharding(mesh, PartitionSpec::FromProto(item.spec()));
    absl::Status s = sharding.Validate(global);
    // The shape's size is checked before a block is made for it.
    if (s.ok()) s = CheckedByteSize(item.dtype(), global).status();
    if (!s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("array ", item.name(), ": ", s.message()));
    }
    const int64_t block = *CheckedByteSize(item.dtype(), sharding.ShardDims(global));
    blocks = block > kMax - blocks ? kMax : blocks + block;
    for (const v1::BlockSource& src : item.sources())
      largest_source = std::max(largest_source, src.nbytes());
  }
  return largest_source > kMax - blocks ? kMax : blocks + largest_source;
}

}  // namespace

absl::StatusOr<Membership> WorkerService::JoinedMembership() {
  absl::MutexLock lock(&join_mu_);
  if (!joined_) return absl::FailedPreconditionError("worker has not joined a cluster yet");
  return membership_;
}

grpc::Status WorkerService::SaveShards(grpc::ServerContext*, const v1::SaveShardsRequest* req,
                                       v1::SaveShardsResponse* resp) {
  absl::StatusOr<Membership> joined = JoinedMembership();
  if (!joined.ok()) return Error(joined.status());
  const Membership& m = *joined;
  // Snapshot first: shards are immutable and replaced, never changed, so holding them is enough.
  std::vector<std::shared_ptr<const Tensor>> held;
  std::vector<std::pair<std::string, const Tensor*>> tensors;
  std::vector<v1::SavedBlock> blocks;
  for (const v1::SaveItem& item : req->items()) {
    absl::StatusOr<std::shared_ptr<const Tensor>> shard = shards_.Get(item.array_id());
    if (!shard.ok()) return Error(shard.status());
    const Dims global = ToDims(item.global_shape());
    const NamedSharding sharding(m.mesh, PartitionSpec::FromProto(item.spec()));
    if (absl::Status s = sharding.Validate(global); !s.ok()) return Error(s);
    const std::vector<int64_t> offsets = sharding.ShardOffsets(global, m.rank);
    int owner = m.rank;
    for (int r = 0; r < m.rank; ++r) {
      if (sharding.ShardOffsets(global, r) == offsets) {
        owner = r;
        break;
      }
    }
    if (owner != m.rank) continue;  // a lower rank holds the same block and writes it
    v1::SavedBlock b;
    b.set_name(item.name());
    for (int64_t o : offsets) b.add_offsets(o);
    for (int64_t d : (*shard)->dims()) b.add_shape(d);
    b.set_tensor(absl::StrCat(item.name(), "@", absl::StrJoin(offsets, ",")));
    b.set_nbytes(static_cast<int64_t>((*shard)->size_bytes()));
    b.set_crc32(checkpoint::Crc32((*shard)->raw(), b.nbytes()));
    tensors.emplace_back(b.tensor(), shard->get());
    held.push_back(*shard);
    blocks.push_back(std::move(b));
  }
  if (tensors.empty()) return grpc::Status::OK;
  if (absl::Status s = checkpoint_root_.Check(req->path()); !s.ok()) return Error(s);
  absl::StatusOr<std::vector<int64_t>> offsets = checkpoint::WriteSafetensors(
      req->path(), tensors, {{"format", "meshrun-checkpoint"}, {"rank", absl::StrCat(m.rank)}});
  if (!offsets.ok()) return Error(offsets.status());
  for (size_t i = 0; i < blocks.size(); ++i) {
    blocks[i].set_data_offset((*offsets)[i]);
    *resp->add_blocks() = std::move(blocks[i]);
  }
  resp->set_wrote_file(true);
  return grpc::Status::OK;
}

grpc::Status WorkerService::LoadShards(grpc::ServerContext*, const v1::LoadShardsRequest* req,
                                       v1::LoadShardsResponse* resp) {
  absl::StatusOr<Membership> joined = JoinedMembership();
  if (!joined.ok()) return Error(joined.status());
  const Membership& m = *joined;
  absl::StatusOr<int64_t> needed = LoadBytes(m.mesh, *req);
  if (!needed.ok()) return Error(needed.status());
  if (absl::Status s =
          CheckMemoryBudget(absl::StrCat("LoadShards of ", req->items_size(), " arrays"), *needed);
      !s.ok()) {
    return Error(s);
  }
  // Everything is read and verified before any array is stored: a failure stores nothing.
  std::vector<std::pair<std::string, Tensor>> loaded;
  int64_t bytes_read = 0;
  for (const v1::LoadItem& item : req->items()) {
    const Dims global = ToDims(item.global_shape());
    const NamedSharding sharding(m.mesh, PartitionSpec::FromProto(item.spec()));
    const Dims dims = sharding.ShardDims(global);
    const std::vector<int64_t> target = sharding.ShardOffsets(global, m.rank);
    Tensor block;
    bool allocated = false;
    int64_t covered = 0;
    for (const v1::BlockSource& src : item.sources()) {
      const Dims src_dims(src.shape().begin(), src.shape().end());
      const std::vector<int64_t> src_offsets(src.offsets().begin(), src.offsets().end());
      if (absl::Status s = checkpoint_root_.Check(src.file()); !s.ok()) return Error(s);
      absl::StatusOr<Tensor> saved =
          checkpoint::ReadBlockAt(src.file(), item.name(), item.dtype(), src_dims,
                                  src.data_offset(), src.nbytes(), src.crc32());
      if (!saved.ok()) return Error(saved.status());
      bytes_read += src.nbytes();
      if (!allocated && src_offsets == target && src_dims == dims) {
        block = *std::move(saved);  // the saved block is exactly this worker's block
        covered += block.num_elements();
      } else {
        if (!allocated) block = Tensor(item.dtype(), dims);
        covered += checkpoint::CopyIntersection(*saved, src_offsets, block, target);
      }
      allocated = true;
    }
    if (!allocated) block = Tensor(item.dtype(), dims);
    if (covered != block.num_elements()) {
      return Error(absl::DataLossError(
          absl::StrCat("array ", item.name(), ": the saved blocks cover ", covered, " of the ",
                       block.num_elements(), " elements of rank ", m.rank, "'s block")));
    }
    loaded.emplace_back(item.array_id(), std::move(block));
  }
  for (auto& [id, t] : loaded) shards_.Put(id, std::move(t));
  resp->set_bytes_read(bytes_read);
  return grpc::Status::OK;
}

}  // namespace meshrun
