#include "meshrun/train_step.h"

#include <algorithm>
#include <map>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/checkpoint/checkpoint.h"
#include "core/sharding/named_sharding.h"

namespace meshrun {
namespace {

int64_t BytesPerWorker(const Mesh& mesh, const Dims& shape, const PartitionSpec& spec,
                       DType dtype = v1::DTYPE_F32) {
  return NumElements(NamedSharding(mesh, spec).ShardDims(shape)) *
         static_cast<int64_t>(DTypeSize(dtype));
}

// The batch arrays' layouts: the rules applied to each input's logical axes; with minibatches,
// a leading unsharded dim.
absl::StatusOr<std::vector<PlannedArray>> PlanBatch(const Mesh& mesh,
                                                    const nn::ShardingConfig& sharding,
                                                    const std::vector<BatchSpec>& batch,
                                                    int num_minibatches) {
  std::vector<PlannedArray> out;
  for (const BatchSpec& b : batch) {
    if (b.logical_axes.size() != b.shape.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("batch input ", b.name, ": ", b.logical_axes.size(),
                       " logical axes for shape (", absl::StrJoin(b.shape, ", "), ")"));
    }
    absl::StatusOr<PartitionSpec> spec = LogicalToMesh(b.logical_axes, sharding.rules);
    if (!spec.ok())
      return absl::InvalidArgumentError(
          absl::StrCat("batch input ", b.name, ": ", spec.status().message()));
    if (absl::Status s = NamedSharding(mesh, *spec).Validate(b.shape); !s.ok()) {
      // With minibatches the shape is one minibatch's: say where its size comes from.
      return absl::InvalidArgumentError(absl::StrCat(
          "batch input ", b.name, ": ", s.message(),
          num_minibatches > 1
              ? absl::StrCat(" (the shape of one of ", num_minibatches,
                             " minibatches: the batch size divided by num_minibatches must be a "
                             "multiple of the mesh axes the batch is sharded over)")
              : ""));
    }
    PlannedArray a{b.name, b.shape, *spec, 0, b.dtype};
    if (num_minibatches > 1) {
      a.shape.insert(a.shape.begin(), num_minibatches);
      std::vector<PartitionSpec::Entry> e = spec->Padded(b.shape.size());
      e.insert(e.begin(), PartitionSpec::Entry{});
      a.spec = PartitionSpec(e);
    }
    a.bytes_per_worker = BytesPerWorker(mesh, a.shape, a.spec, a.dtype);
    out.push_back(a);
  }
  return out;
}

// The batch inputs of one minibatch (without the minibatch dim), laid out as planned.
std::vector<nn::Value> MinibatchInputs(JitBuilder& jit, const std::vector<PlannedArray>& planned,
                                       const std::vector<BatchSpec>& batch, int num_minibatches) {
  std::vector<nn::Value> inputs;
  for (size_t i = 0; i < batch.size(); ++i) {
    std::vector<PartitionSpec::Entry> e = planned[i].spec.Padded(planned[i].shape.size());
    if (num_minibatches > 1) e.erase(e.begin());
    inputs.push_back(jit.Input(batch[i].dtype, batch[i].shape, PartitionSpec(e)));
  }
  return inputs;
}

// jax.eval_shape of the loss: fills step->params and step->metrics.
absl::Status TraceParams(const std::vector<BatchSpec>& batch, const LossFn& loss_fn,
                         TrainStep* step) {
  JitBuilder probe(step->mesh);
  nn::Scope scope(probe, step->sharding);
  scope.SetRng(probe.Input(v1::DTYPE_U32, {2}, PartitionSpec()));
  nn::Value loss =
      loss_fn(scope, MinibatchInputs(probe, step->batch, batch, step->num_minibatches));
  if (!scope.status().ok()) return scope.status();
  probe.Output(loss, PartitionSpec());
  for (const auto& [name, value] : scope.TakeSown()) {
    if (std::find(step->metrics.begin(), step->metrics.end(), name) != step->metrics.end())
      return absl::InvalidArgumentError(absl::StrCat("metric '", name, "' is sown twice"));
    step->metrics.push_back(name);
    probe.Output(value, PartitionSpec());
  }
  if (absl::StatusOr<v1::ShardMapProgram> p = probe.Build(); !p.ok()) return p.status();
  if (!probe.shape(loss).empty()) {
    return absl::InvalidArgumentError(absl::StrCat("the loss must be a scalar; got shape (",
                                                   absl::StrJoin(probe.shape(loss), ", "), ")"));
  }
  step->params = scope.params();
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<OptimizerConfig::Kind> ParseOptimizerKind(const std::string& name) {
  if (name == "sgd") return OptimizerConfig::kSgd;
  if (name == "adam") return OptimizerConfig::kAdam;
  if (name == "adamw") return OptimizerConfig::kAdamW;
  return absl::InvalidArgumentError(
      absl::StrCat("optimizer '", name, "': expected sgd, adam or adamw"));
}

int64_t TrainStep::StateBytesPerWorker() const {
  int64_t total = 0;
  for (const PlannedArray& a : state) total += a.bytes_per_worker;
  return total;
}

std::string TrainStep::Plan() const {
  std::string out =
      absl::StrCat("mesh ", mesh.ToString(), "\nstate (", state.size(), " arrays):\n");
  for (const PlannedArray& a : state) {
    absl::StrAppendFormat(&out, "  %-44s (%s)  %s  %d bytes/worker\n", a.name,
                          absl::StrJoin(a.shape, ", "), a.spec.ToString(), a.bytes_per_worker);
  }
  absl::StrAppendFormat(&out, "  total %d bytes/worker\nbatch:\n", StateBytesPerWorker());
  for (const PlannedArray& a : batch) {
    absl::StrAppendFormat(&out, "  %-44s (%s)  %s  %d bytes/worker\n", a.name,
                          absl::StrJoin(a.shape, ", "), a.spec.ToString(), a.bytes_per_worker);
  }
  int64_t bytes = 0;
  absl::StrAppendFormat(&out, "collectives of one step (%d):\n", collectives.size());
  for (const JitBuilder::Collective& c : collectives) {
    absl::StrAppendFormat(
        &out, "  %-12s over (%s)%s  %d bytes/worker  for %s\n", c.op, absl::StrJoin(c.axes, ", "),
        c.dim >= 0 ? absl::StrCat(" dim ", c.dim) : "", c.bytes_per_device, c.reason);
    bytes += c.bytes_per_device;
  }
  absl::StrAppendFormat(&out, "  total %d bytes/worker sent per step\n", bytes);
  return out;
}

absl::StatusOr<TrainStep> BuildTrainStep(const Mesh& mesh, const nn::ShardingConfig& sharding,
                                         const OptimizerConfig& optimizer,
                                         const std::vector<BatchSpec>& batch, const LossFn& loss_fn,
                                         uint64_t seed, int num_minibatches) {
  if (num_minibatches < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_minibatches ", num_minibatches, ": expected >= 1"));
  }
  if (optimizer.reduce_dtype != v1::DTYPE_F32 &&
      (optimizer.reduce_dtype != v1::DTYPE_BF16 || optimizer.kind == OptimizerConfig::kSgd)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "reduce dtype ", DTypeName(optimizer.reduce_dtype), " with optimizer ",
        optimizer.kind == OptimizerConfig::kSgd ? "sgd" : "adam",
        ": expected f32, or bf16 with adam or adamw (the update that reduces its gradient)"));
  }
  TrainStep out;
  out.mesh = mesh;
  out.sharding = sharding;
  out.num_minibatches = num_minibatches;
  out.seed = seed;
  absl::StatusOr<std::vector<PlannedArray>> planned_batch =
      PlanBatch(mesh, sharding, batch, num_minibatches);
  if (!planned_batch.ok()) return planned_batch.status();
  out.batch = *planned_batch;

  // Trace 1 (abstract): which parameters, with which layouts, and which metrics.
  if (absl::Status s = TraceParams(batch, loss_fn, &out); !s.ok()) return s;
  if (out.params.empty()) return absl::InvalidArgumentError("the loss has no parameters");

  // Trace 2: the step program.
  JitBuilder jit(mesh);
  const bool adam = optimizer.kind != OptimizerConfig::kSgd;
  out.state.push_back({"step", {}, PartitionSpec(), 4});
  nn::Value step = jit.Input(v1::DTYPE_F32, {}, PartitionSpec());
  out.state.push_back({"rng", {2}, PartitionSpec(), 8, v1::DTYPE_U32});
  nn::Value rng = jit.Input(v1::DTYPE_U32, {2}, PartitionSpec());
  nn::Scope scope(jit, sharding, out.params);
  for (const nn::ParamInfo& p : out.params) {
    out.state.push_back({p.name, p.shape, p.spec, BytesPerWorker(mesh, p.shape, p.spec)});
  }
  std::vector<nn::Value> mu, nu;
  if (adam) {
    for (const char* moment : {"mu", "nu"}) {
      for (const nn::ParamInfo& p : out.params) {
        out.state.push_back({absl::StrCat("opt_state/", moment, "/", p.name), p.shape, p.spec,
                             BytesPerWorker(mesh, p.shape, p.spec)});
        (moment[0] == 'm' ? mu : nu).push_back(jit.Input(v1::DTYPE_F32, p.shape, p.spec));
      }
    }
  }
  std::vector<nn::Value> batch_values;
  for (const PlannedArray& a : out.batch)
    batch_values.push_back(jit.Input(a.dtype, a.shape, a.spec));

  const std::vector<nn::Value> params = scope.param_values();
  std::vector<nn::Value> grads, metrics;  // metrics: summed over the minibatches
  nn::Value loss_sum;
  for (int k = 0; k < num_minibatches; ++k) {
    std::vector<nn::Value> mb;
    for (nn::Value v : batch_values) mb.push_back(num_minibatches > 1 ? jit.Index(v, k) : v);
    scope.SetRng(jit.FoldIn(jit.FoldIn(rng, step), jit.Constant(static_cast<float>(k), {})));
    nn::Value loss = loss_fn(scope, mb);
    if (!scope.status().ok()) return scope.status();
    std::vector<std::pair<std::string, nn::Value>> sown = scope.TakeSown();
    for (size_t m = 0; m < sown.size() && m < out.metrics.size(); ++m) {
      metrics.resize(out.metrics.size());
      metrics[m] = k == 0 ? sown[m].second : jit.Add(metrics[m], sown[m].second);
    }
    // The seed's accumulate_gradients averages the minibatch gradients: each is taken of
    // loss / k, which scales the small cotangents rather than the whole summed gradient.
    std::vector<nn::Value> g = jit.Grad(
        num_minibatches > 1 ? jit.Scale(loss, 1.0f / static_cast<float>(num_minibatches)) : loss,
        params);
    loss_sum = k == 0 ? loss : jit.Add(loss_sum, loss);
    if (k == 0) {
      grads = g;
    } else {
      for (size_t j = 0; j < g.size(); ++j) grads[j] = jit.Add(grads[j], g[j]);
    }
  }
  if (num_minibatches > 1) {
    // The mean of the minibatch losses, as the seed's accumulate_gradients reports it.
    loss_sum = jit.Scale(loss_sum, 1.0f / static_cast<float>(num_minibatches));
  }
  v1::AdamWAttrs hp;
  hp.set_learning_rate(optimizer.learning_rate);
  hp.set_b1(optimizer.b1);
  hp.set_b2(optimizer.b2);
  hp.set_eps(optimizer.eps);
  hp.set_weight_decay(optimizer.kind == OptimizerConfig::kAdamW ? optimizer.weight_decay : 0.0f);
  if (optimizer.reduce_dtype == v1::DTYPE_BF16) hp.set_reduce_dtype(v1::DTYPE_BF16);
  std::vector<nn::Value> new_params, new_mu, new_nu;
  for (size_t j = 0; j < params.size(); ++j) {
    if (adam) {
      // The update brings the gradient into its parameter's layout itself: a psum over the axes
      // it was summed over (fused with the update), or a psum_scatter where the parameter is
      // sharded over them (FSDP).
      std::vector<nn::Value> u = jit.AdamUpdate(params[j], grads[j], mu[j], nu[j], step, hp);
      if (u.size() != 3) break;
      new_params.push_back(u[0]);
      new_mu.push_back(u[1]);
      new_nu.push_back(u[2]);
    } else {
      // The gradient in its parameter's layout: psum over the axes it was summed over, or
      // psum_scatter where the parameter is sharded over them (FSDP).
      nn::Value g = jit.WithShardingConstraint(grads[j], out.params[j].spec);
      new_params.push_back(jit.Sub(params[j], jit.Scale(g, optimizer.learning_rate)));
    }
  }
  if (optimizer.apply_if_finite && new_params.size() == params.size()) {
    // x - x is 0 for a finite x and NaN otherwise: one scalar that is 0 exactly when the loss
    // and every updated parameter are finite; each state array takes its old or new value.
    nn::Value total = jit.Sub(loss_sum, loss_sum);
    for (nn::Value p : new_params) {
      const int64_t rank = static_cast<int64_t>(jit.shape(p).size());
      std::vector<int64_t> all(rank);
      for (int64_t d = 0; d < rank; ++d) all[d] = d;
      total = jit.Add(total, jit.Reduce("sum", jit.Sub(p, p), all));
    }
    const nn::Value finite = jit.Binary("eq", total, jit.Constant(0.0f, {}));
    auto keep = [&](const std::vector<nn::Value>& old, std::vector<nn::Value>& updated) {
      for (size_t j = 0; j < updated.size(); ++j)
        updated[j] = jit.Select(finite, old[j], updated[j]);
    };
    keep(params, new_params);
    keep(mu, new_mu);
    keep(nu, new_nu);
  }
  jit.Output(jit.Add(step, jit.Constant(1.0f, {})), PartitionSpec());
  jit.Output(rng, PartitionSpec());
  for (size_t j = 0; j < new_params.size(); ++j) jit.Output(new_params[j], out.params[j].spec);
  for (size_t j = 0; j < new_mu.size(); ++j) jit.Output(new_mu[j], out.params[j].spec);
  for (size_t j = 0; j < new_nu.size(); ++j) jit.Output(new_nu[j], out.params[j].spec);
  jit.Output(loss_sum, PartitionSpec());
  for (nn::Value m : metrics) jit.Output(m, PartitionSpec());
  absl::StatusOr<v1::ShardMapProgram> program = jit.Build();
  if (!program.ok()) return program.status();
  out.step = *std::move(program);
  out.step_global = jit.global_program();
  out.collectives = jit.collectives();

  // The init program: each worker draws its own blocks.
  ShardMapBuilder init(mesh);
  init.Output(init.Full(v1::DTYPE_F32, {}, 0.0), PartitionSpec());
  for (const nn::ParamInfo& p : out.params) {
    absl::StatusOr<nn::Draw> d = nn::ResolveInitializer(p.init, p.shape, p.batch_dims);
    if (!d.ok()) return d.status();
    init.Output(init.RandomInit(p.shape, p.spec, d->fn, d->scale, nn::ParamKey(seed, p.name)),
                p.spec);
  }
  if (adam) {
    for (int moment = 0; moment < 2; ++moment) {
      for (const nn::ParamInfo& p : out.params)
        init.Output(init.RandomInit(p.shape, p.spec, "zeros", 0, {0, 0}), p.spec);
    }
  }
  absl::StatusOr<v1::ShardMapProgram> init_program = init.Build();
  if (!init_program.ok()) return init_program.status();
  out.init = *std::move(init_program);
  return out;
}

absl::StatusOr<v1::GlobalProgram> BuildEvalStep(const TrainStep& step,
                                                const std::vector<BatchSpec>& batch,
                                                const LossFn& loss_fn) {
  absl::StatusOr<std::vector<PlannedArray>> planned =
      PlanBatch(step.mesh, step.sharding, batch, /*num_minibatches=*/1);
  if (!planned.ok()) return planned.status();
  JitBuilder jit(step.mesh);
  nn::Scope scope(jit, step.sharding, step.params);  // the parameters' inputs come first
  scope.set_deterministic(true);
  std::vector<nn::Value> inputs;
  for (const PlannedArray& a : *planned) inputs.push_back(jit.Input(a.dtype, a.shape, a.spec));
  nn::Value loss = loss_fn(scope, inputs);
  if (!scope.status().ok()) return scope.status();
  jit.Output(loss, PartitionSpec());
  std::vector<std::pair<std::string, nn::Value>> sown = scope.TakeSown();
  for (const std::string& name : step.metrics) {
    auto it =
        std::find_if(sown.begin(), sown.end(), [&](const auto& m) { return m.first == name; });
    if (it == sown.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the evaluation pass did not sow metric '", name, "' as training does"));
    }
    jit.Output(it->second, PartitionSpec());
  }
  if (absl::StatusOr<v1::ShardMapProgram> p = jit.Build(); !p.ok()) return p.status();
  return jit.global_program();
}

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
