// JitBuilder's elementwise, contraction, reduction and conversion ops (see jit.h).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/sharding/named_sharding.h"
#include "core/spmd/jit.h"

namespace meshrun {
namespace {

bool IsFloat(DType d) { return d == v1::DTYPE_F32 || d == v1::DTYPE_BF16; }

std::vector<int> ToInt(const std::vector<int64_t>& v) {
  return std::vector<int>(v.begin(), v.end());
}

}  // namespace

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
    // gradients and losses. A scalar operand is broadcast: the result has the other's shape.
    State out = sa.global.empty() ? sb : sa;
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
  // A bf16 product whose contraction is split over devices keeps each device's part in f32 (the
  // GEMM's accumulator, unrounded) until the parts are summed, and is rounded to bf16 once, after
  // the sum (Reduce), as the unsplit dot rounds it: the same value as jax.jit's on one device.
  if (out.dtype == v1::DTYPE_BF16 && !plan->partial_sum_axes.empty())
    out.local = sm_.Convert(out.local, v1::DTYPE_F32);
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
  if (!widen_partial || sm_.dtype(s.local) != dtype) s.local = sm_.Convert(s.local, dtype);
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

}  // namespace meshrun
