#include "meshrun/train_step.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
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

namespace {

absl::Status CheckStepOptions(const OptimizerConfig& optimizer, int num_minibatches) {
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
  return absl::OkStatus();
}

// The step program's values: its inputs (the TrainState's arrays, in out->state's order, then
// the batch) and what the step computes from them.
struct StepValues {
  nn::Value step, rng;
  std::vector<nn::Value> params, mu, nu, batch;
  std::vector<nn::Value> grads, metrics;  // metrics: summed over the minibatches
  nn::Value loss;
  std::vector<nn::Value> new_params, new_mu, new_nu;
};

// Declares the step program's inputs, in order step, rng, params, mu, nu (Adam) and the batch,
// and records the TrainState's arrays in out->state.
void DeclareInputs(JitBuilder& jit, nn::Scope& scope, bool adam, TrainStep* out, StepValues& v) {
  for (const nn::ParamInfo& p : out->params) {
    out->state.push_back({p.name, p.shape, p.spec, BytesPerWorker(out->mesh, p.shape, p.spec)});
  }
  v.params = scope.param_values();
  if (adam) {
    for (const char* moment : {"mu", "nu"}) {
      for (const nn::ParamInfo& p : out->params) {
        out->state.push_back({absl::StrCat("opt_state/", moment, "/", p.name), p.shape, p.spec,
                              BytesPerWorker(out->mesh, p.shape, p.spec)});
        (moment[0] == 'm' ? v.mu : v.nu).push_back(jit.Input(v1::DTYPE_F32, p.shape, p.spec));
      }
    }
  }
  for (const PlannedArray& a : out->batch) v.batch.push_back(jit.Input(a.dtype, a.shape, a.spec));
}

// The loss, gradients and metrics of the step, over `num_minibatches` minibatches (the seed's
// accumulate_gradients: gradients and metrics summed, the loss averaged).
absl::Status AccumulateGradients(JitBuilder& jit, nn::Scope& scope, const LossFn& loss_fn,
                                 int num_minibatches, size_t num_metrics, StepValues& v) {
  for (int k = 0; k < num_minibatches; ++k) {
    std::vector<nn::Value> mb;
    for (nn::Value x : v.batch) mb.push_back(num_minibatches > 1 ? jit.Index(x, k) : x);
    scope.SetRng(jit.FoldIn(jit.FoldIn(v.rng, v.step), jit.Constant(static_cast<float>(k), {})));
    nn::Value loss = loss_fn(scope, mb);
    if (!scope.status().ok()) return scope.status();
    std::vector<std::pair<std::string, nn::Value>> sown = scope.TakeSown();
    for (size_t m = 0; m < sown.size() && m < num_metrics; ++m) {
      v.metrics.resize(num_metrics);
      v.metrics[m] = k == 0 ? sown[m].second : jit.Add(v.metrics[m], sown[m].second);
    }
    // The seed's accumulate_gradients averages the minibatch gradients: each is taken of
    // loss / k, which scales the small cotangents rather than the whole summed gradient.
    std::vector<nn::Value> g = jit.Grad(
        num_minibatches > 1 ? jit.Scale(loss, 1.0f / static_cast<float>(num_minibatches)) : loss,
        v.params);
    v.loss = k == 0 ? loss : jit.Add(v.loss, loss);
    if (k == 0) {
      v.grads = g;
    } else {
      for (size_t j = 0; j < g.size(); ++j) v.grads[j] = jit.Add(v.grads[j], g[j]);
    }
  }
  if (num_minibatches > 1) {
    // The mean of the minibatch losses, as the seed's accumulate_gradients reports it.
    v.loss = jit.Scale(v.loss, 1.0f / static_cast<float>(num_minibatches));
  }
  return absl::OkStatus();
}

// The updated parameters (and Adam moments) from the gradients.
void ApplyOptimizer(JitBuilder& jit, const OptimizerConfig& optimizer,
                    const std::vector<nn::ParamInfo>& params, StepValues& v) {
  v1::AdamWAttrs hp;
  hp.set_learning_rate(optimizer.learning_rate);
  hp.set_b1(optimizer.b1);
  hp.set_b2(optimizer.b2);
  hp.set_eps(optimizer.eps);
  hp.set_weight_decay(optimizer.kind == OptimizerConfig::kAdamW ? optimizer.weight_decay : 0.0f);
  if (optimizer.reduce_dtype == v1::DTYPE_BF16) hp.set_reduce_dtype(v1::DTYPE_BF16);
  for (size_t j = 0; j < v.params.size(); ++j) {
    if (optimizer.kind != OptimizerConfig::kSgd) {
      // The update brings the gradient into its parameter's layout itself: a psum over the axes
      // it was summed over (fused with the update), or a psum_scatter where the parameter is
      // sharded over them (FSDP).
      std::vector<nn::Value> u =
          jit.AdamUpdate(v.params[j], v.grads[j], v.mu[j], v.nu[j], v.step, hp);
      if (u.size() != 3) break;
      v.new_params.push_back(u[0]);
      v.new_mu.push_back(u[1]);
      v.new_nu.push_back(u[2]);
    } else {
      // The gradient in its parameter's layout: psum over the axes it was summed over, or
      // psum_scatter where the parameter is sharded over them (FSDP).
      nn::Value g = jit.WithShardingConstraint(v.grads[j], params[j].spec);
      v.new_params.push_back(jit.Sub(v.params[j], jit.Scale(g, optimizer.learning_rate)));
    }
  }
}

// optax.apply_if_finite: every state array keeps its old value unless the loss and every updated
// parameter are finite.
void KeepStateIfNonFinite(JitBuilder& jit, StepValues& v) {
  // x - x is 0 for a finite x and NaN otherwise: one scalar that is 0 exactly when the loss
  // and every updated parameter are finite; each state array takes its old or new value.
  nn::Value total = jit.Sub(v.loss, v.loss);
  for (nn::Value p : v.new_params) {
    const int64_t rank = static_cast<int64_t>(jit.shape(p).size());
    std::vector<int64_t> all(rank);
    for (int64_t d = 0; d < rank; ++d) all[d] = d;
    total = jit.Add(total, jit.Reduce("sum", jit.Sub(p, p), all));
  }
  const nn::Value finite = jit.Binary("eq", total, jit.Constant(0.0f, {}));
  auto keep = [&](const std::vector<nn::Value>& old, std::vector<nn::Value>& updated) {
    for (size_t j = 0; j < updated.size(); ++j) updated[j] = jit.Select(finite, old[j], updated[j]);
  };
  keep(v.params, v.new_params);
  keep(v.mu, v.new_mu);
  keep(v.nu, v.new_nu);
}

// The init program: each worker draws its own blocks of the parameters (zeros for the moments).
absl::StatusOr<v1::ShardMapProgram> BuildInitProgram(const Mesh& mesh,
                                                     const std::vector<nn::ParamInfo>& params,
                                                     uint64_t seed, bool adam) {
  ShardMapBuilder init(mesh);
  init.Output(init.Full(v1::DTYPE_F32, {}, 0.0), PartitionSpec());
  for (const nn::ParamInfo& p : params) {
    absl::StatusOr<nn::Draw> d = nn::ResolveInitializer(p.init, p.shape, p.batch_dims);
    if (!d.ok()) return d.status();
    init.Output(init.RandomInit(p.shape, p.spec, d->fn, d->scale, nn::ParamKey(seed, p.name)),
                p.spec);
  }
  if (adam) {
    for (int moment = 0; moment < 2; ++moment) {
      for (const nn::ParamInfo& p : params)
        init.Output(init.RandomInit(p.shape, p.spec, "zeros", 0, {0, 0}), p.spec);
    }
  }
  return init.Build();
}

}  // namespace

absl::StatusOr<TrainStep> BuildTrainStep(const Mesh& mesh, const nn::ShardingConfig& sharding,
                                         const OptimizerConfig& optimizer,
                                         const std::vector<BatchSpec>& batch, const LossFn& loss_fn,
                                         uint64_t seed, int num_minibatches) {
  if (absl::Status s = CheckStepOptions(optimizer, num_minibatches); !s.ok()) return s;
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
  StepValues v;
  out.state.push_back({"step", {}, PartitionSpec(), 4});
  v.step = jit.Input(v1::DTYPE_F32, {}, PartitionSpec());
  out.state.push_back({"rng", {2}, PartitionSpec(), 8, v1::DTYPE_U32});
  v.rng = jit.Input(v1::DTYPE_U32, {2}, PartitionSpec());
  nn::Scope scope(jit, sharding, out.params);  // the parameters' inputs
  DeclareInputs(jit, scope, adam, &out, v);
  if (absl::Status s =
          AccumulateGradients(jit, scope, loss_fn, num_minibatches, out.metrics.size(), v);
      !s.ok())
    return s;
  ApplyOptimizer(jit, optimizer, out.params, v);
  if (optimizer.apply_if_finite && v.new_params.size() == v.params.size()) {
    KeepStateIfNonFinite(jit, v);
  }
  jit.Output(jit.Add(v.step, jit.Constant(1.0f, {})), PartitionSpec());
  jit.Output(v.rng, PartitionSpec());
  for (size_t j = 0; j < v.new_params.size(); ++j) jit.Output(v.new_params[j], out.params[j].spec);
  for (size_t j = 0; j < v.new_mu.size(); ++j) jit.Output(v.new_mu[j], out.params[j].spec);
  for (size_t j = 0; j < v.new_nu.size(); ++j) jit.Output(v.new_nu[j], out.params[j].spec);
  jit.Output(v.loss, PartitionSpec());
  for (nn::Value m : v.metrics) jit.Output(m, PartitionSpec());
  absl::StatusOr<v1::ShardMapProgram> program = jit.Build();
  if (!program.ok()) return program.status();
  out.step = *std::move(program);
  out.step_global = jit.global_program();
  out.collectives = jit.collectives();
  absl::StatusOr<v1::ShardMapProgram> init_program = BuildInitProgram(mesh, out.params, seed, adam);
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

}  // namespace meshrun
