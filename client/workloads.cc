#include "meshrun/workloads.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/data/dataset.h"
#include "core/random/threefry.h"

namespace meshrun {
namespace {

// jax.random.normal(jax.random.key(seed), dims).
Tensor JaxNormal(uint64_t seed, const Dims& dims) {
  Tensor t(v1::DTYPE_F32, dims);
  const int64_t n = t.num_elements();
  for (int64_t i = 0; i < n; ++i) t.data<float>()[i] = NormalAt(MakePRNGKey(seed), n, i, 1.0f);
  return t;
}

constexpr int64_t kClassifierMinibatch = 32, kClassifierMinibatches = 2;

}  // namespace

std::vector<std::string> SeedWorkloadNames() { return {"mlp", "dot_relu_dot", "classifier"}; }

absl::StatusOr<Workload> SeedWorkload(const std::string& name, const WorkloadOptions& options) {
  const DType dtype = options.dtype;
  if (dtype != v1::DTYPE_F32 && dtype != v1::DTYPE_BF16) {
    return absl::InvalidArgumentError(absl::StrCat("workload '", name, "': compute dtype ",
                                                   DTypeName(dtype), "; expected f32 or bf16"));
  }
  // The model's output in f32 for the loss (a no-op in f32).
  auto f32 = [](JitBuilder& jit, nn::Value v) {
    return jit.dtype(v) == v1::DTYPE_F32 ? v : jit.Convert(v, v1::DTYPE_F32);
  };
  const std::string in_dtype = dtype == v1::DTYPE_BF16 ? ", bf16 compute" : "";
  Workload w;
  w.name = name;
  if (name == "mlp") {
    w.description = absl::StrCat(
        "seed 000: MLP, 4 scan-stacked DotReluDot(1024), batch 8, Adam 1e-3, loss y.sum()",
        in_dtype);
    w.batch = {{"x", {8, 1024}, {"batch", "embed"}}};
    w.loss = [dtype, f32](nn::Scope& s, const std::vector<nn::Value>& b) {
      nn::Value y = nn::Mlp(s.Child("mlp"), b[0], 4, 1024, /*use_scan=*/true, dtype);
      return s.jit().Reduce("sum", f32(s.jit(), y), {0, 1});
    };
    w.examples_per_step = 8;
  } else if (name == "dot_relu_dot") {
    w.description = absl::StrCat("seed 003: DotReluDot(1024), MSE, Adam 1e-3, batch 8", in_dtype);
    w.batch = {{"input", {8, 1024}, {"batch", ""}}, {"label", {8, 1024}, {"batch", ""}}};
    w.loss = [dtype, f32](nn::Scope& s, const std::vector<nn::Value>& b) {
      JitBuilder& jit = s.jit();
      nn::DenseOptions dense;
      dense.use_bias = false;
      dense.dtype = dtype;
      nn::Value y = jit.Unary("relu", nn::Dense(s.Child("dot1"), b[0], 1024, dense));
      y = s.WithLogicalConstraint(y, {"batch", "hidden"});
      nn::Value w2 = s.Param("w2", {1024, 1024}, {"hidden", "embed"}, nn::LecunNormal());
      if (dtype != v1::DTYPE_F32) w2 = jit.Convert(w2, dtype);
      return nn::MseLoss(jit, f32(jit, jit.Dot(y, w2)), b[1]);
    };
    w.examples_per_step = 8;
  } else if (name == "classifier") {
    w.description = absl::StrCat(
        "seed classifier: Dense 784->512, SiLU, Dense 512->10, softmax CE, AdamW, 2 x 32 images",
        in_dtype);
    w.batch = ClassifierBatch(kClassifierMinibatch);
    ClassifierOptions model;
    model.dropout_rate = 0.0f;
    model.dtype = dtype;
    w.loss = ClassifierLoss(model);
    w.optimizer.kind = OptimizerConfig::kAdamW;
    w.num_minibatches = kClassifierMinibatches;
    w.examples_per_step = kClassifierMinibatch * kClassifierMinibatches;
  } else {
    return absl::NotFoundError(
        absl::StrCat("workload '", name, "'; known: ", absl::StrJoin(SeedWorkloadNames(), ", ")));
  }
  return w;
}

absl::StatusOr<std::vector<Tensor>> SeedWorkloadBatch(const Workload& w,
                                                      const std::string& data_dir) {
  if (w.name != "classifier") {
    std::vector<Tensor> out;
    for (size_t i = 0; i < w.batch.size(); ++i) out.push_back(JaxNormal(i + 1, w.batch[i].shape));
    return out;
  }
  absl::StatusOr<std::unique_ptr<Dataset>> data = Dataset::Open("idx", data_dir, "train");
  if (!data.ok()) return data.status();
  const int64_t k = w.num_minibatches, mb = kClassifierMinibatch;
  Tensor images(v1::DTYPE_U8, {k, mb, 784});
  Tensor labels(v1::DTYPE_U8, {k, mb});
  for (int64_t i = 0; i < k * mb; ++i) {
    (*data)->CopyElements(0, i, 0, 784, images.data<uint8_t>() + i * 784);
    (*data)->CopyElements(1, i, 0, 1, labels.data<uint8_t>() + i);
  }
  std::vector<Tensor> out;
  out.push_back(std::move(images));
  out.push_back(std::move(labels));
  return out;
}

std::vector<BatchSpec> ClassifierBatch(int64_t minibatch, int64_t image_size) {
  return {{"image", {minibatch, image_size}, {"batch", ""}, v1::DTYPE_U8},
          {"label", {minibatch}, {"batch"}, v1::DTYPE_U8}};
}

LossFn ClassifierLoss(const ClassifierOptions& options) {
  return [options](nn::Scope& s, const std::vector<nn::Value>& b) {
    JitBuilder& jit = s.jit();
    nn::Value x = jit.Scale(jit.Convert(b[0], v1::DTYPE_F32), 1.0f / 255.0f);
    nn::DenseOptions in;
    in.dtype = options.dtype;
    nn::Value h = jit.Unary("silu", nn::Dense(s.Child("input_dense"), x, options.hidden_size, in));
    h = nn::Dropout(s, h, options.dropout_rate);
    nn::DenseOptions out;
    out.kernel_axes = {"hidden", "classes"};
    out.dtype = options.dtype;
    nn::Value logits = nn::Dense(s.Child("output_dense"), h, options.num_classes, out);
    if (jit.dtype(logits) != v1::DTYPE_F32) logits = jit.Convert(logits, v1::DTYPE_F32);
    s.Sow("correct", nn::CorrectCount(jit, logits, b[1]));
    return nn::SoftmaxCrossEntropyWithIntegerLabels(jit, logits, b[1]);
  };
}

std::vector<std::string> LayoutNames() { return {"single", "dp", "fsdp", "tp", "2d", "fsdp_tp"}; }

absl::StatusOr<nn::ShardingConfig> LayoutSharding(const std::string& layout) {
  std::string rules, fsdp;
  if (layout == "single") {
  } else if (layout == "dp") {
    rules = "batch=data";
  } else if (layout == "fsdp") {
    rules = "batch=data";
    fsdp = "data";
  } else if (layout == "tp") {
    rules = "hidden=model";
  } else if (layout == "2d") {
    rules = "batch=data,hidden=model";
  } else if (layout == "fsdp_tp") {
    rules = "batch=data,hidden=model";
    fsdp = "data";
  } else {
    return absl::NotFoundError(
        absl::StrCat("layout '", layout, "'; known: ", absl::StrJoin(LayoutNames(), ", ")));
  }
  nn::ShardingConfig s;
  absl::StatusOr<LogicalAxisRules> r = ParseLogicalAxisRules(rules);
  if (!r.ok()) return r.status();
  s.rules = *r;
  s.fsdp_axis = fsdp;
  return s;
}

}  // namespace meshrun
