// JitBuilder's training ops: softmax cross-entropy and its gradient, the fused Adam(W) update.
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/sharding/named_sharding.h"
#include "core/spmd/jit.h"

namespace meshrun {

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
              g_in.spec == p.spec && sm_.dtype(g_in.local) == g_in.dtype;
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

}  // namespace meshrun
