#include "core/spmd/jit.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/sharding/named_sharding.h"

namespace meshrun {
namespace {

bool IsFloat(DType d) { return d == v1::DTYPE_F32 || d == v1::DTYPE_BF16; }

std::vector<int> ToInt(const std::vector<int64_t>& v) {
  return std::vector<int>(v.begin(), v.end());
}

}  // namespace

std::vector<int64_t> JitBuilder::FreeDims(size_t rank, const std::vector<int>& contracting,
                                          const std::vector<int>& batch) {
  std::vector<int64_t> out;
  for (size_t d = 0; d < rank; ++d) {
    const auto in = [&](const std::vector<int>& v) {
      return std::find(v.begin(), v.end(), static_cast<int>(d)) != v.end();
    };
    if (!in(contracting) && !in(batch)) out.push_back(static_cast<int64_t>(d));
  }
  return out;
}

std::string JitBuilder::Collective::Short() const {
  return absl::StrCat(op, "(", absl::StrJoin(axes, ","), ")",
                      dim >= 0 ? absl::StrCat("@", dim) : "");
}

JitBuilder::Scope::Scope(JitBuilder* b, v1::GlobalOp::Kind kind) : b_(b) {
  if (b_->depth_++ == 0) {
    op = b_->global_.add_ops();
    op->set_kind(kind);
  }
}

JitBuilder::Scope& JitBuilder::Scope::Operands(std::initializer_list<Value> values) {
  return Operands(std::vector<Value>(values));
}

JitBuilder::Scope& JitBuilder::Scope::Operands(const std::vector<Value>& values) {
  if (op != nullptr)
    for (Value v : values) op->add_operands(v.id);
  return *this;
}

bool JitBuilder::Check(bool ok, const std::string& message) {
  if (!ok && status_.ok()) status_ = absl::InvalidArgumentError(message);
  return ok && status_.ok();
}

JitBuilder::Value JitBuilder::Push(State s, Node node) {
  s.node = std::move(node);
  values_.push_back(std::move(s));
  return {static_cast<int>(values_.size()) - 1};
}

JitBuilder::State JitBuilder::ApplyReshards(State s, const std::vector<spmd::Reshard>& reshards,
                                            const std::string& reason) {
  for (const spmd::Reshard& r : reshards) {
    std::vector<PartitionSpec::Entry> entries = s.spec.Padded(s.global.size());
    if (r.kind == spmd::Reshard::kSlice) {
      entries[r.dim] = r.axes;
      const int64_t size = NamedSharding(mesh_, PartitionSpec(entries)).ShardDims(s.global)[r.dim];
      s.local = sm_.DynamicSliceInDim(s.local, sm_.AxisIndex(r.axes), size, r.dim);
    } else {
      collectives_.push_back({"all_gather", r.axes, r.dim,
                              spmd::ReshardBytesPerDevice(r, s.global, s.spec, mesh_,
                                                          static_cast<int>(DTypeSize(s.dtype))),
                              reason});
      s.local = sm_.AllGather(s.local, r.axes, r.dim, /*tiled=*/true);
      entries[r.dim].clear();
    }
    s.spec = PartitionSpec(std::move(entries));
  }
  return s;
}

JitBuilder::State JitBuilder::Resolve(const State& in, const PartitionSpec& target,
                                      const std::string& reason) {
  if (!in.partial.empty() && target == in.spec) return Complete(in, reason);
  return Reduce(in, target, reason);
}

JitBuilder::State JitBuilder::Complete(const State& in, const std::string& reason) {
  if (in.partial.empty()) return Reduce(in, in.spec, reason);
  if (in.scaled != nullptr && in.scaled->local_id == in.local.id) {
    State s = Complete(in.scaled->base, reason);
    for (const Scaled::Step& k : in.scaled->steps) {
      s.local = k.scalar_first ? sm_.Binary(k.fn, k.scalar, s.local)
                               : sm_.Binary(k.fn, s.local, k.scalar);
    }
    State out = in;
    out.local = s.local;
    out.spec = s.spec;
    out.partial.clear();
    out.scaled = nullptr;
    return out;
  }
  const std::string key = absl::StrCat(in.local.id, "|", absl::StrJoin(in.partial, ","), "|",
                                       in.partial_fn, "|", in.spec.ToString());
  auto it = completed_.find(key);
  if (it == completed_.end()) it = completed_.emplace(key, Reduce(in, in.spec, reason)).first;
  State out = in;
  out.local = it->second.local;
  out.spec = it->second.spec;
  out.partial.clear();
  out.scaled = nullptr;
  return out;
}

JitBuilder::State JitBuilder::Reduce(const State& in, const PartitionSpec& target,
                                     const std::string& reason) {
  State s = in;
  s.scaled = nullptr;
  if (!s.partial.empty() && s.partial_fn != "sum") {
    // mean / max of per-device results: pmean / pmax (an all-reduce, as psum), then reshard.
    const int64_t bytes =
        spmd::ReductionBytesPerDevice({spmd::Reduction::kPsum, s.partial}, s.global, s.spec, mesh_,
                                      static_cast<int>(DTypeSize(s.dtype)));
    collectives_.push_back(
        {s.partial_fn == "mean" ? "pmean" : "pmax", s.partial, -1, bytes, reason});
    s.local = s.partial_fn == "mean" ? sm_.Pmean(s.local, s.partial) : sm_.Pmax(s.local, s.partial);
    s.partial.clear();
  }
  absl::StatusOr<spmd::PartialSumPlan> plan =
      spmd::PlanPartialSum(s.global, s.spec, s.partial, target, mesh_);
  if (!Check(plan.ok(), absl::StrCat(reason, ": ", plan.status().message()))) return s;
  for (const spmd::Reduction& r : plan->reductions) {
    const int64_t bytes = spmd::ReductionBytesPerDevice(r, s.global, s.spec, mesh_,
                                                        static_cast<int>(DTypeSize(s.dtype)));
    std::vector<PartitionSpec::Entry> entries = s.spec.Padded(s.global.size());
    if (r.kind == spmd::Reduction::kPsum) {
      collectives_.push_back({"psum", r.axes, -1, bytes, reason});
      s.local = sm_.Psum(s.local, r.axes);
    } else {
      collectives_.push_back({"psum_scatter", r.axes, r.dim, bytes, reason});
      s.local = sm_.PsumScatter(s.local, r.axes, r.dim, /*tiled=*/true);
      entries[r.dim] = r.axes;
    }
    s.spec = PartitionSpec(std::move(entries));
  }
  s.partial.clear();
  return ApplyReshards(std::move(s), plan->reshards, reason);
}

JitBuilder::Value JitBuilder::Input(DType dtype, const Dims& global_dims,
                                    const PartitionSpec& in_spec) {
  Scope rec(this, v1::GlobalOp::INPUT);
  if (rec.op != nullptr) {
    rec.op->set_dtype(dtype);
    for (int64_t d : global_dims) rec.op->add_shape(d);
    *rec.op->mutable_spec() = in_spec.ToProto();
  }
  if (!status_.ok()) return {};
  absl::Status fits = NamedSharding(mesh_, in_spec).Validate(global_dims);
  if (!Check(fits.ok(), absl::StrCat("input ", values_.size(), ": ", fits.message()))) return {};
  State s;
  s.local = sm_.Input(dtype, global_dims, in_spec);
  s.dtype = dtype;
  s.global = global_dims;
  s.spec = in_spec;
  return Push(std::move(s), Node());
}

void JitBuilder::Output(Value v, const PartitionSpec& out_spec) {
  Scope rec(this, v1::GlobalOp::OUTPUT);
  rec.Operands({v});
  if (rec.op != nullptr) *rec.op->mutable_spec() = out_spec.ToProto();
  if (!Valid(v)) return;
  State s = Resolve(values_[v.id], out_spec, absl::StrCat("output ", out_spec.ToString()));
  sm_.Output(s.local, out_spec);
}

JitBuilder::Value JitBuilder::WithShardingConstraint(Value v, const PartitionSpec& spec) {
  Scope rec(this, v1::GlobalOp::CONSTRAINT);
  rec.Operands({v});
  if (rec.op != nullptr) *rec.op->mutable_spec() = spec.ToProto();
  if (!Valid(v)) return {};
  Node node(Node::kConstraint, {v.id});
  node.spec = spec;
  return Push(
      Resolve(values_[v.id], spec, absl::StrCat("with_sharding_constraint ", spec.ToString())),
      std::move(node));
}

JitBuilder::Value JitBuilder::Unary(const std::string& fn, Value x) {
  Scope rec(this, v1::GlobalOp::UNARY);
  rec.Operands({x});
  if (rec.op != nullptr) rec.op->set_fn(fn);
  if (!Valid(x)) return {};
  State s = Complete(values_[x.id], fn);
  s.local = sm_.Unary(fn, s.local);
  return Push(std::move(s), Node(Node::kUnary, {x.id}, fn));
}

JitBuilder::Value JitBuilder::Binary(const std::string& fn, Value a, Value b) {
  Scope rec(this, v1::GlobalOp::BINARY);
  rec.Operands({a, b});
  if (rec.op != nullptr) rec.op->set_fn(fn);
  if (!Valid(a) || !Valid(b)) return {};
  const State& sa = values_[a.id];
  const State& sb = values_[b.id];
  const bool scalar = sa.global.empty() || sb.global.empty();
  if (!Check(scalar || sa.global == sb.global,
             absl::StrCat(fn, ": operand shapes (", absl::StrJoin(sa.global, ", "), ") and (",
                          absl::StrJoin(sb.global, ", "), ") differ"))) {
    return {};
  }
  // Comparisons give 1 or 0 (f32) and pass no gradient back; nor do integer ops or nextafter.
  const bool constant = fn == "eq" || fn == "ne" || fn == "lt" || fn == "le" || fn == "gt" ||
                        fn == "ge" || fn == "nextafter" || !IsFloat(sa.dtype);
  Node node = constant ? Node(Node::kConstant) : Node(Node::kBinary, {a.id, b.id}, fn);
  const bool linear_partial = sa.partial_fn == "sum" || sa.partial_fn == "mean";
  if ((fn == "add" || fn == "sub") && !sa.partial.empty() && sa.partial == sb.partial &&
      linear_partial && sa.partial_fn == sb.partial_fn && sa.spec == sb.spec) {
    // Sums of partial sums (or means) stay partial (one psum later, not two now): accumulated
    // gradients and losses.
    State out = sa;
    out.local = sm_.Binary(fn, sa.local, sb.local);
    out.scaled = nullptr;
    return Push(std::move(out), std::move(node));
  }
  if (scalar && (fn == "mul" || fn == "div")) {
    // Scaling is linear: a partial sum (or mean) times a complete scalar stays partial, so an
    // averaged gradient is still reduce-scattered into an FSDP layout rather than all-reduced,
    // and a loss scaled by 1/k is reduced once, not per minibatch.
    const auto linear = [](const State& v) {
      return !v.partial.empty() && (v.partial_fn == "sum" || v.partial_fn == "mean");
    };
    const bool a_partial = linear(sa) && sb.partial.empty() && sb.global.empty();
    const bool b_partial = fn == "mul" && linear(sb) && sa.partial.empty() && sa.global.empty();
    if (a_partial || b_partial) {
      const State& x = a_partial ? sa : sb;
      State out = x;
      out.local = sm_.Binary(fn, sa.local, sb.local);
      auto scaled = std::make_shared<Scaled>();
      scaled->local_id = out.local.id;
      const bool chained = x.scaled != nullptr && x.scaled->local_id == x.local.id;
      scaled->base = chained ? x.scaled->base : x;
      if (chained) scaled->steps = x.scaled->steps;
      scaled->steps.push_back({fn, a_partial ? sb.local : sa.local, /*scalar_first=*/b_partial});
      out.scaled = std::move(scaled);
      return Push(std::move(out), std::move(node));
    }
  }
  State l = Complete(sa, fn);
  State r = Complete(sb, fn);
  if (scalar) {
    // A scalar is replicated: every device combines it with its own block.
    State out = l.global.empty() ? r : l;
    out.local = sm_.Binary(fn, l.local, r.local);
    return Push(std::move(out), std::move(node));
  }
  // The result follows the lhs's layout, or the rhs's when only the rhs is sharded (as sharding
  // propagation would: slicing a replicated operand is free, gathering a sharded one is not).
  const bool follow_rhs =
      l.spec.Padded(l.global.size()) == PartitionSpec().Padded(l.global.size()) &&
      r.spec.Padded(r.global.size()) != PartitionSpec().Padded(r.global.size());
  State& lead = follow_rhs ? r : l;
  State& other = follow_rhs ? l : r;
  absl::StatusOr<spmd::OpPlan> plan =
      spmd::PlanElementwise(lead.global, lead.spec, other.spec, mesh_);
  if (!Check(plan.ok(), absl::StrCat(fn, ": ", plan.status().message()))) return {};
  other = ApplyReshards(std::move(other), plan->reshards, fn);
  State out = lead;
  out.local = sm_.Binary(fn, l.local, r.local);
  return Push(std::move(out), std::move(node));
}

JitBuilder::Value JitBuilder::Select(Value pred, Value on_false, Value on_true) {
  Scope rec(this, v1::GlobalOp::SELECT);
  rec.Operands({pred, on_false, on_true});
  if (!Valid(pred) || !Valid(on_false) || !Valid(on_true)) return {};
  std::vector<State> s;
  Dims shape;
  for (Value v : {pred, on_false, on_true}) {
    s.push_back(Complete(values_[v.id], "select"));
    if (!s.back().global.empty()) shape = s.back().global;
  }
  for (const State& x : s) {
    if (!Check(x.global.empty() || x.global == shape,
               absl::StrCat("select: operand shapes (", absl::StrJoin(x.global, ", "), ") and (",
                            absl::StrJoin(shape, ", "), ") differ"))) {
      return {};
    }
  }
  // The first sharded operand of the full shape leads; the others are resharded to it.
  const auto sharded = [&](const State& x) {
    for (const PartitionSpec::Entry& e : x.spec.Padded(shape.size()))
      if (!e.empty()) return true;
    return false;
  };
  int lead = -1;
  for (int i = 0; i < 3; ++i) {
    if (s[i].global.empty()) continue;
    if (lead < 0) lead = i;
    if (sharded(s[i])) {
      lead = i;
      break;
    }
  }
  if (lead >= 0) {
    for (int i = 0; i < 3; ++i) {
      if (i == lead || s[i].global.empty()) continue;
      absl::StatusOr<spmd::OpPlan> plan =
          spmd::PlanElementwise(shape, s[lead].spec, s[i].spec, mesh_);
      if (!Check(plan.ok(), absl::StrCat("select: ", plan.status().message()))) return {};
      s[i] = ApplyReshards(std::move(s[i]), plan->reshards, "select");
    }
  }
  State out = lead >= 0 ? s[lead] : s[1];
  out.local = sm_.Select(s[0].local, s[1].local, s[2].local);
  out.dtype = s[1].dtype;
  out.global = shape;
  out.partial.clear();
  return Push(std::move(out), Node(Node::kSelect, {pred.id, on_false.id, on_true.id}));
}

JitBuilder::Value JitBuilder::DotGeneral(Value a, Value b,
                                         const std::vector<int64_t>& lhs_contracting,
                                         const std::vector<int64_t>& rhs_contracting,
                                         const std::vector<int64_t>& lhs_batch,
                                         const std::vector<int64_t>& rhs_batch) {
  Scope rec(this, v1::GlobalOp::DOT_GENERAL);
  rec.Operands({a, b});
  if (rec.op != nullptr) {
    for (int64_t d : lhs_contracting) rec.op->add_lhs_contracting(d);
    for (int64_t d : rhs_contracting) rec.op->add_rhs_contracting(d);
    for (int64_t d : lhs_batch) rec.op->add_lhs_batch(d);
    for (int64_t d : rhs_batch) rec.op->add_rhs_batch(d);
  }
  if (!Valid(a) || !Valid(b)) return {};
  State l = Complete(values_[a.id], "dot_general");
  State r = Complete(values_[b.id], "dot_general");
  const spmd::DotDimensionNumbers dn{ToInt(lhs_contracting), ToInt(rhs_contracting),
                                     ToInt(lhs_batch), ToInt(rhs_batch)};
  absl::StatusOr<spmd::OpPlan> plan =
      spmd::PlanDotGeneral(l.global, l.spec, r.global, r.spec, dn, mesh_);
  if (!Check(plan.ok(), absl::StrCat("dot_general: ", plan.status().message()))) return {};
  std::vector<spmd::Reshard> lhs_reshards, rhs_reshards;
  for (const spmd::Reshard& rs : plan->reshards)
    (rs.operand == 0 ? lhs_reshards : rhs_reshards).push_back(rs);
  l = ApplyReshards(std::move(l), lhs_reshards, "dot_general lhs");
  r = ApplyReshards(std::move(r), rhs_reshards, "dot_general rhs");
  State out;
  out.local =
      sm_.DotGeneral(l.local, r.local, lhs_contracting, rhs_contracting, lhs_batch, rhs_batch);
  out.dtype = l.dtype;
  for (size_t i = 0; i < lhs_batch.size(); ++i) out.global.push_back(l.global[lhs_batch[i]]);
  for (int64_t d : FreeDims(l.global.size(), dn.lhs_contracting, dn.lhs_batch))
    out.global.push_back(l.global[d]);
  for (int64_t d : FreeDims(r.global.size(), dn.rhs_contracting, dn.rhs_batch))
    out.global.push_back(r.global[d]);
  out.spec = plan->result;
  out.partial = plan->partial_sum_axes;
  out.partial_fn = "sum";
  Node node(Node::kDot, {a.id, b.id});
  node.dnums = dn;
  return Push(std::move(out), std::move(node));
}

JitBuilder::Value JitBuilder::Reduce(const std::string& fn, Value x,
                                     const std::vector<int64_t>& dims) {
  Scope rec(this, v1::GlobalOp::REDUCE);
  rec.Operands({x});
  if (rec.op != nullptr) {
    rec.op->set_fn(fn);
    for (int64_t d : dims) rec.op->add_dims(d);
  }
  if (!Valid(x)) return {};
  if (!Check(fn == "sum" || fn == "mean" || fn == "max",
             absl::StrCat("reduce: fn '", fn, "' is not one of sum, mean, max"))) {
    return {};
  }
  State s = Complete(values_[x.id], fn);
  absl::StatusOr<spmd::OpPlan> plan = spmd::PlanReduce(s.global, s.spec, ToInt(dims), mesh_);
  if (!Check(plan.ok(), absl::StrCat("reduce: ", plan.status().message()))) return {};
  State out;
  out.local = sm_.Reduce(fn, s.local, dims);
  out.dtype = s.dtype;
  for (size_t d = 0; d < s.global.size(); ++d) {
    if (std::find(dims.begin(), dims.end(), static_cast<int64_t>(d)) == dims.end())
      out.global.push_back(s.global[d]);
  }
  out.spec = plan->result;
  out.partial = plan->partial_sum_axes;
  out.partial_fn = fn;
  Node node(Node::kReduce, {x.id}, fn);
  node.dims = dims;
  return Push(std::move(out), std::move(node));
}

namespace {

// logits' layout with the class dim whole, and its batch dim's entry alone (the rows' layout).
std::pair<PartitionSpec, PartitionSpec> RowLayouts(const PartitionSpec& logits) {
  std::vector<PartitionSpec::Entry> e = logits.Padded(2);
  return {PartitionSpec({e[0], {}}), PartitionSpec({e[0]})};
}

}  // namespace

JitBuilder::Value JitBuilder::SoftmaxCrossEntropyWithIntegerLabels(Value logits, Value labels) {
  Scope rec(this, v1::GlobalOp::SOFTMAX_CROSS_ENTROPY);
  rec.Operands({logits, labels});
  if (!Valid(logits) || !Valid(labels)) return {};
  const Dims& d = values_[logits.id].global;
  if (!Check(d.size() == 2 && values_[labels.id].global == Dims{d[0]},
             absl::StrCat("softmax_cross_entropy: logits [", absl::StrJoin(d, ", "),
                          "] and labels [", absl::StrJoin(values_[labels.id].global, ", "),
                          "]; expected [b, c] and [b]"))) {
    return {};
  }
  const auto [whole, rows] = RowLayouts(values_[logits.id].spec);
  const State l = Resolve(values_[logits.id], whole, "softmax_cross_entropy");
  const State y = Resolve(values_[labels.id], rows, "softmax_cross_entropy labels");
  State out;
  out.dtype = v1::DTYPE_F32;
  out.global = {d[0]};
  out.spec = rows;
  out.local = sm_.SoftmaxCrossEntropy(l.local, y.local);
  return Push(std::move(out), Node(Node::kSoftmaxCrossEntropy, {logits.id, labels.id}));
}

JitBuilder::Value JitBuilder::SoftmaxCrossEntropyGrad(Value logits, Value labels, Value dloss) {
  Scope rec(this, v1::GlobalOp::SOFTMAX_CROSS_ENTROPY_GRAD);
  rec.Operands({logits, labels, dloss});
  if (!Valid(logits) || !Valid(labels) || !Valid(dloss)) return {};
  const Dims& d = values_[logits.id].global;
  if (!Check(d.size() == 2 && values_[labels.id].global == Dims{d[0]} &&
                 values_[dloss.id].global == Dims{d[0]},
             absl::StrCat("softmax_cross_entropy grad: logits [", absl::StrJoin(d, ", "),
                          "], labels [", absl::StrJoin(values_[labels.id].global, ", "),
                          "] and dloss [", absl::StrJoin(values_[dloss.id].global, ", "),
                          "]; expected [b, c], [b] and [b]"))) {
    return {};
  }
  const auto [whole, rows] = RowLayouts(values_[logits.id].spec);
  State l = Resolve(values_[logits.id], whole, "softmax_cross_entropy grad");
  const State y = Resolve(values_[labels.id], rows, "softmax_cross_entropy grad labels");
  const State g = Resolve(values_[dloss.id], rows, "softmax_cross_entropy grad dloss");
  l.local = sm_.SoftmaxCrossEntropyGrad(l.local, y.local, g.local);
  return Push(std::move(l), Node(Node::kConstant));
}

JitBuilder::Value JitBuilder::Constant(float value, const Dims& global_dims,
                                       const PartitionSpec& spec) {
  Scope rec(this, v1::GlobalOp::CONSTANT);
  if (rec.op != nullptr) {
    rec.op->set_value(value);
    for (int64_t d : global_dims) rec.op->add_shape(d);
    *rec.op->mutable_spec() = spec.ToProto();
  }
  if (!status_.ok()) return {};
  const NamedSharding sharding(mesh_, spec);
  absl::Status fits = sharding.Validate(global_dims);
  if (!Check(fits.ok(), absl::StrCat("constant ", value, ": ", fits.message()))) return {};
  State s;
  s.local = sm_.Full(v1::DTYPE_F32, sharding.ShardDims(global_dims), value);
  s.dtype = v1::DTYPE_F32;
  s.global = global_dims;
  s.spec = spec;
  return Push(std::move(s), Node(Node::kConstant));
}

JitBuilder::Value JitBuilder::StopGradient(Value x) {
  Scope rec(this, v1::GlobalOp::STOP_GRADIENT);
  rec.Operands({x});
  if (!Valid(x)) return {};
  return Push(values_[x.id], Node(Node::kStopGradient, {x.id}));
}

JitBuilder::Value JitBuilder::Convert(Value x, DType dtype) {
  Scope rec(this, v1::GlobalOp::CONVERT);
  rec.Operands({x});
  if (rec.op != nullptr) rec.op->set_dtype(dtype);
  if (!Valid(x)) return {};
  if (!Check(DTypeSize(dtype) > 0,
             absl::StrCat("convert to dtype ", static_cast<int>(dtype), ": not a dtype")))
    return {};
  // bf16 -> f32 of a pending partial sum stays pending: widening each device's part is exact,
  // so the sum is taken once, in f32 (a bf16 matmul's gradient is reduced in f32, with the
  // others of its step, not once per minibatch in bf16). Other conversions apply to the sum.
  const State& in = values_[x.id];
  const bool widen_partial = in.dtype == v1::DTYPE_BF16 && dtype == v1::DTYPE_F32 &&
                             !in.partial.empty() && in.partial_fn == "sum";
  State s = widen_partial ? in : Complete(in, "convert");
  const bool floats = IsFloat(s.dtype) && IsFloat(dtype);
  s.local = sm_.Convert(s.local, dtype);
  s.dtype = dtype;
  // Between float dtypes the gradient converts back; from integers none flows.
  return Push(std::move(s), floats ? Node(Node::kConvert, {x.id}) : Node(Node::kConstant));
}

JitBuilder::Value JitBuilder::BitcastConvert(Value x, DType dtype) {
  Scope rec(this, v1::GlobalOp::BITCAST_CONVERT);
  rec.Operands({x});
  if (rec.op != nullptr) rec.op->set_dtype(dtype);
  if (!Valid(x)) return {};
  State s = Complete(values_[x.id], "bitcast_convert_type");
  s.local = sm_.BitcastConvert(s.local, dtype);
  s.dtype = dtype;
  return Push(std::move(s), Node(Node::kConstant));
}

JitBuilder::Value JitBuilder::Iota(DType dtype, const Dims& global_dims, int64_t dim,
                                   const PartitionSpec& spec) {
  Scope rec(this, v1::GlobalOp::IOTA);
  if (rec.op != nullptr) {
    rec.op->set_dtype(dtype);
    for (int64_t d : global_dims) rec.op->add_shape(d);
    rec.op->set_index(dim);
    *rec.op->mutable_spec() = spec.ToProto();
  }
  if (!status_.ok()) return {};
  if (!Check(dim >= 0 && dim < static_cast<int64_t>(global_dims.size()),
             absl::StrCat("iota: dim ", dim, " of shape ", DimsToString(global_dims))))
    return {};
  absl::Status fits = NamedSharding(mesh_, spec).Validate(global_dims);
  if (!Check(fits.ok(), absl::StrCat("iota: ", fits.message()))) return {};
  // Counted along `dim` whole on every device, then sliced to `spec` where it shards `dim`.
  std::vector<PartitionSpec::Entry> whole = spec.Padded(global_dims.size());
  whole[dim].clear();
  State s;
  s.dtype = dtype;
  s.global = global_dims;
  s.spec = PartitionSpec(whole);
  s.local = sm_.Iota(dtype, NamedSharding(mesh_, s.spec).ShardDims(global_dims), dim);
  return Push(Resolve(s, spec, "iota"), Node(Node::kConstant));
}

JitBuilder::Value JitBuilder::UnaryGrad(const std::string& fn, Value x, Value dy) {
  Scope rec(this, v1::GlobalOp::UNARY_GRAD);
  rec.Operands({x, dy});
  if (rec.op != nullptr) rec.op->set_fn(fn);
  if (!Valid(x) || !Valid(dy)) return {};
  State sx = Complete(values_[x.id], fn + " grad");
  if (!Check(sx.global == values_[dy.id].global,
             absl::StrCat(fn, " grad: x (", absl::StrJoin(sx.global, ", "), ") and dy (",
                          absl::StrJoin(values_[dy.id].global, ", "), ") differ"))) {
    return {};
  }
  State sdy = Resolve(values_[dy.id], sx.spec, fn + " grad");
  sx.local = sm_.UnaryGrad(fn, sx.local, sdy.local);
  return Push(std::move(sx), Node(Node::kUnaryGrad, {x.id, dy.id}, fn));
}

std::vector<JitBuilder::Value> JitBuilder::AdamUpdate(Value param, Value grad, Value mu, Value nu,
                                                      Value step, const v1::AdamWAttrs& hp) {
  Scope rec(this, v1::GlobalOp::ADAM_UPDATE);
  rec.Operands({param, grad, mu, nu, step});
  if (rec.op != nullptr) *rec.op->mutable_adam() = hp;
  for (Value v : {param, grad, mu, nu, step})
    if (!Valid(v)) return {};
  const State p = Complete(values_[param.id], "adam update");
  for (Value v : {grad, mu, nu}) {
    if (!Check(values_[v.id].global == p.global,
               absl::StrCat("adam update: param (", absl::StrJoin(p.global, ", "), ") and (",
                            absl::StrJoin(values_[v.id].global, ", "), ") differ"))) {
      return {};
    }
  }
  if (!Check(values_[step.id].global.empty(), "adam update: step must be a scalar")) return {};
  const std::string reason = "adam update";
  // A gradient that is still a per-device partial sum (or mean) in the parameter's layout needs
  // only an all-reduce over the partial axes, over which the parameter is replicated: the update
  // takes the partial gradient and the worker fuses the two (OP_ADAM_UPDATE's grad axes), so each
  // replica updates one segment rather than every replica all of it. Anything else is resolved
  // first, as for any consumer (FSDP's psum_scatter, a reshard).
  const State& g_in = values_[grad.id];
  bool fuse = !g_in.partial.empty() && (g_in.partial_fn == "sum" || g_in.partial_fn == "mean") &&
              g_in.spec == p.spec;
  if (fuse) {
    absl::StatusOr<spmd::PartialSumPlan> plan = spmd::PlanPartialSum(
        g_in.global, g_in.spec,
        g_in.partial_fn == "sum" ? g_in.partial : std::vector<std::string>{}, p.spec, mesh_);
    fuse = plan.ok() && plan->reshards.empty() &&
           (g_in.partial_fn == "mean" ? plan->reductions.empty()
                                      : plan->reductions.size() == 1 &&
                                            plan->reductions[0].kind == spmd::Reduction::kPsum &&
                                            plan->reductions[0].axes == g_in.partial);
  }
  // reduce_dtype bf16 (FSDP2's): the partial is reduced in bf16, by the worker when fused, else
  // narrowed here, resolved (psum_scatter, psum) in bf16 and widened back.
  const bool bf16_reduce = hp.reduce_dtype() == v1::DTYPE_BF16;
  if (!Check(hp.reduce_dtype() == v1::DTYPE_UNSPECIFIED || hp.reduce_dtype() == v1::DTYPE_F32 ||
                 bf16_reduce,
             absl::StrCat("adam update: reduce dtype ", DTypeName(hp.reduce_dtype()),
                          "; expected f32 or bf16"))) {
    return {};
  }
  State g = g_in;
  v1::AdamWAttrs whole_hp = hp;  // an update of a whole gradient reduces nothing
  whole_hp.clear_reduce_dtype();
  if (fuse) {
    const int64_t bytes = spmd::ReductionBytesPerDevice(
        {spmd::Reduction::kPsum, g.partial}, g.global, g.spec, mesh_,
        static_cast<int>(DTypeSize(bf16_reduce ? v1::DTYPE_BF16 : g.dtype)));
    collectives_.push_back(
        {g.partial_fn == "mean" ? "pmean" : "psum", g.partial, -1, bytes, "adam update (fused)"});
  } else if (bf16_reduce && !g_in.partial.empty() && g_in.dtype == v1::DTYPE_F32) {
    State narrow = g_in;  // each device's part rounded to bf16; the sum stays pending
    narrow.scaled = nullptr;
    narrow.local = sm_.Convert(g_in.local, v1::DTYPE_BF16);
    narrow.dtype = v1::DTYPE_BF16;
    g = Resolve(narrow, p.spec, reason);
    g.local = sm_.Convert(g.local, v1::DTYPE_F32);
    g.dtype = v1::DTYPE_F32;
  } else {
    g = Resolve(g_in, p.spec, reason);
  }
  const State m = Resolve(values_[mu.id], p.spec, reason);
  const State v = Resolve(values_[nu.id], p.spec, reason);
  const State t = Resolve(values_[step.id], PartitionSpec(), reason);
  std::vector<ShardMapBuilder::Value> locals =
      fuse
          ? sm_.AdamUpdate(p.local, g.local, m.local, v.local, t.local, hp, g.partial, g.partial_fn)
          : sm_.AdamUpdate(p.local, g.local, m.local, v.local, t.local, whole_hp);
  std::vector<Value> out;
  for (ShardMapBuilder::Value local : locals) {
    State s = p;
    s.local = local;
    out.push_back(
        Push(std::move(s), Node(Node::kOptimizer, {param.id, grad.id, mu.id, nu.id, step.id})));
  }
  return out;
}

absl::StatusOr<v1::ShardMapProgram> JitBuilder::Build() const {
  if (!status_.ok()) return status_;
  return sm_.Build();
}

}  // namespace meshrun
