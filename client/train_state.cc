// TrainState (meshrun/train_step.h): a TrainStep's arrays on the workers, initialised, stepped,
// saved (synchronously or in the background), restored and deleted through the coordinator.
#include <map>

#include "absl/strings/str_cat.h"
#include "core/checkpoint/checkpoint.h"
#include "meshrun/train_step.h"

namespace meshrun {

absl::StatusOr<TrainState> TrainState::Init(Client* client, const TrainStep* step,
                                            std::string prefix) {
  TrainState state(client, step, std::move(prefix));
  std::vector<std::string> ids;
  for (const PlannedArray& a : step->state)
    if (a.name != "rng") ids.push_back(state.Id(a.name));
  absl::StatusOr<std::vector<v1::ArrayInfo>> out = client->ShardMap(step->init, {}, ids);
  if (!out.ok()) return out.status();
  // jax.random.PRNGKey(seed), put from here (two words; no float constant can carry them).
  Tensor key(v1::DTYPE_U32, {2});
  key.data<uint32_t>()[0] = static_cast<uint32_t>(step->seed >> 32);
  key.data<uint32_t>()[1] = static_cast<uint32_t>(step->seed & 0xFFFFFFFFu);
  absl::StatusOr<v1::ArrayInfo> put = client->Put(key, PartitionSpec(), state.Id("rng"));
  if (!put.ok()) return put.status();
  return state;
}

v1::SaveCheckpointRequest TrainState::SaveRequest(const std::string& root, int keep,
                                                  const std::string& id_prefix) const {
  v1::SaveCheckpointRequest req;
  req.set_root(root);
  req.set_step(steps_);
  req.set_keep(keep);
  for (const PlannedArray& a : step_->state) {
    v1::CheckpointArray* c = req.add_arrays();
    c->set_name(a.name);
    c->set_id(Id(id_prefix + a.name));
  }
  return req;
}

absl::StatusOr<std::string> TrainState::Save(const std::string& root, int keep) {
  absl::StatusOr<v1::SaveCheckpointResponse> resp =
      client_->SaveCheckpoint(SaveRequest(root, keep, ""));
  if (!resp.ok()) return resp.status();
  return resp->path();
}

absl::StatusOr<TrainState> TrainState::InitFrom(Client* client, const TrainStep* step,
                                                const std::string& path, std::string prefix) {
  absl::StatusOr<std::vector<std::pair<std::string, Tensor>>> file =
      checkpoint::ReadSafetensors(path);
  if (!file.ok()) return file.status();
  std::map<std::string, const Tensor*> by_name;
  for (const auto& [name, t] : *file) by_name[name] = &t;
  for (const nn::ParamInfo& p : step->params) {
    auto it = by_name.find(p.name);
    if (it == by_name.end())
      return absl::NotFoundError(absl::StrCat(path, " has no tensor ", p.name));
    if (it->second->dims() != p.shape || it->second->dtype() != v1::DTYPE_F32) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": ", p.name, " is ", DTypeName(it->second->dtype()),
          DimsToString(it->second->dims()), "; the model wants f32", DimsToString(p.shape)));
    }
  }
  absl::StatusOr<TrainState> state = Init(client, step, std::move(prefix));
  if (!state.ok()) return state.status();
  for (const nn::ParamInfo& p : step->params) {
    if (absl::Status s = client->Delete(state->Id(p.name)); !s.ok()) return s;
    absl::StatusOr<v1::ArrayInfo> put = client->Put(*by_name[p.name], p.spec, state->Id(p.name));
    if (!put.ok()) return put.status();
  }
  return state;
}

TrainState::~TrainState() {
  if (pending_save_.valid()) pending_save_.wait();
}

absl::Status TrainState::SaveAsync(const std::string& root, int keep) {
  if (pending_save_.valid()) {
    if (absl::StatusOr<std::string> previous = pending_save_.get(); !previous.ok())
      return previous.status();
  }
  // The snapshot: an identity shard_map copies every state block on its worker.
  const std::string snapshot = "snapshot/";
  ShardMapBuilder copy(step_->mesh);
  std::vector<std::string> ids, snapshot_ids;
  for (const PlannedArray& a : step_->state) {
    copy.Output(copy.Input(a.dtype, a.shape, a.spec), a.spec);
    ids.push_back(Id(a.name));
    snapshot_ids.push_back(Id(snapshot + a.name));
  }
  absl::StatusOr<v1::ShardMapProgram> program = copy.Build();
  if (!program.ok()) return program.status();
  absl::StatusOr<std::vector<v1::ArrayInfo>> out = client_->ShardMap(*program, ids, snapshot_ids);
  if (!out.ok()) return out.status();
  const v1::SaveCheckpointRequest req = SaveRequest(root, keep, snapshot);
  Client* client = client_;
  pending_save_ =
      std::async(std::launch::async, [client, req, snapshot_ids]() -> absl::StatusOr<std::string> {
        absl::StatusOr<v1::SaveCheckpointResponse> resp = client->SaveCheckpoint(req);
        for (const std::string& id : snapshot_ids) client->Delete(id).IgnoreError();
        if (!resp.ok()) return resp.status();
        return resp->path();
      });
  return absl::OkStatus();
}

absl::StatusOr<std::string> TrainState::WaitForSave() {
  if (!pending_save_.valid()) return absl::FailedPreconditionError("no async save in flight");
  return pending_save_.get();
}

absl::StatusOr<TrainState> TrainState::Restore(Client* client, const TrainStep* step,
                                               const std::string& path, std::string prefix) {
  TrainState state(client, step, std::move(prefix));
  v1::RestoreCheckpointRequest req;
  req.set_path(path);
  for (const PlannedArray& a : step->state) {
    v1::CheckpointArray* c = req.add_arrays();
    c->set_name(a.name);
    c->set_id(state.Id(a.name));
    *c->mutable_spec() = a.spec.ToProto();
  }
  absl::StatusOr<v1::RestoreCheckpointResponse> resp = client->RestoreCheckpoint(req);
  if (!resp.ok()) return resp.status();
  state.steps_ = resp->step();
  return state;
}

absl::StatusOr<float> TrainState::Step(const std::vector<std::string>& batch_ids) {
  absl::StatusOr<std::vector<float>> losses = Steps({batch_ids});
  if (!losses.ok()) return losses.status();
  return losses->front();
}

absl::StatusOr<std::vector<float>> TrainState::Steps(
    const std::vector<std::vector<std::string>>& batches) {
  if (batches.empty()) return absl::InvalidArgumentError("Steps: no batches");
  std::vector<std::string> state, outputs;
  std::vector<int> donate;
  for (const PlannedArray& a : step_->state) {
    donate.push_back(static_cast<int>(state.size()));
    state.push_back(Id(a.name));
    outputs.push_back(Id(a.name));
  }
  // The loss and the metrics come back in the response.
  std::vector<int> fetch;
  for (size_t m = 0; m <= step_->metrics.size(); ++m) {
    fetch.push_back(static_cast<int>(outputs.size()));
    outputs.push_back("");
  }
  std::vector<std::vector<std::string>> runs;  // each step's arguments: the state, then its batch
  for (size_t k = 0; k < batches.size(); ++k) {
    if (batches[k].size() != step_->batch.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("train step takes ", step_->batch.size(), " batch arrays; got ",
                       batches[k].size(), batches.size() > 1 ? absl::StrCat(" for step ", k) : ""));
    }
    runs.push_back(state);
    runs.back().insert(runs.back().end(), batches[k].begin(), batches[k].end());
  }
  const std::vector<std::vector<std::string>> more_runs(runs.begin() + 1, runs.end());
  // The coordinator partitions the global step (once; then from its cache) and runs it.
  absl::StatusOr<Client::JitResult> out = client_->Jit(step_->step_global, runs.front(), outputs,
                                                       absl::Seconds(30), donate, fetch, more_runs);
  if (!out.ok()) return out.status();
  std::vector<float> losses;
  for (size_t f = 0; f < out->fetched.size(); f += fetch.size()) {
    const Tensor& loss = out->fetched[f];
    if (loss.num_elements() != 1)
      return absl::InternalError("the train step returned no scalar loss");
    losses.push_back(loss.data<float>()[0]);
  }
  if (losses.size() != batches.size()) {
    return absl::InternalError(absl::StrCat("the train steps returned ", losses.size(),
                                            " losses for ", batches.size(), " steps"));
  }
  steps_ += static_cast<int64_t>(batches.size());
  return losses;
}

absl::StatusOr<Tensor> TrainState::Get(const std::string& name) const {
  return client_->Get(Id(name));
}

absl::Status TrainState::Delete() {
  for (const PlannedArray& a : step_->state) {
    if (absl::Status s = client_->Delete(Id(a.name)); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace meshrun
