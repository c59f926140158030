// The coordinator's half of sharded checkpoints (server/checkpoint_ops.h), and the array
// registry's checkpoint RPCs on top of it.
#include "server/checkpoint_ops.h"

#include <unistd.h>

#include <filesystem>
#include <numeric>
#include <random>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/sharding/named_sharding.h"
#include "net/grpc_util.h"
#include "server/array_registry.h"

namespace meshrun {
namespace {

namespace fs = std::filesystem;

Dims ToDims(const v1::Shape& s) { return Dims(s.dims().begin(), s.dims().end()); }

// A fresh temporary directory for step `step`'s checkpoint under `root` (created, with the
// uncommitted leftovers of earlier saves removed); `*final_dir` is where it will be committed.
absl::StatusOr<std::string> MakeTmpDir(const std::string& root, int64_t step,
                                       std::string* final_dir) {
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", root, ": ", ec.message()));
  // Uncommitted leftovers of earlier saves (a crash, a kill) are never read; remove them.
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    if (entry.path().filename().string().find(".tmp-") != std::string::npos)
      fs::remove_all(entry.path(), ec);
  }
  *final_dir = (fs::path(root) / checkpoint::StepDirName(step)).string();
  const std::string tmp_dir = absl::StrFormat("%s.tmp-%08x", *final_dir, std::random_device{}());
  fs::create_directories(tmp_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", tmp_dir, ": ", ec.message()));
  return tmp_dir;
}

// The manifest of the blocks the workers wrote (`responses`, by rank); `*bytes` their total.
// Internal when an array's blocks do not cover it.
absl::StatusOr<checkpoint::Manifest> ManifestOf(
    int64_t step, const Mesh& mesh, const std::vector<CheckpointArray>& arrays,
    const std::vector<v1::SaveShardsResponse>& responses, int64_t* bytes) {
  checkpoint::Manifest m;
  m.step = step;
  m.mesh = mesh.ToString();
  for (const CheckpointArray& want : arrays) {
    checkpoint::ArrayEntry a;
    a.name = want.name;
    a.dtype = want.dtype;
    a.shape = want.shape;
    a.spec = want.spec;
    int64_t elements = 0;
    for (int r = 0; r < mesh.size(); ++r) {
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
        *bytes += b.nbytes();
        a.blocks.push_back(std::move(block));
      }
    }
    if (elements != NumElements(a.shape)) {
      return absl::InternalError(absl::StrCat("save checkpoint: the workers wrote ", elements,
                                              " of the ", NumElements(a.shape), " elements of ",
                                              a.name));
    }
    m.arrays.push_back(std::move(a));
  }
  return m;
}

// Commits `tmp_dir` as `final_dir` (replacing a checkpoint of the same step): the manifest
// written and synced last, then the rename, then the root synced.
absl::Status Commit(const std::string& root, const std::string& tmp_dir,
                    const std::string& final_dir, const checkpoint::Manifest& m) {
  std::error_code ec;
  absl::Status s = checkpoint::WriteFileSynced((fs::path(tmp_dir) / "manifest.json").string(),
                                               checkpoint::ToJson(m));
  if (s.ok()) s = checkpoint::SyncDir(tmp_dir);
  if (s.ok()) {
    fs::remove_all(final_dir, ec);  // a re-save of the same step replaces it
    fs::rename(tmp_dir, final_dir, ec);
    if (ec)
      s = absl::InternalError(
          absl::StrCat("cannot commit ", tmp_dir, " as ", final_dir, ": ", ec.message()));
  }
  if (s.ok()) s = checkpoint::SyncDir(root);
  return s;
}

}  // namespace

absl::StatusOr<v1::SaveCheckpointResponse> WriteCheckpoint(
    const std::string& root, int64_t step, int keep, const Mesh& mesh,
    const std::vector<CheckpointArray>& arrays, const ForEachWorker& for_each) {
  if (root.empty()) return absl::InvalidArgumentError("save checkpoint: empty root directory");
  std::set<std::string> names;
  for (const CheckpointArray& a : arrays) {
    if (!names.insert(a.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("save checkpoint: array name '", a.name, "' appears twice"));
    }
  }
  std::string final_dir;
  absl::StatusOr<std::string> tmp_dir = MakeTmpDir(root, step, &final_dir);
  if (!tmp_dir.ok()) return tmp_dir.status();
  std::vector<v1::SaveShardsResponse> responses(mesh.size());
  absl::Status s = for_each([&](int r, v1::Worker::Stub& stub, grpc::ClientContext* ctx) {
    v1::SaveShardsRequest req;
    req.set_path((fs::path(*tmp_dir) / absl::StrCat("shard-", r, ".safetensors")).string());
    for (const CheckpointArray& a : arrays) {
      v1::SaveItem* item = req.add_items();
      item->set_array_id(a.array_id);
      item->set_name(a.name);
      for (int64_t d : a.shape) item->mutable_global_shape()->add_dims(d);
      *item->mutable_spec() = a.spec.ToProto();
    }
    return stub.SaveShards(ctx, req, &responses[r]);
  });
  int64_t bytes = 0;
  if (s.ok()) {
    absl::StatusOr<checkpoint::Manifest> m = ManifestOf(step, mesh, arrays, responses, &bytes);
    s = m.ok() ? Commit(root, *tmp_dir, final_dir, *m) : m.status();
  }
  std::error_code ec;
  if (!s.ok()) {
    fs::remove_all(*tmp_dir, ec);
    return s;
  }
  if (keep > 0) {
    auto all = checkpoint::ListCheckpoints(root);
    for (size_t i = 0; i + keep < all.size(); ++i) fs::remove_all(all[i].second, ec);
  }
  v1::SaveCheckpointResponse resp;
  resp.set_path(final_dir);
  resp.set_bytes_written(bytes);
  return resp;
}

absl::StatusOr<std::vector<v1::LoadShardsRequest>> PlanLoad(
    const checkpoint::Manifest& m, const std::string& path, const Mesh& mesh,
    const std::vector<CheckpointArray>& targets) {
  std::vector<v1::LoadShardsRequest> loads(mesh.size());
  for (const CheckpointArray& want : targets) {
    const checkpoint::ArrayEntry* a = m.Find(want.name);
    if (a == nullptr) {
      return absl::NotFoundError(
          absl::StrCat("array ", want.name, " is not in the checkpoint ", path));
    }
    if (a->dtype != want.dtype || a->shape != want.shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          "array ", want.name, " in ", path, " is ", DTypeName(a->dtype), DimsToString(a->shape),
          "; the job wants ", DTypeName(want.dtype), DimsToString(want.shape)));
    }
    const NamedSharding sharding(mesh, want.spec);
    if (absl::Status s = sharding.Validate(a->shape); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("array ", a->name, " cannot be restored as ",
                                                     want.spec.ToString(), ": ", s.message()));
    }
    for (int r = 0; r < mesh.size(); ++r) {
      v1::LoadItem* item = loads[r].add_items();
      item->set_array_id(want.array_id);
      item->set_name(a->name);
      item->set_dtype(a->dtype);
      for (int64_t d : a->shape) item->mutable_global_shape()->add_dims(d);
      *item->mutable_spec() = want.spec.ToProto();
      for (const checkpoint::Block* b : checkpoint::BlocksIntersecting(
               *a, sharding.ShardOffsets(a->shape, r), sharding.ShardDims(a->shape))) {
        v1::BlockSource* src = item->add_sources();
        src->set_file((fs::path(path) / b->file).string());  // an absolute b->file stays as is
        for (int64_t o : b->offsets) src->add_offsets(o);
        for (int64_t d : b->shape) src->add_shape(d);
        src->set_data_offset(b->data_offset);
        src->set_nbytes(b->nbytes);
        src->set_crc32(b->crc32);
      }
    }
  }
  return loads;
}

void DeleteOnWorkers(const std::vector<CheckpointArray>& arrays, const ForEachWorker& for_each) {
  for_each([&](int, v1::Worker::Stub& stub, grpc::ClientContext*) {
    grpc::ClientContext ctx;
    SetTimeout(ctx, absl::Seconds(10));
    v1::DeleteShardRequest req;
    for (const CheckpointArray& a : arrays) req.add_array_ids(a.array_id);
    v1::DeleteShardResponse resp;
    stub.DeleteShard(&ctx, req, &resp);  // its own blocks of every array, whichever it held
    return grpc::Status::OK;
  }).IgnoreError();
}

absl::StatusOr<int64_t> LoadBlocks(const std::vector<v1::LoadShardsRequest>& loads,
                                   const std::vector<CheckpointArray>& targets,
                                   const ForEachWorker& for_each) {
  std::vector<int64_t> bytes(loads.size(), 0);
  absl::Status s = for_each([&](int r, v1::Worker::Stub& stub, grpc::ClientContext* ctx) {
    v1::LoadShardsResponse resp;
    grpc::Status st = stub.LoadShards(ctx, loads[r], &resp);
    bytes[r] = resp.bytes_read();
    return st;
  });
  if (!s.ok()) {
    // Workers that succeeded hold blocks under the ids; drop them so nothing half-restored stays.
    DeleteOnWorkers(targets, for_each);
    return s;
  }
  return std::accumulate(bytes.begin(), bytes.end(), int64_t{0});
}

v1::ArrayInfo RestoredArrayInfo(const Mesh& mesh, const CheckpointArray& target) {
  const NamedSharding sharding(mesh, target.spec);
  v1::ArrayInfo info;
  info.set_id(target.array_id);
  info.set_dtype(target.dtype);
  for (int64_t d : target.shape) info.mutable_shape()->add_dims(d);
  *info.mutable_sharding() = sharding.ToProto();
  if (sharding.Validate(target.shape).ok())
    info.set_bytes_per_worker(NumElements(sharding.ShardDims(target.shape)) *
                              DTypeSize(target.dtype));
  return info;
}

ForEachWorker ArrayRegistry::EachWorker(StubsRef stubs) {
  return [this, stubs](const WorkerCall& call) {
    std::vector<int> ranks(workers_->expected());
    std::iota(ranks.begin(), ranks.end(), 0);
    return ForRanks(ranks,
                    [&](int r, grpc::ClientContext* ctx) { return call(r, *(*stubs)[r], ctx); });
  };
}

absl::StatusOr<v1::SaveCheckpointResponse> ArrayRegistry::SaveCheckpoint(
    const v1::SaveCheckpointRequest& request) {
  if (absl::Status s = checkpoint_root_.Check(request.root()); !s.ok()) return s;
  std::vector<CheckpointArray> arrays;
  for (const v1::CheckpointArray& a : request.arrays()) {
    absl::StatusOr<v1::ArrayInfo> info = Info(a.id());
    if (!info.ok()) return info.status();
    arrays.push_back({a.name(), a.id(), info->dtype(), ToDims(info->shape()),
                      PartitionSpec::FromProto(info->sharding().spec())});
  }
  absl::StatusOr<StubsRef> stubs = EnsureStubs();
  if (!stubs.ok()) return stubs.status();
  return WriteCheckpoint(request.root(), request.step(), request.keep(), workers_->mesh(), arrays,
                         EachWorker(*stubs));
}

absl::StatusOr<v1::RestoreCheckpointResponse> ArrayRegistry::RestoreCheckpoint(
    const v1::RestoreCheckpointRequest& request) {
  // A committed checkpoint directory, or one safetensors file (an init_from of parameters).
  if (absl::Status s = checkpoint_root_.Check(request.path()); !s.ok()) return s;
  absl::StatusOr<checkpoint::Manifest> m = checkpoint::ReadRestoreSource(request.path());
  if (!m.ok()) return m.status();
  const Mesh& mesh = workers_->mesh();
  std::vector<CheckpointArray> targets;
  std::vector<v1::ArrayInfo> infos;
  for (const v1::CheckpointArray& want : request.arrays()) {
    const checkpoint::ArrayEntry* a = m->Find(want.name());
    if (a == nullptr) {
      return absl::NotFoundError(
          absl::StrCat("array ", want.name(), " is not in the checkpoint ", request.path()));
    }
    {
      absl::MutexLock lock(&mu_);
      if (arrays_.count(want.id()))
        return absl::InvalidArgumentError(absl::StrCat("array id '", want.id(), "' is in use"));
    }
    // The array comes back with its saved shape and dtype, in the wanted layout.
    targets.push_back(
        {a->name, want.id(), a->dtype, a->shape, PartitionSpec::FromProto(want.spec())});
    infos.push_back(RestoredArrayInfo(mesh, targets.back()));
  }
  absl::StatusOr<std::vector<v1::LoadShardsRequest>> loads =
      PlanLoad(*m, request.path(), mesh, targets);
  if (!loads.ok()) return loads.status();
  absl::StatusOr<StubsRef> stubs = EnsureStubs();
  if (!stubs.ok()) return stubs.status();
  absl::StatusOr<int64_t> bytes = LoadBlocks(*loads, targets, EachWorker(*stubs));
  if (!bytes.ok()) return bytes.status();
  v1::RestoreCheckpointResponse resp;
  absl::MutexLock lock(&mu_);
  for (const v1::ArrayInfo& info : infos) {
    arrays_[info.id()] = info;
    *resp.add_arrays() = info;
  }
  resp.set_step(m->step);
  resp.set_bytes_read(*bytes);
  return resp;
}

}  // namespace meshrun
