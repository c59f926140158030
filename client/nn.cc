#include "meshrun/nn.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/random/threefry.h"
#include "core/sharding/named_sharding.h"

namespace meshrun::nn {

absl::StatusOr<Draw> ResolveInitializer(const Initializer& init, const Dims& shape,
                                        int batch_dims) {
  switch (init.kind) {
    case Initializer::kZeros:
      return Draw{"zeros", 0};
    case Initializer::kOnes:
      return Draw{"ones", 0};
    case Initializer::kNormal:
      return Draw{"normal", init.stddev};
    case Initializer::kLecunNormal:
    case Initializer::kXavierNormal:
      break;
  }
  if (static_cast<int>(shape.size()) < batch_dims + 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("variance-scaling initializer on shape (", absl::StrJoin(shape, ", "),
                     ") with ", batch_dims, " batch dims: expected at least ", batch_dims + 2,
                     " dims (fans are the last two)"));
  }
  const double fan_in = static_cast<double>(shape[shape.size() - 2]);
  const double fan_out = static_cast<double>(shape.back());
  if (init.kind == Initializer::kLecunNormal) {
    return Draw{"truncated_normal",
                static_cast<float>(std::sqrt(1.0 / fan_in) / 0.87962566103423978)};
  }
  return Draw{"normal", static_cast<float>(std::sqrt(2.0 / (fan_in + fan_out)))};
}

std::array<uint32_t, 2> ParamKey(uint64_t seed, const std::string& name) {
  uint32_t h = 2166136261u;  // FNV-1a, 32 bits
  for (unsigned char c : name) h = (h ^ c) * 16777619u;
  return FoldIn(MakePRNGKey(seed), h);
}

Scope::Scope(JitBuilder& jit, ShardingConfig sharding)
    : shared_(std::make_shared<Shared>()), path_("params") {
  shared_->jit = &jit;
  shared_->sharding = std::move(sharding);
  if (absl::Status s = ValidateLogicalAxisRules(shared_->sharding.rules, jit.mesh()); !s.ok()) {
    shared_->status = s;
  }
  if (!shared_->sharding.fsdp_axis.empty() &&
      !jit.mesh().AxisIndex(shared_->sharding.fsdp_axis).ok()) {
    shared_->status = absl::InvalidArgumentError(
        absl::StrCat("fsdp axis '", shared_->sharding.fsdp_axis, "' is not an axis of the mesh ",
                     jit.mesh().ToString()));
  }
}

Scope::Scope(JitBuilder& jit, ShardingConfig sharding, const std::vector<ParamInfo>& declared)
    : Scope(jit, std::move(sharding)) {
  shared_->predeclared = true;
  for (const ParamInfo& p : declared) {
    shared_->index[p.name] = static_cast<int>(shared_->params.size());
    shared_->params.push_back(p);
    shared_->values.push_back(jit.Input(v1::DTYPE_F32, p.shape, p.spec));
  }
}

Scope Scope::Child(const std::string& name) const {
  return Scope(shared_, absl::StrCat(path_, "/", name));
}

absl::StatusOr<PartitionSpec> Scope::LogicalSpec(
    const std::vector<std::string>& logical_axes) const {
  return LogicalToMesh(logical_axes, shared_->sharding.rules);
}

Value Scope::Param(const std::string& name, const Dims& shape,
                   const std::vector<std::string>& logical_axes, Initializer init, int batch_dims) {
  Shared& s = *shared_;
  if (!status().ok()) return {};
  const std::string full = absl::StrCat(path_, "/", name);
  auto it = s.index.find(full);
  if (it != s.index.end()) {
    if (s.params[it->second].shape != shape) {
      s.status =
          absl::InvalidArgumentError(absl::StrCat("parameter ", full, " is used with shapes (",
                                                  absl::StrJoin(s.params[it->second].shape, ", "),
                                                  ") and (", absl::StrJoin(shape, ", "), ")"));
      return {};
    }
    return s.values[it->second];
  }
  if (s.predeclared) {
    s.status = absl::InvalidArgumentError(
        absl::StrCat("parameter ", full, " was not declared by the first trace"));
    return {};
  }
  if (logical_axes.size() != shape.size()) {
    s.status = absl::InvalidArgumentError(
        absl::StrCat("parameter ", full, ": ", logical_axes.size(), " logical axes for a rank-",
                     shape.size(), " shape (", absl::StrJoin(shape, ", "), ")"));
    return {};
  }
  ParamInfo p{full, shape, logical_axes, PartitionSpec(), init, batch_dims, ""};
  absl::StatusOr<PartitionSpec> spec = LogicalToMesh(logical_axes, s.sharding.rules);
  if (!spec.ok()) {
    s.status =
        absl::InvalidArgumentError(absl::StrCat("parameter ", full, ": ", spec.status().message()));
    return {};
  }
  p.spec = *spec;
  if (!s.sharding.fsdp_axis.empty()) {
    absl::StatusOr<FsdpLayout> fsdp =
        FsdpShard(shape, p.spec, s.jit->mesh(), s.sharding.fsdp_axis, s.sharding.min_weight_size);
    if (!fsdp.ok()) {
      s.status = absl::InvalidArgumentError(
          absl::StrCat("parameter ", full, ": ", fsdp.status().message()));
      return {};
    }
    p.spec = fsdp->spec;
    p.fsdp_note = fsdp->reason;
  }
  if (absl::Status fits = NamedSharding(s.jit->mesh(), p.spec).Validate(shape); !fits.ok()) {
    s.status = absl::InvalidArgumentError(absl::StrCat("parameter ", full, " (logical axes (",
                                                       absl::StrJoin(logical_axes, ", "),
                                                       ")): ", fits.message()));
    return {};
  }
  if (absl::StatusOr<Draw> d = ResolveInitializer(init, shape, batch_dims); !d.ok()) {
    s.status =
        absl::InvalidArgumentError(absl::StrCat("parameter ", full, ": ", d.status().message()));
    return {};
  }
  s.index[full] = static_cast<int>(s.params.size());
  s.params.push_back(p);
  s.values.push_back(s.jit->Input(v1::DTYPE_F32, shape, p.spec));
  return s.values.back();
}

Value Scope::WithLogicalConstraint(Value x, const std::vector<std::string>& logical_axes) {
  if (!shared_->status.ok()) return {};
  absl::StatusOr<PartitionSpec> spec = LogicalSpec(logical_axes);
  if (!spec.ok()) {
    shared_->status = absl::InvalidArgumentError(
        absl::StrCat(path_, ": with_logical_constraint: ", spec.status().message()));
    return {};
  }
  return jit().WithShardingConstraint(x, *spec);
}

Value Scope::MakeRng() {
  if (shared_->rng.id < 0) {
    if (shared_->status.ok())
      shared_->status =
          absl::FailedPreconditionError(absl::StrCat(path_, ": make_rng without a key"));
    return {};
  }
  JitBuilder& j = jit();
  return j.FoldIn(shared_->rng, j.Constant(static_cast<float>(shared_->rng_count++), {}));
}

std::vector<std::string> Scope::BatchAxes() const {
  absl::StatusOr<PartitionSpec> spec = LogicalToMesh({"batch"}, shared_->sharding.rules);
  return spec.ok() ? spec->entry(0) : std::vector<std::string>{};
}

void Scope::Sow(const std::string& name, Value value) {
  if (!jit().shape(value).empty() && shared_->status.ok()) {
    shared_->status = absl::InvalidArgumentError(
        absl::StrCat(path_, ": sown metric '", name, "' has shape ",
                     DimsToString(jit().shape(value)), "; a metric is a scalar"));
    return;
  }
  shared_->sown.emplace_back(name, value);
}

std::vector<std::pair<std::string, Value>> Scope::TakeSown() {
  std::vector<std::pair<std::string, Value>> out;
  out.swap(shared_->sown);
  return out;
}

Value Dropout(Scope& scope, Value x, float rate, bool deterministic) {
  if (deterministic || scope.deterministic() || rate == 0.0f) return x;
  return scope.jit().Dropout(x, scope.MakeRng(), rate, scope.BatchAxes());
}

Value Dense(Scope scope, Value x, int64_t features, const DenseOptions& options) {
  JitBuilder& jit = scope.jit();
  const Dims in = jit.shape(x);
  const int64_t rank = static_cast<int64_t>(in.size());  // rank 0: dot_general names the error
  Value kernel = scope.Param("kernel", {rank ? in.back() : 0, features}, options.kernel_axes,
                             options.kernel_init);
  // flax's promote_dtype(x, kernel, bias, dtype=self.dtype).
  auto cast = [&](Value v) {
    return jit.dtype(v) == options.dtype ? v : jit.Convert(v, options.dtype);
  };
  Value y = jit.DotGeneral(cast(x), cast(kernel), {rank - 1}, {0});
  if (!options.use_bias) return y;
  Value bias = cast(scope.Param("bias", {features}, {options.kernel_axes.back()}, Zeros()));
  // In bf16 the sum is taken in f32 and rounded once (nn.h): the GEMM writes its f32
  // accumulator (FoldConvertIntoMatmul takes this convert into it).
  const bool narrow = jit.dtype(y) != v1::DTYPE_F32;
  if (narrow) {
    y = jit.Convert(y, v1::DTYPE_F32);
    bias = jit.Convert(bias, v1::DTYPE_F32);
  }
  const Dims out = jit.shape(y);
  Value sum = jit.Add(
      y, jit.BroadcastInDim(bias, out, {static_cast<int64_t>(out.size()) - 1}, jit.sharding(y)));
  return narrow ? jit.Convert(sum, options.dtype) : sum;
}

namespace {

// One DotReluDot block on given W1, W2 (unrolled or a scanned layer), computed in `dtype`.
Value DotReluDotBody(Scope& scope, Value x, Value w1, Value w2, DType dtype) {
  JitBuilder& jit = scope.jit();
  auto cast = [&](Value v) { return jit.dtype(v) == dtype ? v : jit.Convert(v, dtype); };
  Value y = scope.WithLogicalConstraint(jit.Unary("relu", jit.Dot(cast(x), cast(w1))),
                                        {"batch", "hidden"});
  return scope.WithLogicalConstraint(jit.Dot(y, cast(w2)), {"batch", "embed"});
}

}  // namespace

Value DotReluDot(Scope scope, Value x, int64_t depth, DType dtype) {
  const Dims in = scope.jit().shape(x);
  const int64_t features = in.empty() ? 0 : in.back();
  Value w1 = scope.Param("W1", {features, depth}, {"embed", "hidden"}, XavierNormal());
  Value w2 = scope.Param("W2", {depth, features}, {"hidden", "embed"}, XavierNormal());
  return DotReluDotBody(scope, x, w1, w2, dtype);
}

Value Mlp(Scope scope, Value x, int num_layers, int64_t depth, bool use_scan, DType dtype) {
  if (!use_scan) {
    for (int i = 0; i < num_layers; ++i)
      x = DotReluDot(scope.Child(absl::StrCat("layers_", i)), x, depth, dtype);
    return x;
  }
  JitBuilder& jit = scope.jit();
  const Dims in = jit.shape(x);
  const int64_t features = in.empty() ? 0 : in.back();
  Scope layers = scope.Child("ScanDotReluDot_0");
  Value w1 = layers.Param("W1", {num_layers, features, depth}, {"layer", "embed", "hidden"},
                          XavierNormal(), 1);
  Value w2 = layers.Param("W2", {num_layers, depth, features}, {"layer", "hidden", "embed"},
                          XavierNormal(), 1);
  for (int i = 0; i < num_layers; ++i)
    x = DotReluDotBody(layers, x, jit.Index(w1, i), jit.Index(w2, i), dtype);
  return x;
}

Value MseLoss(JitBuilder& jit, Value pred, Value target) {
  Value d = jit.Sub(pred, target);
  const int64_t rank = static_cast<int64_t>(jit.shape(pred).size());
  std::vector<int64_t> all(rank);
  for (int64_t i = 0; i < rank; ++i) all[i] = i;
  return jit.Reduce("mean", jit.Mul(d, d), all);
}

Value SoftmaxCrossEntropy(JitBuilder& jit, Value logits, Value one_hot) {
  const Dims dims = jit.shape(logits);  // [b, c]; another rank fails in broadcast_in_dim
  const PartitionSpec spec = jit.sharding(logits);
  Value m = jit.StopGradient(jit.Reduce("max", logits, {1}));
  Value shifted = jit.Sub(logits, jit.BroadcastInDim(m, dims, {0}, spec));
  Value lse = jit.Add(jit.Unary("log", jit.Reduce("sum", jit.Unary("exp", shifted), {1})), m);
  Value picked = jit.Reduce("sum", jit.Mul(one_hot, logits), {1});
  return jit.Reduce("mean", jit.Sub(lse, picked), {0});
}

Value OneHot(JitBuilder& jit, Value labels, int64_t num_classes) {
  const Dims b = jit.shape(labels);  // [b]; another rank fails in broadcast_in_dim
  const int64_t rows = b.empty() ? 0 : b[0];
  std::vector<PartitionSpec::Entry> e = jit.sharding(labels).Padded(1);
  e.resize(1);
  e.push_back({});
  const PartitionSpec spec(e);
  Value l = jit.Convert(labels, v1::DTYPE_F32);
  Value wide = jit.BroadcastInDim(l, {rows, num_classes}, {0}, spec);
  return jit.Binary("eq", wide, jit.Iota(v1::DTYPE_F32, {rows, num_classes}, 1, spec));
}

Value SoftmaxCrossEntropyWithIntegerLabels(JitBuilder& jit, Value logits, Value labels) {
  return jit.Reduce("mean", jit.SoftmaxCrossEntropyWithIntegerLabels(logits, labels), {0});
}

Value CorrectCount(JitBuilder& jit, Value logits, Value labels) {
  const Dims dims = jit.shape(logits);
  const PartitionSpec spec = jit.sharding(logits);
  Value m = jit.StopGradient(jit.Reduce("max", logits, {1}));
  Value is_max = jit.Binary("eq", logits, jit.BroadcastInDim(m, dims, {0}, spec));
  Value hit = jit.Mul(is_max, OneHot(jit, labels, dims.size() == 2 ? dims[1] : 0));
  return jit.Reduce("sum", hit, {0, 1});
}

}  // namespace meshrun::nn
