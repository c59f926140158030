// ArrayRegistry's checkpoint operations: the coordinator plans and commits; the workers write and
// read their own blocks (worker/checkpoint_shards.cc).
#include <unistd.h>

#include <filesystem>
#include <numeric>
#include <random>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/checkpoint/checkpoint.h"
#include "core/sharding/named_sharding.h"
#include "net/grpc_util.h"
#include "server/array_registry.h"

namespace meshrun {
namespace {

namespace fs = std::filesystem;

Dims ToDims(const v1::Shape& s) { return Dims(s.dims().begin(), s.dims().end()); }

}  // namespace

absl::StatusOr<v1::SaveCheckpointResponse> ArrayRegistry::SaveCheckpoint(
    const v1::SaveCheckpointRequest& request) {
  if (request.root().empty())
    return absl::InvalidArgumentError("save checkpoint: empty root directory");
  std::vector<v1::ArrayInfo> infos;
  std::set<std::string> names;
  for (const v1::CheckpointArray& a : request.arrays()) {
    absl::StatusOr<v1::ArrayInfo> info = Info(a.id());
    if (!info.ok()) return info.status();
    if (!names.insert(a.name()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("save checkpoint: array name '", a.name(), "' appears twice"));
    }
    infos.push_back(*info);
  }
  std::error_code ec;
  fs::create_directories(request.root(), ec);
  if (ec)
    return absl::InternalError(absl::StrCat("cannot create ", request.root(), ": ", ec.message()));
  // Uncommitted leftovers of earlier saves (a crash, a kill) are never read; remove them.
  for (const auto& entry : fs::directory_iterator(request.root(), ec)) {
    if (entry.path().filename().string().find(".tmp-") != std::string::npos)
      fs::remove_all(entry.path(), ec);
  }
  const std::string final_dir =
      (fs::path(request.root()) / checkpoint::StepDirName(request.step())).string();
  const std::string tmp_dir = absl::StrFormat("%s.tmp-%08x", final_dir, std::random_device{}());
  fs::create_directories(tmp_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", tmp_dir, ": ", ec.message()));
  if (absl::Status s = EnsureStubs(); !s.ok()) return s;

  const Mesh& mesh = workers_->mesh();
  std::vector<int> ranks(workers_->expected());
  std::iota(ranks.begin(), ranks.end(), 0);
  std::vector<v1::SaveShardsResponse> responses(ranks.size());
  absl::Status s = ForRanks(ranks, [&](int r, grpc::ClientContext* ctx) {
    v1::SaveShardsRequest req;
    req.set_path((fs::path(tmp_dir) / absl::StrCat("shard-", r, ".safetensors")).string());
    for (int i = 0; i < request.arrays_size(); ++i) {
      v1::SaveItem* item = req.add_items();
      item->set_array_id(request.arrays(i).id());
      item->set_name(request.arrays(i).name());
      *item->mutable_global_shape() = infos[i].shape();
      *item->mutable_spec() = infos[i].sharding().spec();
    }
    return stubs_[r]->SaveShards(ctx, req, &responses[r]);
  });
  if (!s.ok()) {
    fs::remove_all(tmp_dir, ec);
    return s;
  }
  checkpoint::Manifest m;
  m.step = request.step();
  m.mesh = mesh.ToString();
  int64_t bytes = 0;
  for (int i = 0; i < request.arrays_size(); ++i) {
    checkpoint::ArrayEntry a;
    a.name = request.arrays(i).name();
    a.dtype = infos[i].dtype();
    a.shape = ToDims(infos[i].shape());
    a.spec = PartitionSpec::FromProto(infos[i].sharding().spec());
    int64_t elements = 0;
    for (int r : ranks) {
      for (const v1::SavedBlock& b : responses[r].blocks()) {
        if (b.name() != a.name) continue;
        checkpoint::Block block{{b.offsets().begin(), b.offsets().end()},
                                {b.shape().begin(), b.shape().end()},
                                absl::StrCat("shard-", r, ".safetensors"),
                                b.tensor(),
                                b.data_offset(),
                                b.nbytes(),
                                b.crc32()};
        elements += NumElements(block.shape);
        bytes += b.nbytes();
        a.blocks.push_back(std::move(block));
      }
    }
    if (elements != NumElements(a.shape)) {
      fs::remove_all(tmp_dir, ec);
      return absl::InternalError(absl::StrCat("save checkpoint: the workers wrote ", elements,
                                              " of the ", NumElements(a.shape), " elements of ",
                                              a.name));
    }
    m.arrays.push_back(std::move(a));
  }
  // Commit: the manifest last, then the rename.
  s = checkpoint::WriteFileSynced((fs::path(tmp_dir) / "manifest.json").string(),
                                  checkpoint::ToJson(m));
  if (s.ok()) s = checkpoint::SyncDir(tmp_dir);
  if (s.ok()) {
    fs::remove_all(final_dir, ec);  // a re-save of the same step replaces it
    fs::rename(tmp_dir, final_dir, ec);
    if (ec)
      s = absl::InternalError(
          absl::StrCat("cannot commit ", tmp_dir, " as ", final_dir, ": ", ec.message()));
  }
  if (s.ok()) s = checkpoint::SyncDir(request.root());
  if (!s.ok()) {
    fs::remove_all(tmp_dir, ec);
    return s;
  }
  if (request.keep() > 0) {
    auto all = checkpoint::ListCheckpoints(request.root());
    for (size_t i = 0; i + request.keep() < all.size(); ++i) fs::remove_all(all[i].second, ec);
  }
  v1::SaveCheckpointResponse resp;
  resp.set_path(final_dir);
  resp.set_bytes_written(bytes);
  return resp;
}

absl::StatusOr<v1::RestoreCheckpointResponse> ArrayRegistry::RestoreCheckpoint(
    const v1::RestoreCheckpointRequest& request) {
  absl::StatusOr<checkpoint::Manifest> m = checkpoint::ReadManifest(request.path());
  if (!m.ok()) return m.status();
  const Mesh& mesh = workers_->mesh();
  std::vector<int> ranks(workers_->expected());
  std::iota(ranks.begin(), ranks.end(), 0);
  std::vector<v1::LoadShardsRequest> loads(ranks.size());
  std::vector<v1::ArrayInfo> infos;
  for (const v1::CheckpointArray& want : request.arrays()) {
    const checkpoint::ArrayEntry* a = m->Find(want.name());
    if (a == nullptr) {
      return absl::NotFoundError(
          absl::StrCat("array ", want.name(), " is not in the checkpoint ", request.path()));
    }
    const PartitionSpec spec = PartitionSpec::FromProto(want.spec());
    const NamedSharding sharding(mesh, spec);
    if (absl::Status s = sharding.Validate(a->shape); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("array ", a->name, " cannot be restored as ",
                                                     spec.ToString(), ": ", s.message()));
    }
    {
      absl::MutexLock lock(&mu_);
      if (arrays_.count(want.id()))
        return absl::InvalidArgumentError(absl::StrCat("array id '", want.id(), "' is in use"));
    }
    for (int r : ranks) {
      v1::LoadItem* item = loads[r].add_items();
      item->set_array_id(want.id());
      item->set_name(a->name);
      item->set_dtype(a->dtype);
      for (int64_t d : a->shape) item->mutable_global_shape()->add_dims(d);
      *item->mutable_spec() = spec.ToProto();
      for (const checkpoint::Block* b : checkpoint::BlocksIntersecting(
               *a, sharding.ShardOffsets(a->shape, r), sharding.ShardDims(a->shape))) {
        v1::BlockSource* src = item->add_sources();
        src->set_file((fs::path(request.path()) / b->file).string());
        for (int64_t o : b->offsets) src->add_offsets(o);
        for (int64_t d : b->shape) src->add_shape(d);
        src->set_data_offset(b->data_offset);
        src->set_nbytes(b->nbytes);
        src->set_crc32(b->crc32);
      }
    }
    v1::ArrayInfo info;
    info.set_id(want.id());
    info.set_dtype(a->dtype);
    for (int64_t d : a->shape) info.mutable_shape()->add_dims(d);
    *info.mutable_sharding() = sharding.ToProto();
    info.set_bytes_per_worker(NumElements(sharding.ShardDims(a->shape)) * DTypeSize(a->dtype));
    infos.push_back(std::move(info));
  }
  if (absl::Status s = EnsureStubs(); !s.ok()) return s;
  std::vector<int64_t> bytes(ranks.size(), 0);
  absl::Status s = ForRanks(ranks, [&](int r, grpc::ClientContext* ctx) {
    v1::LoadShardsResponse resp;
    grpc::Status st = stubs_[r]->LoadShards(ctx, loads[r], &resp);
    bytes[r] = resp.bytes_read();
    return st;
  });
  if (!s.ok()) {
    // Workers that succeeded hold blocks under the ids; drop them so nothing half-restored stays.
    ForRanks(ranks, [&](int r, grpc::ClientContext*) {
      for (const v1::ArrayInfo& info : infos) {
        grpc::ClientContext ctx;  // one per call: a context serves a single RPC
        SetTimeout(ctx, absl::Seconds(10));
        v1::DeleteShardRequest req;
        req.set_array_id(info.id());
        v1::DeleteShardResponse resp;
        stubs_[r]->DeleteShard(&ctx, req, &resp);
      }
      return grpc::Status::OK;
    }).IgnoreError();
    return s;
  }
  v1::RestoreCheckpointResponse resp;
  absl::MutexLock lock(&mu_);
  for (const v1::ArrayInfo& info : infos) {
    arrays_[info.id()] = info;
    *resp.add_arrays() = info;
  }
  resp.set_step(m->step);
  int64_t total = 0;
  for (int64_t b : bytes) total += b;
  resp.set_bytes_read(total);
  return resp;
}

}  // namespace meshrun
