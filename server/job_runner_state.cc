// JobDriver::Runner (server/job_runner.h): the job's TrainState, initialised or restored (from
// a checkpoint or the peers' copies), and its checkpoints saved and checked.
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/checkpoint/checkpoint.h"
#include "core/random/threefry.h"
#include "core/spmd/shard_map.h"
#include "server/job_runner.h"

namespace meshrun {

std::vector<v1::CheckpointArray> JobDriver::Runner::StateArrays(const std::string& id_prefix,
                                                                const std::string& only) const {
  std::vector<v1::CheckpointArray> out;
  for (const v1::StateArraySpec& a : job_.state()) {
    if (!absl::StartsWith(a.name(), only)) continue;
    v1::CheckpointArray c;
    c.set_name(a.name());
    c.set_id(Id(id_prefix + a.name()));
    *c.mutable_spec() = a.spec();
    out.push_back(std::move(c));
  }
  return out;
}

absl::Status JobDriver::Runner::CheckSaved(const std::string& path,
                                           const std::vector<v1::CheckpointArray>& wanted) const {
  absl::StatusOr<checkpoint::Manifest> m = checkpoint::ReadRestoreSource(path);
  if (!m.ok()) return m.status();
  for (const v1::CheckpointArray& w : wanted) {
    const checkpoint::ArrayEntry* saved = m->Find(w.name());
    if (saved == nullptr) continue;  // the restore names it
    for (const v1::StateArraySpec& a : job_.state()) {
      if (a.name() != w.name()) continue;
      const Dims want(a.shape().dims().begin(), a.shape().dims().end());
      if (saved->shape != want || saved->dtype != a.dtype()) {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ": ", w.name(), " is ", DTypeName(saved->dtype), DimsToString(saved->shape),
            "; the job's model wants ", DTypeName(a.dtype()), DimsToString(want)));
      }
    }
  }
  return absl::OkStatus();
}

std::vector<CheckpointArray> JobDriver::Runner::PeerStateArrays() const {
  std::vector<CheckpointArray> out;
  for (const v1::StateArraySpec& a : job_.state()) {
    out.push_back({a.name(), Id(a.name()), a.dtype(),
                   Dims(a.shape().dims().begin(), a.shape().dims().end()),
                   PartitionSpec::FromProto(a.spec())});
  }
  return out;
}

absl::StatusOr<bool> JobDriver::Runner::RestoreFromPeers(int64_t newest_checkpoint) {
  std::vector<std::string> names;
  for (const v1::StateArraySpec& a : job_.state()) names.push_back(a.name());
  absl::StatusOr<int64_t> at = d_->arrays_->NewestPeerState(d_->run_token_, names);
  if (!at.ok()) {
    Info(absl::StrCat("no state in the peers' memory to restore: ", at.status().message()));
    return false;
  }
  if (*at < newest_checkpoint) {
    Info(absl::StrCat("the peers' memory holds step ", *at, "; checkpoint step ", newest_checkpoint,
                      " is newer and is restored instead"));
    return false;
  }
  const absl::Time t0 = absl::Now();
  absl::StatusOr<v1::RestoreCheckpointResponse> r =
      d_->arrays_->RestorePeerState(d_->run_token_, *at, PeerStateArrays());
  if (!r.ok()) return r.status();
  step_ = first_step_ = *at;
  resumed_ = true;
  source_ = "peers";
  Info(absl::StrCat("restored step ", *at, " from the peers' memory: ", r->arrays_size(),
                    " arrays, ", r->bytes_read(), " bytes in ",
                    absl::FormatDuration(absl::Now() - t0)));
  return true;
}

absl::Status JobDriver::Runner::InitState(bool recovering) {
  const v1::CheckpointPolicy& ck = job_.checkpoint();
  for (const v1::StateArraySpec& a : job_.state()) live_ids_.push_back(Id(a.name()));
  if (recovering && job_.recovery().peer_state_every() > 0) {
    const auto saved = ck.dir().empty() ? std::vector<std::pair<int64_t, std::string>>()
                                        : checkpoint::ListCheckpoints(ck.dir());
    absl::StatusOr<bool> restored = RestoreFromPeers(saved.empty() ? 0 : saved.back().first);
    if (!restored.ok()) return restored.status();
    if (*restored) return absl::OkStatus();
  }
  if (ck.resume()) {
    absl::StatusOr<std::string> latest = checkpoint::LatestCheckpoint(ck.dir());
    if (latest.ok()) {
      v1::RestoreCheckpointRequest req;
      req.set_path(*latest);
      for (v1::CheckpointArray& a : StateArrays("")) *req.add_arrays() = std::move(a);
      if (absl::Status s = CheckSaved(*latest, {req.arrays().begin(), req.arrays().end()}); !s.ok())
        return s;
      const absl::Time t0 = absl::Now();
      absl::StatusOr<v1::RestoreCheckpointResponse> r = d_->arrays_->RestoreCheckpoint(req);
      if (!r.ok()) return r.status();
      step_ = first_step_ = r->step();
      resumed_ = true;
      restored_from_ = *latest;
      source_ = "checkpoint";
      Info(absl::StrCat("resumed from ", *latest, " at step ", r->step(), ": ", r->arrays_size(),
                        " arrays, ", r->bytes_read(), " bytes read by the workers in ",
                        absl::FormatDuration(absl::Now() - t0)));
      return absl::OkStatus();
    }
    Info(absl::StrCat("resume: no committed checkpoint in ", ck.dir(), "; starting from step 0"));
  }
  if (!ck.init_from().empty()) {  // checked before anything is drawn
    if (absl::Status s = CheckSaved(ck.init_from(), StateArrays("", "params/")); !s.ok()) return s;
  }
  v1::ShardMapRequest init;
  *init.mutable_program() = job_.init();
  for (const v1::StateArraySpec& a : job_.state())
    if (a.name() != "rng") init.add_output_ids(Id(a.name()));
  if (absl::StatusOr<v1::ShardMapResponse> r = d_->arrays_->ShardMap(init, &d_->cancel_); !r.ok())
    return r.status();
  const PRNGKey key = MakePRNGKey(job_.seed());
  Tensor rng(v1::DTYPE_U32, {2});
  rng.data<uint32_t>()[0] = key[0];
  rng.data<uint32_t>()[1] = key[1];
  if (absl::StatusOr<v1::ArrayInfo> put = d_->arrays_->Put(rng, PartitionSpec(), Id("rng"));
      !put.ok())
    return put.status();
  if (ck.init_from().empty()) return absl::OkStatus();
  v1::RestoreCheckpointRequest req;
  req.set_path(ck.init_from());
  for (v1::CheckpointArray& a : StateArrays("", "params/")) {
    if (absl::Status s = d_->arrays_->Delete(a.id()); !s.ok()) return s;
    *req.add_arrays() = std::move(a);
  }
  absl::StatusOr<v1::RestoreCheckpointResponse> r = d_->arrays_->RestoreCheckpoint(req);
  if (!r.ok()) return r.status();
  Info(absl::StrCat("initialised from ", ck.init_from(), ": ", r->arrays_size(), " arrays, ",
                    r->bytes_read(), " bytes read by the workers"));
  return absl::OkStatus();
}

absl::Status JobDriver::Runner::FinishSave() {
  if (!save_thread_.joinable()) return absl::OkStatus();
  save_thread_.join();
  if (!save_result_.ok()) return save_result_.status();
  d_->NoteCheckpoint(save_result_->path());
  Info(absl::StrCat("checkpoint saved: ", save_result_->path(), " (", save_result_->bytes_written(),
                    " bytes in ", absl::FormatDuration(save_time_), ")"));
  return absl::OkStatus();
}

absl::Status JobDriver::Runner::SaveAt(int64_t at) {
  const v1::CheckpointPolicy& ck = job_.checkpoint();
  // A second save waits for the first; the snapshot replaces the one it writes from.
  if (absl::Status s = FinishSave(); !s.ok()) return s;
  std::string from = "";
  if (ck.async()) {
    // The snapshot: an identity shard_map copies every state block on its worker.
    from = "snapshot/";
    ShardMapBuilder copy(d_->registry_->mesh());
    v1::ShardMapRequest req;
    for (const v1::StateArraySpec& a : job_.state()) {
      const PartitionSpec spec = PartitionSpec::FromProto(a.spec());
      copy.Output(
          copy.Input(a.dtype(), Dims(a.shape().dims().begin(), a.shape().dims().end()), spec),
          spec);
      req.add_input_ids(Id(a.name()));
      req.add_output_ids(Id(from + a.name()));
      d_->arrays_->Delete(Id(from + a.name())).IgnoreError();  // the last save's
    }
    absl::StatusOr<v1::ShardMapProgram> program = copy.Build();
    if (!program.ok()) return program.status();
    *req.mutable_program() = *std::move(program);
    if (absl::StatusOr<v1::ShardMapResponse> r = d_->arrays_->ShardMap(req, &d_->cancel_); !r.ok())
      return r.status();
  }
  v1::SaveCheckpointRequest req;
  req.set_root(ck.dir());
  req.set_step(at);
  req.set_keep(ck.keep());
  for (v1::CheckpointArray& a : StateArrays(from)) *req.add_arrays() = std::move(a);
  save_thread_ = std::thread([this, req] {
    const absl::Time t0 = absl::Now();
    save_result_ = d_->arrays_->SaveCheckpoint(req);
    save_time_ = absl::Now() - t0;
  });
  return ck.async() ? absl::OkStatus() : FinishSave();
}

}  // namespace meshrun
