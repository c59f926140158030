#include "meshrun/job.h"

#include "absl/strings/str_cat.h"
#include "core/sharding/logical_axes.h"
#include "meshrun/workloads.h"

namespace meshrun {
namespace {

// Fashion-MNIST's test split, evaluated in batches that divide it.
constexpr int64_t kFashionMnistTestExamples = 10000;

// The main job's (dp_classifier's) model, optimizer and batch, from the config's keys.
absl::StatusOr<Workload> MainJobModel(const JobConfig& c, DType dtype) {
  Workload w;
  w.name = c.model.name;
  const int k = c.optimizer.num_minibatches;
  w.batch = ClassifierBatch(c.data.batch_size / k);
  ClassifierOptions model;
  model.hidden_size = c.model.hidden_size;
  model.num_classes = c.model.num_classes;
  model.dropout_rate = static_cast<float>(c.model.dropout_rate);
  model.dtype = dtype;
  w.loss = ClassifierLoss(model);
  absl::StatusOr<OptimizerConfig::Kind> kind = ParseOptimizerKind(c.optimizer.name);
  if (!kind.ok()) return kind.status();
  w.optimizer.kind = *kind;
  w.optimizer.learning_rate = static_cast<float>(c.optimizer.learning_rate);
  w.optimizer.b1 = static_cast<float>(c.optimizer.b1);
  w.optimizer.b2 = static_cast<float>(c.optimizer.b2);
  w.optimizer.eps = static_cast<float>(c.optimizer.eps);
  w.optimizer.weight_decay = static_cast<float>(c.optimizer.weight_decay);
  w.num_minibatches = k;
  w.examples_per_step = c.data.batch_size;
  return w;
}

// The model, optimizer and batch of the job's train step.
absl::StatusOr<Workload> JobModel(const JobConfig& c) {
  const DType dtype = c.precision.compute == "bf16" ? v1::DTYPE_BF16 : v1::DTYPE_F32;
  absl::StatusOr<Workload> w = c.model.name == "dp_classifier"
                                   ? MainJobModel(c, dtype)
                                   : SeedWorkload(c.model.name, {dtype});
  if (w.ok() && c.precision.reduce == "bf16") w->optimizer.reduce_dtype = v1::DTYPE_BF16;
  return w;
}

// An input pipeline feeding `batch` (the step's planned batch arrays, in order) from the
// dataset's fields of the same names.
v1::InputSpec Input(const JobConfig& c, const std::vector<PlannedArray>& batch,
                    const std::string& path, const std::string& split, int64_t global_batch,
                    int num_minibatches, bool train) {
  v1::InputSpec in;
  in.set_format(c.data.dataset == "npy" ? "npy" : "idx");
  in.set_path(path);
  in.set_split(split);
  for (const PlannedArray& a : batch) {
    v1::InputFieldSpec* f = in.add_fields();
    f->set_field(a.name);
    f->set_dtype(a.dtype);
    for (int64_t d : a.shape) f->mutable_global_shape()->add_dims(d);
    *f->mutable_spec() = a.spec.ToProto();
  }
  in.set_global_batch_size(global_batch);
  in.set_num_minibatches(num_minibatches);
  in.set_seed(c.train.seed);
  in.set_shuffle(train && c.data.shuffle);
  in.set_drop_remainder(train ? c.data.drop_remainder : true);
  in.set_one_pass(!train);
  return in;
}

// The evaluation step and its input, when the job evaluates.
absl::Status PlanEval(const JobConfig& c, const Workload& w, PlannedJob* job) {
  if (!c.train.evaluate || c.data.dataset == "synthetic") return absl::OkStatus();
  if (c.data.dataset == "npy" && c.data.eval_path.empty()) return absl::OkStatus();
  int64_t batch = c.data.eval_batch_size;
  if (batch == 0) batch = c.data.dataset == "fashion_mnist" ? 1000 : w.examples_per_step;
  std::vector<BatchSpec> eval = w.batch;
  for (BatchSpec& b : eval) b.shape[0] = batch;
  absl::StatusOr<v1::GlobalProgram> program = BuildEvalStep(job->step, eval, w.loss);
  if (!program.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("evaluation (data.eval_batch_size ", batch,
                                                   "): ", program.status().message()));
  }
  *job->spec.mutable_eval_step() = *std::move(program);
  std::vector<PlannedArray> planned;
  for (const BatchSpec& b : eval) {
    absl::StatusOr<PartitionSpec> spec = LogicalToMesh(b.logical_axes, job->step.sharding.rules);
    if (!spec.ok()) return spec.status();
    planned.push_back({b.name, b.shape, *spec, 0, b.dtype});
  }
  const bool idx = c.data.dataset == "fashion_mnist";
  *job->spec.mutable_eval_input() =
      Input(c, planned, idx ? c.data.path : c.data.eval_path, idx ? "test" : "", batch, 1, false);
  if (idx && kFashionMnistTestExamples % batch != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'data.eval_batch_size' ", batch, " does not divide Fashion-MNIST's ",
        kFashionMnistTestExamples, " test images (the remainder would not be evaluated)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<nn::ShardingConfig> WorkloadSharding(const std::string& layout,
                                                    const std::string& rules,
                                                    const std::string& fsdp_axis,
                                                    int64_t min_weight_size) {
  nn::ShardingConfig sharding;
  if (!layout.empty()) {
    absl::StatusOr<nn::ShardingConfig> named = LayoutSharding(layout);
    if (!named.ok()) return named.status();
    sharding = *named;
  } else {
    absl::StatusOr<LogicalAxisRules> parsed = ParseLogicalAxisRules(rules);
    if (!parsed.ok()) return parsed.status();
    sharding.rules = *parsed;
    sharding.fsdp_axis = fsdp_axis;
  }
  sharding.min_weight_size = min_weight_size;
  return sharding;
}

absl::StatusOr<PlannedJob> PlanJob(const JobConfig& c, const Mesh& mesh) {
  absl::StatusOr<Workload> w = JobModel(c);
  if (!w.ok()) return w.status();
  std::string layout = c.sharding.layout;
  if (layout.empty() && c.sharding.rules.empty() && c.model.name == "dp_classifier") layout = "dp";
  absl::StatusOr<nn::ShardingConfig> sharding =
      WorkloadSharding(layout, c.sharding.rules, c.sharding.fsdp_axis, c.sharding.min_weight_size);
  if (!sharding.ok()) return sharding.status();
  PlannedJob job;
  OptimizerConfig optimizer = w->optimizer;
  optimizer.apply_if_finite = c.train.on_nonfinite == "skip_step";
  absl::StatusOr<TrainStep> step = BuildTrainStep(mesh, *sharding, optimizer, w->batch, w->loss,
                                                  c.train.seed, w->num_minibatches);
  if (!step.ok()) return step.status();
  job.step = *std::move(step);
  v1::JobSpec& spec = job.spec;
  spec.set_name(c.model.name);
  *spec.mutable_mesh() = mesh.ToProto();
  *spec.mutable_train_step() = job.step.step_global;
  *spec.mutable_init() = job.step.init;
  for (const PlannedArray& a : job.step.state) {
    v1::StateArraySpec* s = spec.add_state();
    s->set_name(a.name);
    s->set_dtype(a.dtype);
    for (int64_t d : a.shape) s->mutable_shape()->add_dims(d);
    *s->mutable_spec() = a.spec.ToProto();
  }
  for (const std::string& m : job.step.metrics) spec.add_metrics(m);
  spec.set_seed(c.train.seed);
  spec.set_examples_per_step(w->examples_per_step);
  if (c.data.dataset == "synthetic") {
    job.own_batch = *w;
  } else {
    *spec.mutable_train_input() = Input(c, job.step.batch, c.data.path, "train",
                                        w->examples_per_step, w->num_minibatches, true);
  }
  if (absl::Status s = PlanEval(c, *w, &job); !s.ok()) return s;
  v1::TrainSchedule* sched = spec.mutable_schedule();
  sched->set_total_steps(c.train.max_steps > 0           ? c.train.max_steps
                         : c.data.dataset == "synthetic" ? 20
                                                         : 0);
  sched->set_epochs(c.train.epochs);
  sched->set_log_every(c.train.log_every);
  sched->set_collective_timeout_seconds(c.train.collective_timeout_seconds);
  sched->set_on_nonfinite(c.train.on_nonfinite);
  sched->set_when_busy(c.train.when_busy);
  sched->set_evaluate(spec.has_eval_input());
  v1::CheckpointPolicy* ck = spec.mutable_checkpoint();
  ck->set_dir(c.checkpoint.dir);
  ck->set_save_every(c.checkpoint.save_every);
  ck->set_keep(c.checkpoint.keep);
  ck->set_async(c.checkpoint.async);
  ck->set_resume(c.checkpoint.resume);
  ck->set_init_from(c.checkpoint.init_from);
  spec.mutable_recovery()->set_max_restarts(c.recovery.max_restarts);
  spec.mutable_recovery()->set_timeout_seconds(c.recovery.timeout_seconds);
  spec.mutable_recovery()->set_min_workers(c.recovery.min_workers);
  spec.mutable_recovery()->set_peer_state_every(c.recovery.peer_state_every);
  return job;
}

}  // namespace meshrun
