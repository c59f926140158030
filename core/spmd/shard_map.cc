#include "core/spmd/shard_map.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/sharding/named_sharding.h"
#include "core/spmd/fusion.h"
#include "core/spmd/shard_map_internal.h"

namespace meshrun {

using shard_map_internal::MakeOp;

bool ShardMapBuilder::Check(bool ok, const std::string& message) {
  if (!ok && error_.ok()) error_ = absl::InvalidArgumentError(message);
  return ok && error_.ok();
}

bool ShardMapBuilder::Valid(Value v) {
  return Check(v.id >= 0 && v.id < static_cast<int>(values_.size()), "use of an invalid value");
}

Dims ShardMapBuilder::shape(Value v) const { return v.id >= 0 ? values_[v.id].dims : Dims{}; }
DType ShardMapBuilder::dtype(Value v) const {
  return v.id >= 0 ? values_[v.id].dtype : v1::DTYPE_UNSPECIFIED;
}

ShardMapBuilder::Value ShardMapBuilder::Add(v1::Op op, DType dtype, Dims dims) {
  const std::string name = absl::StrCat("v", values_.size());
  // Every value's size is checked here, so the dims of any value (and any product of them) stay
  // far inside int64; after an error the ops that follow are ignored.
  absl::StatusOr<int64_t> bytes = CheckedByteSize(dtype, dims);
  Check(
      bytes.ok(),
      absl::StrCat(
          "op ",
          program_.program().functions_size() == 0 ? 0 : program_.program().functions(0).ops_size(),
          " (", v1::OpKind_Name(op.kind()), "): ", bytes.status().message()));
  values_.push_back({name, dtype, dims});
  v1::BufferDecl* b = program_.mutable_program()->add_buffers();
  b->set_name(name);
  b->set_dtype(dtype);
  for (int64_t d : dims) b->mutable_shape()->add_dims(d);
  b->set_role(v1::BUFFER_ROLE_ACTIVATION);
  if (op.kind() != v1::OP_UNSPECIFIED) {
    op.add_outputs(name);
    if (program_.program().functions_size() == 0)
      program_.mutable_program()->add_functions()->set_name("main");
    *program_.mutable_program()->mutable_functions(0)->add_ops() = std::move(op);
  }
  return Value{static_cast<int>(values_.size()) - 1};
}

absl::StatusOr<int> ShardMapBuilder::GroupSize(const std::vector<std::string>& axes) {
  absl::StatusOr<std::vector<int>> idx = mesh_.AxisIndices(axes);
  if (!idx.ok()) return idx.status();
  if (axes.empty()) return absl::InvalidArgumentError("a collective needs at least one mesh axis");
  int n = 1;
  for (int i : *idx) n *= mesh_.axis_size(i);
  return n;
}

ShardMapBuilder::Value ShardMapBuilder::Input(DType dtype, const Dims& global_dims,
                                              const PartitionSpec& in_spec) {
  NamedSharding sharding(mesh_, in_spec);
  absl::Status s = sharding.Validate(global_dims);
  if (!Check(s.ok(), absl::StrCat("in_specs[", program_.inputs_size(), "]: ", s.message())))
    return {};
  Value v = Add(v1::Op(), dtype, sharding.ShardDims(global_dims));
  program_.add_inputs(Name(v));
  *program_.add_in_specs() = in_spec.ToProto();
  return v;
}

void ShardMapBuilder::Output(Value v, const PartitionSpec& out_spec) {
  if (!Valid(v)) return;
  program_.add_outputs(Name(v));
  *program_.add_out_specs() = out_spec.ToProto();
}

ShardMapBuilder::Value ShardMapBuilder::Unary(const std::string& fn, Value x) {
  if (!Valid(x)) return {};
  const DType original = dtype(x);
  x = ToF32(x);
  v1::Op op = MakeOp(v1::OP_UNARY, {Name(x)});
  op.set_fn(fn);
  return Restore(Add(std::move(op), dtype(x), shape(x)), original);
}

ShardMapBuilder::Value ShardMapBuilder::UnaryGrad(const std::string& fn, Value x, Value dy) {
  if (!Valid(x) || !Valid(dy)) return {};
  if (!Check(shape(x) == shape(dy), absl::StrCat(fn, " grad: x ", DimsToString(shape(x)),
                                                 " and dy ", DimsToString(shape(dy)), " differ"))) {
    return {};
  }
  const DType original = dtype(x);
  x = ToF32(x);
  dy = ToF32(dy);
  v1::Op op = MakeOp(v1::OP_UNARY_GRAD, {Name(x), Name(dy)});
  op.set_fn(fn);
  return Restore(Add(std::move(op), dtype(x), shape(x)), original);
}

ShardMapBuilder::Value ShardMapBuilder::Pow(Value x, float exponent) {
  if (!Valid(x)) return {};
  const DType original = dtype(x);
  x = ToF32(x);
  v1::Op op = MakeOp(v1::OP_UNARY, {Name(x)});
  op.set_fn("pow");
  op.set_value(exponent);
  return Restore(Add(std::move(op), dtype(x), shape(x)), original);
}

ShardMapBuilder::Value ShardMapBuilder::Binary(const std::string& fn, Value a, Value b) {
  if (!Valid(a) || !Valid(b)) return {};
  const DType original = dtype(a);
  a = ToF32(a);
  b = ToF32(b);
  // numpy broadcasting: align trailing dims, then broadcast both sides to the common shape.
  Dims da = shape(a), db = shape(b);
  const size_t rank = std::max(da.size(), db.size());
  da.insert(da.begin(), rank - da.size(), 1);
  db.insert(db.begin(), rank - db.size(), 1);
  Dims out(rank);
  for (size_t i = 0; i < rank; ++i) {
    if (!Check(da[i] == db[i] || da[i] == 1 || db[i] == 1,
               absl::StrCat(fn, ": shapes ", DimsToString(shape(a)), " and ",
                            DimsToString(shape(b)), " do not broadcast"))) {
      return {};
    }
    out[i] = std::max(da[i], db[i]);
  }
  if (shape(a) != da) a = Reshape(a, da);
  if (da != out) a = BroadcastTo(a, out);
  if (shape(b) != db) b = Reshape(b, db);
  v1::Op op = MakeOp(v1::OP_BINARY, {Name(a), Name(b)});
  op.set_fn(fn);
  return Restore(Add(std::move(op), dtype(a), out), original);
}

ShardMapBuilder::Value ShardMapBuilder::Select(Value pred, Value on_false, Value on_true) {
  if (!Valid(pred) || !Valid(on_false) || !Valid(on_true)) return {};
  const DType original = dtype(on_false);
  pred = ToF32(pred);
  on_false = ToF32(on_false);
  on_true = ToF32(on_true);
  Dims out;
  for (Value v : {pred, on_false, on_true})
    if (NumElements(shape(v)) != 1 && out.empty()) out = shape(v);
  if (out.empty()) out = shape(on_false);
  for (Value v : {pred, on_false, on_true}) {
    if (!Check(shape(v) == out || NumElements(shape(v)) == 1,
               absl::StrCat("select: operand shape ", DimsToString(shape(v)), " is not ",
                            DimsToString(out), " or one element"))) {
      return {};
    }
  }
  v1::Op op = MakeOp(v1::OP_SELECT, {Name(pred), Name(on_false), Name(on_true)});
  return Restore(Add(std::move(op), v1::DTYPE_F32, out), original);
}

ShardMapBuilder::Value ShardMapBuilder::Dot(Value a, Value b) {
  if (!Valid(a) || !Valid(b)) return {};
  const Dims da = shape(a), db = shape(b);
  if (!Check(da.size() == 2 && db.size() == 2 && da[1] == db[0],
             absl::StrCat("dot: ", DimsToString(da), " @ ", DimsToString(db),
                          " (local blocks) do not agree"))) {
    return {};
  }
  const DType original = dtype(a), compute = MatmulDType(a, b);
  a = MatmulOperand(a, compute);
  b = MatmulOperand(b, compute);
  return Restore(Add(MakeOp(v1::OP_MATMUL, {Name(a), Name(b)}), compute, {da[0], db[1]}), original);
}

ShardMapBuilder::Value ShardMapBuilder::DotGeneral(Value a, Value b,
                                                   const std::vector<int64_t>& lhs_contracting,
                                                   const std::vector<int64_t>& rhs_contracting,
                                                   const std::vector<int64_t>& lhs_batch,
                                                   const std::vector<int64_t>& rhs_batch) {
  if (!Valid(a) || !Valid(b)) return {};
  const Dims da = shape(a), db = shape(b);
  auto in_range = [](const std::vector<int64_t>& dims, size_t rank) {
    for (int64_t d : dims) {
      if (d < 0 || d >= static_cast<int64_t>(rank)) return false;
    }
    return true;
  };
  // No dim may be named twice (as contracting or batch dims of one side).
  auto distinct = [](std::vector<int64_t> dims, const std::vector<int64_t>& more) {
    dims.insert(dims.end(), more.begin(), more.end());
    std::sort(dims.begin(), dims.end());
    return std::adjacent_find(dims.begin(), dims.end()) == dims.end();
  };
  bool ok = lhs_contracting.size() == rhs_contracting.size() &&
            lhs_batch.size() == rhs_batch.size() && in_range(lhs_contracting, da.size()) &&
            in_range(rhs_contracting, db.size()) && in_range(lhs_batch, da.size()) &&
            in_range(rhs_batch, db.size()) && distinct(lhs_contracting, lhs_batch) &&
            distinct(rhs_contracting, rhs_batch);
  for (size_t i = 0; ok && i < lhs_contracting.size(); ++i)
    ok = da[lhs_contracting[i]] == db[rhs_contracting[i]];
  for (size_t i = 0; ok && i < lhs_batch.size(); ++i) ok = da[lhs_batch[i]] == db[rhs_batch[i]];
  if (!Check(ok, absl::StrCat("dot_general: ", DimsToString(da), " and ", DimsToString(db),
                              " do not agree on the contracting / batch dims"))) {
    return {};
  }
  auto free_dims = [](size_t rank, const std::vector<int64_t>& a1, const std::vector<int64_t>& a2) {
    std::vector<int64_t> out;
    for (int64_t d = 0; d < static_cast<int64_t>(rank); ++d) {
      if (std::find(a1.begin(), a1.end(), d) == a1.end() &&
          std::find(a2.begin(), a2.end(), d) == a2.end()) {
        out.push_back(d);
      }
    }
    return out;
  };
  const std::vector<int64_t> free_a = free_dims(da.size(), lhs_contracting, lhs_batch);
  const std::vector<int64_t> free_b = free_dims(db.size(), rhs_contracting, rhs_batch);
  auto prod = [](const Dims& d, const std::vector<int64_t>& idx) {
    int64_t p = 1;
    for (int64_t i : idx) p *= d[i];
    return p;
  };
  const int64_t batch = prod(da, lhs_batch), m = prod(da, free_a), k = prod(da, lhs_contracting),
                n = prod(db, free_b);
  // lhs -> [batch..., free..., contracting...], rhs -> [batch..., contracting..., free...].
  std::vector<int64_t> perm_a = lhs_batch, perm_b = rhs_batch;
  perm_a.insert(perm_a.end(), free_a.begin(), free_a.end());
  perm_a.insert(perm_a.end(), lhs_contracting.begin(), lhs_contracting.end());
  perm_b.insert(perm_b.end(), rhs_contracting.begin(), rhs_contracting.end());
  perm_b.insert(perm_b.end(), free_b.begin(), free_b.end());
  auto identity = [](const std::vector<int64_t>& p) {
    for (size_t i = 0; i < p.size(); ++i) {
      if (p[i] != static_cast<int64_t>(i)) return false;
    }
    return true;
  };
  const DType original = dtype(a), compute = MatmulDType(a, b);
  a = MatmulOperand(a, compute);
  b = MatmulOperand(b, compute);
  Dims out_dims;
  for (int64_t d : lhs_batch) out_dims.push_back(da[d]);
  for (int64_t d : free_a) out_dims.push_back(da[d]);
  for (int64_t d : free_b) out_dims.push_back(db[d]);
  if (lhs_batch.empty()) {
    // An operand stored [contracting..., free...] (lhs) or [free..., contracting...] (rhs) is
    // read transposed by the matmul itself (oneDNN strides), as a VJP's x^T @ dy is, instead of
    // being copied by a transpose first.
    std::vector<int64_t> swapped_a = lhs_contracting, swapped_b = free_b;
    swapped_a.insert(swapped_a.end(), free_a.begin(), free_a.end());
    swapped_b.insert(swapped_b.end(), rhs_contracting.begin(), rhs_contracting.end());
    const bool ta_flag = !identity(perm_a) && identity(swapped_a);
    const bool tb_flag = !identity(perm_b) && identity(swapped_b);
    Value la = ta_flag || identity(perm_a) ? a : Transpose(a, perm_a);
    Value lb = tb_flag || identity(perm_b) ? b : Transpose(b, perm_b);
    v1::Op op = MakeOp(v1::OP_MATMUL, {Name(Reshape(la, ta_flag ? Dims{k, m} : Dims{m, k})),
                                       Name(Reshape(lb, tb_flag ? Dims{n, k} : Dims{k, n}))});
    op.set_transpose_a(ta_flag);
    op.set_transpose_b(tb_flag);
    return Restore(Reshape(Add(std::move(op), compute, {m, n}), out_dims), original);
  }
  Value ta = identity(perm_a) ? a : Transpose(a, perm_a);
  Value tb = identity(perm_b) ? b : Transpose(b, perm_b);
  Value product = Add(
      MakeOp(v1::OP_MATMUL, {Name(Reshape(ta, {batch, m, k})), Name(Reshape(tb, {batch, k, n}))}),
      compute, {batch, m, n});
  return Restore(Reshape(product, out_dims), original);
}

ShardMapBuilder::Value ShardMapBuilder::Reduce(const std::string& fn, Value x,
                                               const std::vector<int64_t>& dims, bool keepdims) {
  if (!Valid(x)) return {};
  Dims kept = shape(x), dropped;
  for (int64_t d : dims) {
    if (!Check(d >= 0 && d < static_cast<int64_t>(kept.size()),
               absl::StrCat("reduce over dim ", d, " of ", DimsToString(shape(x))))) {
      return {};
    }
    kept[d] = 1;
  }
  for (size_t i = 0; i < kept.size(); ++i) {
    if (std::find(dims.begin(), dims.end(), static_cast<int64_t>(i)) == dims.end())
      dropped.push_back(kept[i]);
  }
  const DType original = dtype(x);
  x = ToF32(x);
  v1::Op op = MakeOp(v1::OP_REDUCE, {Name(x)});
  op.set_fn(fn);
  for (int64_t d : dims) op.add_dims(d);
  Value r = Add(std::move(op), dtype(x), kept);
  return Restore(keepdims ? r : Reshape(r, dropped), original);
}

std::vector<ShardMapBuilder::Value> ShardMapBuilder::AdamUpdate(
    Value param, Value grad, Value mu, Value nu, Value step, const v1::AdamWAttrs& hp,
    const std::vector<std::string>& grad_axes, const std::string& grad_fn) {
  for (Value v : {param, grad, mu, nu, step})
    if (!Valid(v)) return {};
  for (Value v : {grad, mu, nu}) {
    if (!Check(
            shape(v) == shape(param) && dtype(v) == v1::DTYPE_F32 && dtype(param) == v1::DTYPE_F32,
            absl::StrCat("adam update: param ", DimsToString(shape(param)), " and ",
                         DimsToString(shape(v)), " must be f32 of one shape"))) {
      return {};
    }
  }
  if (!Check(shape(step).empty(),
             absl::StrCat("adam update: step must be a scalar; got ", DimsToString(shape(step))))) {
    return {};
  }
  if (!Check(grad_fn == "sum" || grad_fn == "mean",
             absl::StrCat("adam update: the grad reduction must be sum or mean; got '", grad_fn,
                          "'"))) {
    return {};
  }
  v1::Op op = MakeOp(v1::OP_ADAM_UPDATE, {Name(param), Name(grad), Name(mu), Name(nu), Name(step)});
  *op.mutable_adamw() = hp;
  if (!grad_axes.empty()) {
    absl::StatusOr<int> n = GroupSize(grad_axes);
    if (!Check(n.ok(), absl::StrCat("adam update: ", n.status().message()))) return {};
    shard_map_internal::SetAxes(op, grad_axes);
    op.set_fn(grad_fn);
  }
  std::vector<Value> outs;
  for (int i = 0; i < 3; ++i) {
    outs.push_back(Add(v1::Op(), v1::DTYPE_F32, shape(param)));  // declares the buffer only
    op.add_outputs(Name(outs.back()));
  }
  if (program_.program().functions_size() == 0)
    program_.mutable_program()->add_functions()->set_name("main");
  *program_.mutable_program()->mutable_functions(0)->add_ops() = std::move(op);
  return outs;
}

ShardMapBuilder::Value ShardMapBuilder::RandomInit(const Dims& global_dims,
                                                   const PartitionSpec& spec, const std::string& fn,
                                                   float scale,
                                                   const std::array<uint32_t, 2>& key) {
  const NamedSharding sharding(mesh_, spec);
  absl::Status fits = sharding.Validate(global_dims);
  if (!Check(fits.ok(), absl::StrCat("random init: ", fits.message()))) return {};
  v1::Op op = MakeOp(v1::OP_RANDOM_INIT, {});
  op.set_fn(fn);
  op.set_scale(scale);
  for (int64_t d : global_dims) op.add_dims(d);
  *op.mutable_spec() = spec.ToProto();
  op.add_key(key[0]);
  op.add_key(key[1]);
  return Add(std::move(op), v1::DTYPE_F32, sharding.ShardDims(global_dims));
}

ShardMapBuilder::Value ShardMapBuilder::Full(DType dtype, const Dims& dims, double value) {
  v1::Op op = MakeOp(v1::OP_FILL_VALUE, {});
  op.set_value(static_cast<float>(value));
  return Add(std::move(op), dtype, dims);
}

absl::StatusOr<v1::ShardMapProgram> ShardMapBuilder::Build() const {
  if (!error_.ok()) return error_;
  if (program_.outputs_size() == 0)
    return absl::InvalidArgumentError("shard_map program has no outputs");
  v1::ShardMapProgram p = program_;
  if (p.program().functions_size() == 0) p.mutable_program()->add_functions()->set_name("main");
  SimplifyProgram(&p);
  FuseGradientAccumulation(&p);
  FuseElementwise(&p);
  FuseReductionsIntoUpdates(&p);
  return p;
}

}  // namespace meshrun