// WorkerService's checkpoint RPCs: each worker writes the blocks it owns and reads back the saved
// blocks its target block needs (core/checkpoint/checkpoint.h has the format).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/checkpoint/checkpoint.h"
#include "core/sharding/named_sharding.h"
#include "net/grpc_util.h"
#include "worker/worker_service.h"

namespace meshrun {
namespace {

Dims ToDims(const v1::Shape& s) { return Dims(s.dims().begin(), s.dims().end()); }

// pread of exactly n bytes. Errors: DataLoss naming the file when it is shorter (truncated).
absl::Status ReadRange(int fd, const std::string& path, int64_t offset, int64_t n, void* out) {
  char* p = static_cast<char*>(out);
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, static_cast<size_t>(n), offset);
    if (r < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(absl::StrCat("read ", path, ": ", std::strerror(errno)));
    }
    if (r == 0)
      return absl::DataLossError(
          absl::StrCat(path, " is truncated: ", n, " bytes missing at offset ", offset));
    p += r;
    offset += r;
    n -= r;
  }
  return absl::OkStatus();
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
  // Everything is read and verified before any array is stored: a failure stores nothing.
  std::vector<std::pair<std::string, Tensor>> loaded;
  int64_t bytes_read = 0;
  for (const v1::LoadItem& item : req->items()) {
    const Dims global = ToDims(item.global_shape());
    const NamedSharding sharding(m.mesh, PartitionSpec::FromProto(item.spec()));
    if (absl::Status s = sharding.Validate(global); !s.ok()) {
      return Error(
          absl::InvalidArgumentError(absl::StrCat("array ", item.name(), ": ", s.message())));
    }
    Tensor block(item.dtype(), sharding.ShardDims(global));
    const std::vector<int64_t> target = sharding.ShardOffsets(global, m.rank);
    int64_t covered = 0;
    for (const v1::BlockSource& src : item.sources()) {
      // A saved block that is exactly the target block is read in place; others into a scratch
      // block whose overlap is then copied.
      const Dims src_dims(src.shape().begin(), src.shape().end());
      const bool same =
          src_dims == block.dims() &&
          std::equal(target.begin(), target.end(), src.offsets().begin(), src.offsets().end());
      Tensor scratch = same ? Tensor() : Tensor(item.dtype(), src_dims);
      Tensor& saved = same ? block : scratch;
      if (static_cast<int64_t>(saved.size_bytes()) != src.nbytes()) {
        return Error(absl::DataLossError(
            absl::StrCat("array ", item.name(), ": block in ", src.file(), " has ", src.nbytes(),
                         " bytes; its shape needs ", saved.size_bytes())));
      }
      const int fd = ::open(src.file().c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) {
        return Error(absl::NotFoundError(absl::StrCat("array ", item.name(), ": cannot open ",
                                                      src.file(), ": ", std::strerror(errno))));
      }
      absl::Status s = ReadRange(fd, src.file(), src.data_offset(), src.nbytes(), saved.raw());
      ::close(fd);
      if (!s.ok())
        return Error(
            absl::Status(s.code(), absl::StrCat("array ", item.name(), ": ", s.message())));
      if (checkpoint::Crc32(saved.raw(), src.nbytes()) != src.crc32()) {
        return Error(absl::DataLossError(absl::StrCat(
            "array ", item.name(), ": the block at offsets (", absl::StrJoin(src.offsets(), ", "),
            ") in ", src.file(), " does not match its checksum (corrupted)")));
      }
      bytes_read += src.nbytes();
      if (!same) {
        checkpoint::CopyIntersection(
            saved, std::vector<int64_t>(src.offsets().begin(), src.offsets().end()), block, target);
      }
      int64_t overlap = 1;
      for (size_t d = 0; d < target.size(); ++d) {
        overlap *= std::max<int64_t>(
            0, std::min(src.offsets(d) + src.shape(d), target[d] + block.dims()[d]) -
                   std::max(src.offsets(d), target[d]));
      }
      covered += overlap;
    }
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
