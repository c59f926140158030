#include "core/program/dp_classifier.h"

#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/sharding/named_sharding.h"

namespace meshrun {
namespace {

// Flax lecun_normal: truncated normal with variance 1 / fan_in (the 0.8796... corrects for the
// truncation at two standard deviations).
float LecunNormalStddev(int64_t fan_in) { return std::sqrt(1.0f / fan_in) / 0.87962566103423978f; }

class Builder {
 public:
  Builder(const Mesh& mesh, v1::StepProgram* program) : mesh_(mesh), program_(program) {}

  void Buffer(const std::string& name, DType dtype, Dims local, Dims global, PartitionSpec spec,
              v1::BufferRole role) {
    v1::BufferDecl* b = program_->add_buffers();
    b->set_name(name);
    b->set_dtype(dtype);
    for (int64_t d : local) b->mutable_shape()->add_dims(d);
    *b->mutable_sharding() = NamedSharding(mesh_, std::move(spec)).ToProto();
    b->set_role(role);
    (void)global;
  }
  void Replicated(const std::string& name, Dims dims, v1::BufferRole role, DType dtype = v1::DTYPE_F32) {
    Buffer(name, dtype, dims, dims, PartitionSpec(), role);
  }
  // A per-worker slice of an array sharded over 'data' along dim 0.
  void BatchSharded(const std::string& name, Dims local, int data_size, v1::BufferRole role,
                    DType dtype = v1::DTYPE_F32) {
    Dims global = local;
    global[0] *= data_size;
    Buffer(name, dtype, local, global, PartitionSpec::Of({"data"}), role);
  }

  v1::Function* Function(const std::string& name) {
    v1::Function* f = program_->add_functions();
    f->set_name(name);
    return f;
  }

 private:
  const Mesh& mesh_;
  v1::StepProgram* program_;
};

v1::Op* AddOp(v1::Function* f, v1::OpKind kind, std::vector<std::string> inputs,
              std::vector<std::string> outputs) {
  v1::Op* op = f->add_ops();
  op->set_kind(kind);
  for (auto& i : inputs) op->add_inputs(i);
  for (auto& o : outputs) op->add_outputs(o);
  return op;
}

void AddFeeds(v1::Function* f, const std::string& images, const std::string& labels) {
  auto* a = f->add_feeds();
  a->set_buffer(images);
  a->set_source(v1::FEED_SOURCE_IMAGES);
  auto* b = f->add_feeds();
  b->set_buffer(labels);
  b->set_source(v1::FEED_SOURCE_LABELS);
}

const char* kParams[] = {"input_dense/kernel", "input_dense/bias", "output_dense/kernel",
                         "output_dense/bias"};

}  // namespace

absl::StatusOr<v1::StepProgram> BuildDpClassifierProgram(const JobConfig& config, const Mesh& mesh) {
  if (config.derived_step()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model '", config.model.name, "' is a derived train step: `meshrun train --config` runs it ",
        "from the client, the coordinator partitioning each step; the job driver runs dp_classifier"));
  }
  absl::StatusOr<int> data_axis = mesh.AxisIndex("data");
  if (!data_axis.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the dp_classifier job shards its batch over mesh axis 'data', which is not in ",
                     mesh.ToString()));
  }
  const int data = mesh.axis_size(*data_axis);
  const int nmb = config.optimizer.num_minibatches;
  const int batch = config.data.batch_size;
  if (batch % (data * nmb) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'data.batch_size' (", batch, ") must be divisible by mesh axis 'data' (", data,
        ") times 'optimizer.num_minibatches' (", nmb, ") so every worker gets equal minibatches"));
  }
  const int64_t mb = batch / data / nmb;
  const int64_t in = kImageSize, hidden = config.model.hidden_size, classes = config.model.num_classes;
  const bool dropout = config.model.dropout_rate > 0;

  v1::StepProgram program;
  program.set_num_minibatches(nmb);
  program.set_minibatch_size(static_cast<int>(mb));
  program.set_eval_batch_size(kEvalBatchSize);
  Builder b(mesh, &program);

  const std::vector<Dims> param_dims = {{in, hidden}, {hidden}, {hidden, classes}, {classes}};
  for (int i = 0; i < 4; ++i) {
    b.Replicated(absl::StrCat("params/", kParams[i]), param_dims[i], v1::BUFFER_ROLE_PARAM);
    b.Replicated(absl::StrCat("grads/", kParams[i]), param_dims[i], v1::BUFFER_ROLE_GRAD);
    if (config.optimizer.name != "sgd") {
      b.Replicated(absl::StrCat("opt_state/mu/", kParams[i]), param_dims[i], v1::BUFFER_ROLE_OPT_STATE);
      b.Replicated(absl::StrCat("opt_state/nu/", kParams[i]), param_dims[i], v1::BUFFER_ROLE_OPT_STATE);
    }
  }
  b.BatchSharded("batch/inputs", {mb, in}, data, v1::BUFFER_ROLE_INPUT);
  b.BatchSharded("batch/labels", {mb}, data, v1::BUFFER_ROLE_INPUT, v1::DTYPE_I32);
  for (const char* name : {"act/h", "act/a", "act/d", "act/mask", "act/dd", "act/da", "act/dh"}) {
    b.BatchSharded(name, {mb, hidden}, data, v1::BUFFER_ROLE_ACTIVATION);
  }
  b.BatchSharded("act/logits", {mb, classes}, data, v1::BUFFER_ROLE_ACTIVATION);
  b.BatchSharded("act/dlogits", {mb, classes}, data, v1::BUFFER_ROLE_ACTIVATION);
  b.Replicated("metrics/loss_sum", {}, v1::BUFFER_ROLE_METRIC);
  b.Replicated("metrics/correct", {}, v1::BUFFER_ROLE_METRIC);
  b.BatchSharded("eval/inputs", {kEvalBatchSize, in}, data, v1::BUFFER_ROLE_INPUT);
  b.BatchSharded("eval/labels", {kEvalBatchSize}, data, v1::BUFFER_ROLE_INPUT, v1::DTYPE_I32);
  b.BatchSharded("eval/h", {kEvalBatchSize, hidden}, data, v1::BUFFER_ROLE_ACTIVATION);
  b.BatchSharded("eval/a", {kEvalBatchSize, hidden}, data, v1::BUFFER_ROLE_ACTIVATION);
  b.BatchSharded("eval/logits", {kEvalBatchSize, classes}, data, v1::BUFFER_ROLE_ACTIVATION);
  b.Replicated("eval/loss_sum", {}, v1::BUFFER_ROLE_METRIC);
  b.Replicated("eval/correct", {}, v1::BUFFER_ROLE_METRIC);

  // init: lecun_normal kernels, zero biases and optimizer state.
  v1::Function* init = b.Function("init");
  for (int i = 0; i < 4; ++i) {
    const std::string p = absl::StrCat("params/", kParams[i]);
    if (param_dims[i].size() == 2) {
      v1::Op* op = AddOp(init, v1::OP_INIT_TRUNCATED_NORMAL, {}, {p});
      op->set_scale(LecunNormalStddev(param_dims[i][0]));
      op->set_seed_offset(i);
    } else {
      AddOp(init, v1::OP_FILL, {}, {p});
    }
    if (config.optimizer.name != "sgd") {
      AddOp(init, v1::OP_FILL, {}, {absl::StrCat("opt_state/mu/", kParams[i])});
      AddOp(init, v1::OP_FILL, {}, {absl::StrCat("opt_state/nu/", kParams[i])});
    }
  }

  v1::Function* zero = b.Function("zero_grads");
  for (int i = 0; i < 4; ++i) AddOp(zero, v1::OP_FILL, {}, {absl::StrCat("grads/", kParams[i])});
  AddOp(zero, v1::OP_FILL, {}, {"metrics/loss_sum"});
  AddOp(zero, v1::OP_FILL, {}, {"metrics/correct"});

  // microbatch: forward, loss, backward, accumulate the mean over minibatches.
  v1::Function* mbf = b.Function("microbatch");
  AddFeeds(mbf, "batch/inputs", "batch/labels");
  AddOp(mbf, v1::OP_MATMUL, {"batch/inputs", "params/input_dense/kernel", "params/input_dense/bias"}, {"act/h"});
  AddOp(mbf, v1::OP_SILU, {"act/h"}, {"act/a"});
  const std::string hidden_out = dropout ? "act/d" : "act/a";
  if (dropout) {
    v1::Op* op = AddOp(mbf, v1::OP_DROPOUT, {"act/a"}, {"act/d", "act/mask"});
    op->set_rate(static_cast<float>(config.model.dropout_rate));
    op->set_axis_name("data");
  }
  AddOp(mbf, v1::OP_MATMUL, {hidden_out, "params/output_dense/kernel", "params/output_dense/bias"},
        {"act/logits"});
  AddOp(mbf, v1::OP_SOFTMAX_CROSS_ENTROPY, {"act/logits", "batch/labels"},
        {"act/dlogits", "metrics/loss_sum", "metrics/correct"});
  // Backward. Parameter gradients are accumulated straight into grads/* with alpha = 1 / nmb
  // (the mean over minibatches, as the seed's accumulate_gradients), like GEMM's alpha and beta.
  const float mean = 1.0f / nmb;
  auto accumulate = [mean](v1::Op* op) {
    op->set_alpha(mean);
    op->set_accumulate(true);
    return op;
  };
  accumulate(AddOp(mbf, v1::OP_MATMUL, {hidden_out, "act/dlogits"}, {"grads/output_dense/kernel"}))
      ->set_transpose_a(true);
  accumulate(AddOp(mbf, v1::OP_REDUCE_SUM_ROWS, {"act/dlogits"}, {"grads/output_dense/bias"}));
  AddOp(mbf, v1::OP_MATMUL, {"act/dlogits", "params/output_dense/kernel"}, {"act/dd"})->set_transpose_b(true);
  std::string da = "act/dd";
  if (dropout) {
    AddOp(mbf, v1::OP_DROPOUT_GRAD, {"act/dd", "act/mask"}, {"act/da"});
    da = "act/da";
  }
  AddOp(mbf, v1::OP_SILU_GRAD, {"act/h", da}, {"act/dh"});
  accumulate(AddOp(mbf, v1::OP_MATMUL, {"batch/inputs", "act/dh"}, {"grads/input_dense/kernel"}))
      ->set_transpose_a(true);
  accumulate(AddOp(mbf, v1::OP_REDUCE_SUM_ROWS, {"act/dh"}, {"grads/input_dense/bias"}));

  // apply: pmean of the gradients over 'data' (one fused bucket), then the optimizer.
  v1::Function* apply = b.Function("apply");
  std::vector<std::string> grads;
  for (int i = 0; i < 4; ++i) grads.push_back(absl::StrCat("grads/", kParams[i]));
  v1::Op* ar = AddOp(apply, v1::OP_ALL_REDUCE, grads, grads);
  ar->set_axis_name("data");
  ar->set_reduce_op(v1::REDUCE_OP_MEAN);
  for (int i = 0; i < 4; ++i) {
    const std::string p = absl::StrCat("params/", kParams[i]);
    const std::string g = absl::StrCat("grads/", kParams[i]);
    v1::Op* op;
    if (config.optimizer.name == "sgd") {
      op = AddOp(apply, v1::OP_SGD, {p, g}, {p});
    } else {
      const std::string m = absl::StrCat("opt_state/mu/", kParams[i]);
      const std::string v = absl::StrCat("opt_state/nu/", kParams[i]);
      op = AddOp(apply, v1::OP_ADAMW, {p, g, m, v}, {p, m, v});
    }
    v1::AdamWAttrs* a = op->mutable_adamw();
    a->set_learning_rate(static_cast<float>(config.optimizer.learning_rate));
    a->set_b1(static_cast<float>(config.optimizer.b1));
    a->set_b2(static_cast<float>(config.optimizer.b2));
    a->set_eps(static_cast<float>(config.optimizer.eps));
    a->set_weight_decay(config.optimizer.name == "adamw" ? static_cast<float>(config.optimizer.weight_decay)
                                                         : 0.0f);
  }

  // eval: forward only, no dropout.
  v1::Function* eval = b.Function("eval");
  AddFeeds(eval, "eval/inputs", "eval/labels");
  AddOp(eval, v1::OP_FILL, {}, {"eval/loss_sum"});
  AddOp(eval, v1::OP_FILL, {}, {"eval/correct"});
  AddOp(eval, v1::OP_MATMUL, {"eval/inputs", "params/input_dense/kernel", "params/input_dense/bias"}, {"eval/h"});
  AddOp(eval, v1::OP_SILU, {"eval/h"}, {"eval/a"});
  AddOp(eval, v1::OP_MATMUL, {"eval/a", "params/output_dense/kernel", "params/output_dense/bias"}, {"eval/logits"});
  AddOp(eval, v1::OP_SOFTMAX_CROSS_ENTROPY_EVAL, {"eval/logits", "eval/labels"}, {"eval/loss_sum", "eval/correct"});
  return program;
}

std::vector<checkpoint::WantedArray> TrainStateArrays(const v1::StepProgram& program,
                                                      const Mesh& mesh) {
  std::vector<checkpoint::WantedArray> out;
  for (const v1::BufferDecl& b : program.buffers()) {
    if (b.role() != v1::BUFFER_ROLE_PARAM && b.role() != v1::BUFFER_ROLE_OPT_STATE) continue;
    checkpoint::WantedArray a;
    a.name = b.name();
    a.dtype = b.dtype();
    a.spec = PartitionSpec::FromProto(b.sharding().spec());
    a.shape.assign(b.shape().dims().begin(), b.shape().dims().end());
    for (size_t d = 0; d < a.shape.size() && d < a.spec.entries().size(); ++d) {
      for (const std::string& axis : a.spec.entries()[d]) {
        if (absl::StatusOr<int> i = mesh.AxisIndex(axis); i.ok()) a.shape[d] *= mesh.axis_size(*i);
      }
    }
    out.push_back(std::move(a));
  }
  out.push_back({"rng", v1::DTYPE_U32, {2}, PartitionSpec()});
  return out;
}

}  // namespace meshrun
