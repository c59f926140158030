// The array registry's half of the peers' in-memory TrainState (worker.proto's KeepPeerState;
// the workers' half is worker/peer_state_rpcs.cc).
#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "net/grpc_util.h"
#include "server/array_registry.h"

namespace meshrun {
namespace {

// Whether `held` (a worker's PeerStateInfo) has owner `owner`'s copy of `job` at `step` on `mesh`
// with every array of `names`.
bool Holds(const v1::PeerStateInfoResponse& held, const std::string& job, int64_t step,
           const std::string& mesh, int owner, const std::vector<std::string>& names) {
  for (const v1::PeerStateInfoResponse::Held& h : held.held()) {
    const v1::PeerStateKey& k = h.key();
    if (k.job() != job || k.step() != step || k.mesh() != mesh || k.owner_rank() != owner) continue;
    const std::set<std::string> have(h.names().begin(), h.names().end());
    return std::all_of(names.begin(), names.end(),
                       [&](const std::string& n) { return have.count(n) > 0; });
  }
  return false;
}

}  // namespace

absl::StatusOr<int64_t> ArrayRegistry::KeepPeerState(const std::string& job, int64_t step,
                                                     const std::vector<CheckpointArray>& arrays) {
  absl::StatusOr<StubsRef> stubs = EnsureStubs();
  if (!stubs.ok()) return stubs.status();
  std::vector<v1::KeepPeerStateResponse> responses(workers_->expected());
  absl::Status s = EachWorker(*stubs)([&](int r, v1::Worker::Stub& stub, grpc::ClientContext* ctx) {
    v1::KeepPeerStateRequest req;
    req.mutable_key()->set_job(job);
    req.mutable_key()->set_step(step);
    req.set_timeout_seconds(absl::ToDoubleSeconds(rpc_timeout_));
    for (const CheckpointArray& a : arrays) {
      v1::SaveItem* item = req.add_items();
      item->set_array_id(a.array_id);
      item->set_name(a.name);
    }
    return stub.KeepPeerState(ctx, req, &responses[r]);
  });
  if (!s.ok()) return s;
  int64_t bytes = 0;
  for (const v1::KeepPeerStateResponse& r : responses) bytes += r.bytes();
  return bytes;
}

absl::StatusOr<int64_t> ArrayRegistry::NewestPeerState(const std::string& job,
                                                       const std::vector<std::string>& names) {
  absl::StatusOr<StubsRef> stubs = EnsureStubs();
  if (!stubs.ok()) return stubs.status();
  const int n = workers_->expected();
  const std::string mesh = workers_->mesh().ToString();
  std::vector<v1::PeerStateInfoResponse> held(n);
  absl::Status s = EachWorker(*stubs)([&](int r, v1::Worker::Stub& stub, grpc::ClientContext* ctx) {
    return stub.PeerStateInfo(ctx, v1::PeerStateInfoRequest(), &held[r]);
  });
  if (!s.ok()) return s;
  std::set<int64_t, std::greater<int64_t>> steps;
  for (const v1::PeerStateInfoResponse& h : held) {
    for (const v1::PeerStateInfoResponse::Held& c : h.held()) {
      if (c.key().job() == job && c.key().mesh() == mesh) steps.insert(c.key().step());
    }
  }
  std::vector<int> uncovered;
  for (int64_t step : steps) {
    uncovered.clear();
    for (int r = 0; r < n; ++r) {
      if (!Holds(held[r], job, step, mesh, r, names) &&
          !Holds(held[(r + 1) % n], job, step, mesh, r, names))
        uncovered.push_back(r);
    }
    if (uncovered.empty()) return step;
  }
  return absl::NotFoundError(absl::StrCat(
      "no step of job '", job, "' on mesh ", mesh, " has every rank's state in memory",
      steps.empty()
          ? std::string(" (no worker holds a copy)")
          : absl::StrCat(" (at step ", *steps.rbegin(), ", ranks [", absl::StrJoin(uncovered, ", "),
                         "] have no copy on themselves or their successor)")));
}

void ArrayRegistry::DropPeerState(const std::string& job) {
  absl::StatusOr<StubsRef> stubs = EnsureStubs();
  if (!stubs.ok()) return;
  EachWorker (*stubs)([&](int, v1::Worker::Stub& stub, grpc::ClientContext* ctx) {
    v1::DropPeerStateRequest req;
    req.set_job(job);
    v1::DropPeerStateResponse ignored;
    return stub.DropPeerState(ctx, req, &ignored);
  }).IgnoreError();
}

absl::StatusOr<v1::RestoreCheckpointResponse> ArrayRegistry::RestorePeerState(
    const std::string& job, int64_t step, const std::vector<CheckpointArray>& arrays) {
  const Mesh& mesh = workers_->mesh();
  std::vector<v1::ArrayInfo> infos;
  for (const CheckpointArray& a : arrays) {
    {
      absl::MutexLock lock(&mu_);
      if (arrays_.count(a.array_id))
        return absl::InvalidArgumentError(absl::StrCat("array id '", a.array_id, "' is in use"));
    }
    infos.push_back(RestoredArrayInfo(mesh, a));
  }
  absl::StatusOr<StubsRef> stubs = EnsureStubs();
  if (!stubs.ok()) return stubs.status();
  std::vector<v1::RestorePeerStateResponse> responses(workers_->expected());
  absl::Status s = EachWorker(*stubs)([&](int r, v1::Worker::Stub& stub, grpc::ClientContext* ctx) {
    v1::RestorePeerStateRequest req;
    req.mutable_key()->set_job(job);
    req.mutable_key()->set_step(step);
    req.mutable_key()->set_owner_rank(r);
    req.mutable_key()->set_mesh(mesh.ToString());
    req.set_timeout_seconds(absl::ToDoubleSeconds(rpc_timeout_));
    for (const CheckpointArray& a : arrays) {
      v1::LoadItem* item = req.add_items();
      item->set_array_id(a.array_id);
      item->set_name(a.name);
      item->set_dtype(a.dtype);
      for (int64_t d : a.shape) item->mutable_global_shape()->add_dims(d);
      *item->mutable_spec() = a.spec.ToProto();
    }
    return stub.RestorePeerState(ctx, req, &responses[r]);
  });
  if (!s.ok()) {
    DeleteOnWorkers(arrays, EachWorker(*stubs));  // nothing half-restored stays
    return s;
  }
  v1::RestoreCheckpointResponse resp;
  int64_t bytes = 0;
  for (const v1::RestorePeerStateResponse& r : responses)
    bytes += r.bytes_local() + r.bytes_from_peer();
  resp.set_step(step);
  resp.set_bytes_read(bytes);
  absl::MutexLock lock(&mu_);
  for (const v1::ArrayInfo& info : infos) {
    arrays_[info.id()] = info;
    *resp.add_arrays() = info;
  }
  return resp;
}

}  // namespace meshrun
