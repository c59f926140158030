// JitBuilder's reverse-mode autodiff over its tape (jax.grad's transpose rules): Grad walks the
// values from the loss back to `wrt`, and Backprop adds each value's cotangent to its operands'.
#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/spmd/jit.h"

namespace meshrun {

struct JitBuilder::Cotangent {
  Value sum;                      // the summed contributions, if any
  std::map<int64_t, Value> rows;  // contributions to rows of dim 0 (from Index)
  bool any() const { return sum.id >= 0 || !rows.empty(); }
  // False for a value that does not depend on Grad's `wrt` (Grad marks it with sum.id == -2).
  bool needed() const { return sum.id != -2; }
};

namespace {

std::vector<int64_t> Range(int64_t begin, int64_t n) {
  std::vector<int64_t> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = begin + i;
  return v;
}

std::vector<int64_t> ToInt64(const std::vector<int>& v) {
  return std::vector<int64_t>(v.begin(), v.end());
}

bool IsIdentity(const std::vector<int64_t>& perm) {
  for (size_t i = 0; i < perm.size(); ++i)
    if (perm[i] != static_cast<int64_t>(i)) return false;
  return true;
}

}  // namespace

void JitBuilder::AddCotangent(std::vector<Cotangent>& cts, int operand, Value contribution) {
  Cotangent& ct = cts[operand];
  ct.sum = ct.sum.id < 0 ? contribution : Add(ct.sum, contribution);
}

void JitBuilder::Backprop(int id, Value g, std::vector<Cotangent>& cts) {
  const Node node = values_[id].node;  // copied: values_ grows below
  const auto add = [&](int operand, Value contribution) {
    AddCotangent(cts, operand, contribution);
  };
  switch (node.kind) {
    case Node::kInput:
    case Node::kConstant:
    case Node::kStopGradient:
      return;
    case Node::kConstraint:
      add(node.operands[0], WithShardingConstraint(g, node.spec));
      return;
    case Node::kConvert:
      add(node.operands[0], Convert(g, values_[node.operands[0]].dtype));
      return;
    case Node::kSoftmaxCrossEntropy:  // the labels are class indices: no gradient
      add(node.operands[0],
          SoftmaxCrossEntropyGrad(Value{node.operands[0]}, Value{node.operands[1]}, g));
      return;
    case Node::kUnary: {
      const int x = node.operands[0];
      if (node.fn == "neg") {
        add(x, Unary("neg", g));
      } else if (node.fn == "rsqrt") {  // d/dx x^-1/2 = -1/2 x^-3/2
        add(x, Mul(g, Scale(Mul(Value{id}, Div(Value{id}, Value{x})), -0.5f)));
      } else {
        add(x, UnaryGrad(node.fn, Value{x}, g));
      }
      return;
    }
    case Node::kBinary:
      return BackpropBinary(id, g, cts);
    case Node::kUnaryGrad:
      Check(false, "grad: a second derivative (of unary_grad) is not supported");
      return;
    case Node::kOptimizer:
      Check(false, "grad: an optimizer update is not differentiable");
      return;
    case Node::kReduce:
      return BackpropReduce(id, g, cts);
    case Node::kBroadcast:
      return BackpropBroadcast(id, g, cts);
    case Node::kSelect:
      return BackpropSelect(id, g, cts);
    case Node::kConcatenate: {  // each operand's slice of the cotangent
      const Dims shape = values_[id].global;
      std::vector<int64_t> starts(shape.size(), 0), limits = shape;
      for (int operand : node.operands) {
        const int64_t size = values_[operand].global[node.index];
        limits[node.index] = starts[node.index] + size;
        if (cts[operand].needed()) add(operand, Slice(g, starts, limits));
        starts[node.index] += size;
      }
      return;
    }
    case Node::kReshape:
      add(node.operands[0], Reshape(g, values_[node.operands[0]].global));
      return;
    case Node::kTranspose: {
      std::vector<int64_t> inverse(node.dims.size());
      for (size_t i = 0; i < node.dims.size(); ++i) inverse[node.dims[i]] = static_cast<int64_t>(i);
      add(node.operands[0], Transpose(g, inverse));
      return;
    }
    case Node::kIndex: {
      Cotangent& ct = cts[node.operands[0]];
      auto it = ct.rows.find(node.index);
      if (it == ct.rows.end()) {
        ct.rows[node.index] = g;
      } else {
        it->second = Add(it->second, g);
      }
      return;
    }
    case Node::kStack:
      for (size_t i = 0; i < node.operands.size(); ++i) {
        if (cts[node.operands[i]].needed())
          add(node.operands[i], Index(g, static_cast<int64_t>(i)));
      }
      return;
    case Node::kDot:
      return BackpropDot(id, g, cts);
  }
}

void JitBuilder::BackpropBinary(int id, Value g, std::vector<Cotangent>& cts) {
  const Node node = values_[id].node;
  const Dims shape = values_[id].global;
  const int a = node.operands[0], b = node.operands[1];
  // A scalar operand of a shaped result receives the sum of the cotangent.
  const auto add = [&](int operand, Value v) {
    if (values_[operand].global.empty() && !shape.empty())
      v = Reduce("sum", v, Range(0, static_cast<int64_t>(shape.size())));
    AddCotangent(cts, operand, v);
  };
  const bool need_a = cts[a].needed(), need_b = cts[b].needed();
  if (node.fn == "add") {
    if (need_a) add(a, g);
    if (need_b) add(b, g);
  } else if (node.fn == "sub") {
    if (need_a) add(a, g);
    if (need_b) add(b, Unary("neg", g));
  } else if (node.fn == "mul") {
    if (need_a) add(a, Mul(g, Value{b}));
    if (need_b) add(b, Mul(g, Value{a}));
  } else if (node.fn == "div") {
    if (need_a) add(a, Div(g, Value{b}));
    if (need_b) add(b, Unary("neg", Div(Mul(g, Value{id}), Value{b})));
  } else {
    Check(false, absl::StrCat("grad: binary ", node.fn, " is not differentiable here"));
  }
}

void JitBuilder::BackpropReduce(int id, Value g, std::vector<Cotangent>& cts) {
  const Node node = values_[id].node;
  const int x = node.operands[0];
  const Dims in = values_[x].global;
  const PartitionSpec in_spec = values_[x].spec;
  if (!Check(node.fn == "sum" || node.fn == "mean",
             absl::StrCat("grad: reduce ", node.fn, " is not differentiable here"))) {
    return;
  }
  std::vector<int64_t> kept;
  int64_t reduced = 1;
  for (size_t d = 0; d < in.size(); ++d) {
    if (std::find(node.dims.begin(), node.dims.end(), static_cast<int64_t>(d)) == node.dims.end()) {
      kept.push_back(static_cast<int64_t>(d));
    } else {
      reduced *= in[d];
    }
  }
  Value b = BroadcastInDim(g, in, kept, in_spec);
  AddCotangent(cts, x, node.fn == "mean" ? Scale(b, 1.0f / static_cast<float>(reduced)) : b);
}

void JitBuilder::BackpropBroadcast(int id, Value g, std::vector<Cotangent>& cts) {
  const Node node = values_[id].node;
  const Dims shape = values_[id].global;
  const int x = node.operands[0];
  const Dims in = values_[x].global;  // copied: Reduce below grows values_
  std::vector<int64_t> added;         // new dims and unit dims that grew
  for (size_t d = 0; d < shape.size(); ++d) {
    auto it = std::find(node.dims.begin(), node.dims.end(), static_cast<int64_t>(d));
    if (it == node.dims.end() || in[it - node.dims.begin()] != shape[d])
      added.push_back(static_cast<int64_t>(d));
  }
  Value sum = added.empty() ? g : Reduce("sum", g, added);
  AddCotangent(cts, x, values_[sum.id].global == in ? sum : Reshape(sum, in));
}

// The cotangent flows to the operand each element took.
void JitBuilder::BackpropSelect(int id, Value g, std::vector<Cotangent>& cts) {
  const Node node = values_[id].node;
  const int64_t rank = static_cast<int64_t>(values_[id].global.size());
  const Value p{node.operands[0]};
  const Value zero = Constant(0.0f, {});
  for (int branch : {1, 2}) {
    const int operand = node.operands[branch];
    if (!cts[operand].needed()) continue;
    Value ct = branch == 1 ? Select(p, g, zero) : Select(p, zero, g);
    AddCotangent(cts, operand,
                 values_[operand].global.empty() ? Reduce("sum", ct, Range(0, rank)) : ct);
  }
}

// jax's dot_general transpose rules: each operand's cotangent is a dot_general of the result's
// cotangent with the other operand, then a transpose into the operand's dim order.
void JitBuilder::BackpropDot(int id, Value g, std::vector<Cotangent>& cts) {
  const Node node = values_[id].node;
  const int a = node.operands[0], b = node.operands[1];
  const spmd::DotDimensionNumbers& dn = node.dnums;
  const size_t ra = values_[a].global.size(), rb = values_[b].global.size();
  const int64_t nb = static_cast<int64_t>(dn.lhs_batch.size());
  const std::vector<int64_t> lf = FreeDims(ra, dn.lhs_contracting, dn.lhs_batch);
  const std::vector<int64_t> rf = FreeDims(rb, dn.rhs_contracting, dn.rhs_batch);
  const std::vector<int64_t> g_lf = Range(nb, static_cast<int64_t>(lf.size()));
  const std::vector<int64_t> g_rf =
      Range(nb + static_cast<int64_t>(lf.size()), static_cast<int64_t>(rf.size()));
  if (cts[a].needed()) {
    Value raw = DotGeneral(g, Value{b}, g_rf, rf, Range(0, nb), ToInt64(dn.rhs_batch));
    // raw dims: batch, lhs free (in order), then rhs contracting dims in increasing order.
    std::vector<int64_t> perm(ra);
    for (int64_t k = 0; k < nb; ++k) perm[dn.lhs_batch[k]] = k;
    for (size_t i = 0; i < lf.size(); ++i) perm[lf[i]] = nb + static_cast<int64_t>(i);
    std::vector<int> rc = dn.rhs_contracting;
    std::sort(rc.begin(), rc.end());
    for (size_t m = 0; m < rc.size(); ++m) {
      const size_t k = std::find(dn.rhs_contracting.begin(), dn.rhs_contracting.end(), rc[m]) -
                       dn.rhs_contracting.begin();
      perm[dn.lhs_contracting[k]] = nb + static_cast<int64_t>(lf.size() + m);
    }
    AddCotangent(cts, a, IsIdentity(perm) ? raw : Transpose(raw, perm));
  }
  if (cts[b].needed()) {
    Value raw = DotGeneral(Value{a}, g, lf, g_lf, ToInt64(dn.lhs_batch), Range(0, nb));
    // raw dims: batch, lhs contracting dims in increasing order, then rhs free (in order).
    std::vector<int64_t> perm(rb);
    for (int64_t k = 0; k < nb; ++k) perm[dn.rhs_batch[k]] = k;
    std::vector<int> lc = dn.lhs_contracting;
    std::sort(lc.begin(), lc.end());
    for (size_t m = 0; m < lc.size(); ++m) {
      const size_t k = std::find(dn.lhs_contracting.begin(), dn.lhs_contracting.end(), lc[m]) -
                       dn.lhs_contracting.begin();
      perm[dn.rhs_contracting[k]] = nb + static_cast<int64_t>(m);
    }
    for (size_t j = 0; j < rf.size(); ++j) perm[rf[j]] = nb + static_cast<int64_t>(lc.size() + j);
    AddCotangent(cts, b, IsIdentity(perm) ? raw : Transpose(raw, perm));
  }
}

std::vector<JitBuilder::Value> JitBuilder::Grad(Value loss, const std::vector<Value>& wrt) {
  Scope rec(this, v1::GlobalOp::GRAD);
  rec.Operands({loss});
  if (rec.op != nullptr)
    for (Value w : wrt) rec.op->add_operands(w.id);
  std::vector<Value> grads(wrt.size());
  if (!Valid(loss)) return grads;
  for (Value w : wrt)
    if (!Valid(w)) return grads;
  if (!Check(values_[loss.id].global.empty() && values_[loss.id].dtype == v1::DTYPE_F32,
             absl::StrCat("grad: the loss must be an f32 scalar; got shape (",
                          absl::StrJoin(values_[loss.id].global, ", "), ")"))) {
    return grads;
  }
  const int n = static_cast<int>(values_.size());
  // Which values depend on `wrt` (only they get cotangents); sum.id == -2 marks the others.
  std::vector<bool> wanted(n, false);
  for (Value w : wrt) wanted[w.id] = true;
  std::vector<bool> depends(n, false);
  for (int id = 0; id < n; ++id) {
    const Node& node = values_[id].node;
    depends[id] = wanted[id];
    if (node.kind == Node::kStopGradient) continue;
    for (int o : node.operands) depends[id] = depends[id] || depends[o];
  }
  std::vector<Cotangent> cts(n);
  for (int id = 0; id < n; ++id)
    if (!depends[id]) cts[id].sum.id = -2;
  if (depends[loss.id]) cts[loss.id].sum = Constant(1.0f, {});
  for (int id = loss.id; id >= 0 && status_.ok(); --id) {
    Cotangent& ct = cts[id];
    if (!depends[id] || !ct.any()) continue;
    if (!ct.rows.empty()) {
      // Rows of a stacked value read by Index: the cotangent is the stack of the rows' ones.
      const Dims global = values_[id].global;
      const Dims row(global.begin() + 1, global.end());
      std::vector<PartitionSpec::Entry> e = values_[id].spec.Padded(global.size());
      const PartitionSpec row_spec(std::vector<PartitionSpec::Entry>(e.begin() + 1, e.end()));
      std::vector<Value> rows;
      for (int64_t i = 0; i < global[0]; ++i) {
        auto it = ct.rows.find(i);
        rows.push_back(it != ct.rows.end() ? it->second : Constant(0.0f, row, row_spec));
      }
      Value stacked = Stack(rows);
      ct.sum = ct.sum.id < 0 ? stacked : Add(ct.sum, stacked);
      ct.rows.clear();
    }
    if (!wanted[id]) Backprop(id, ct.sum, cts);
  }
  for (size_t i = 0; i < wrt.size(); ++i) {
    if (cts[wrt[i].id].sum.id >= 0) {
      grads[i] = cts[wrt[i].id].sum;
    } else {
      const State w = values_[wrt[i].id];
      grads[i] = Constant(0.0f, w.global, w.spec);
    }
  }
  return grads;
}

}  // namespace meshrun
