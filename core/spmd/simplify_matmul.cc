// SimplifyProgram's matmul fusions (fusion.h): a bias, an activation and a conversion to f32
// taken into the GEMM that computes their operand, and relu's gradient read from its output.
#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/spmd/simplify_internal.h"

namespace meshrun {
namespace simplify_internal {
namespace {

// A matmul that only multiplies (and scales by 1): no accumulation, no activation yet.
bool PlainMatmul(const v1::Op& op) {
  return op.kind() == v1::OP_MATMUL && !op.accumulate() && op.fn().empty() &&
         (op.alpha() == 0.0f || op.alpha() == 1.0f) && op.outputs_size() == 1;
}

// Whether the f32 value `q`, a widened bf16 product (Op.widened), is read only where its bf16
// rounding makes no difference: by relu's gradient as its input (only the sign of q counts, the
// same rounded), and by relu and relu's gradient as dy (a mask) where their output is only
// rounded back to bf16 (rounding to nearest commutes with relu and with a 0 / 1 mask: relu(acc)
// rounded is relu of acc rounded). Any other reader (a bias add, a tanh, a product) computes on
// the bf16 value in XLA, so the product's rounding must stay.
bool OnlyReluReads(const Uses& uses, const Ops& ops, const std::string& q,
                   const std::map<std::string, const v1::BufferDecl*>& decls) {
  auto r = uses.readers.find(q);
  if (r == uses.readers.end()) return false;
  for (int k : r->second) {
    const v1::Op& op = ops.Get(k);
    if (op.fn() != "relu" || op.outputs_size() != 1) return false;
    if (op.kind() == v1::OP_UNARY_GRAD && op.inputs_size() == 2 && !op.grad_from_output() &&
        op.inputs(0) == q && op.inputs(1) != q) {
      continue;  // q's sign alone
    }
    const bool as_dy = op.kind() == v1::OP_UNARY_GRAD && op.inputs_size() == 2 &&
                       op.inputs(0) != q && op.inputs(1) == q;
    const bool as_x = op.kind() == v1::OP_UNARY && op.inputs_size() == 1 && op.inputs(0) == q;
    if (!(as_dy || as_x) || uses.boundary.count(op.outputs(0))) return false;
    auto y = uses.readers.find(op.outputs(0));
    if (y == uses.readers.end()) return false;
    for (int j : y->second) {
      const v1::Op& narrow = ops.Get(j);
      auto d = narrow.outputs_size() == 1 ? decls.find(narrow.outputs(0)) : decls.end();
      if (narrow.kind() != v1::OP_CONVERT || d == decls.end() ||
          d->second->dtype() != v1::DTYPE_BF16) {
        return false;
      }
    }
  }
  return true;
}

}  // namespace

// `c = add(matmul(a, b), bias)` with bias [1, N] or [N] over the matmul's [M, N] result becomes
// one OP_MATMUL with a bias (the GEMM's epilogue) writing c, when nothing else reads the product.
// One sweep (the fused op is no plain matmul: it enables no other fusion here).
void FuseMatmulBias(v1::ShardMapProgram* p) {
  const Uses uses(*p);
  const auto decls = Decls(p->program());
  Ops* ops = p->mutable_program()->mutable_functions(0)->mutable_ops();
  std::vector<bool> deleted(ops->size());
  for (int i = 0; i < ops->size(); ++i) {
    const v1::Op& add = ops->Get(i);
    if (add.kind() != v1::OP_BINARY || add.fn() != "add" || add.inputs_size() != 2 ||
        add.outputs_size() != 1) {
      continue;
    }
    const std::string product = add.inputs(0), bias = add.inputs(1), sum = add.outputs(0);
    const int m = uses.PrivateWriter(product);
    if (m < 0 || deleted[m]) continue;
    const v1::Op& matmul = ops->Get(m);
    if (!PlainMatmul(matmul) || matmul.inputs_size() != 2) continue;
    auto pd = decls.find(product), bd = decls.find(bias), sd = decls.find(sum);
    if (pd == decls.end() || bd == decls.end() || sd == decls.end()) continue;
    const std::vector<int64_t> pdims = DimsOf(pd->second), bdims = DimsOf(bd->second);
    if (pdims.size() != 2 || DimsOf(sd->second) != pdims || bd->second->dtype() != v1::DTYPE_F32 ||
        pd->second->dtype() != v1::DTYPE_F32) {
      continue;
    }
    const bool row = (bdims.size() == 2 && bdims[0] == 1 && bdims[1] == pdims[1]) ||
                     (bdims.size() == 1 && bdims[0] == pdims[1]);
    // The fused op runs where the add ran: the matmul's operands and the bias must hold the
    // values they had (each written once, so none changes in between).
    bool fixed = uses.Fixed(bias) && uses.Fixed(sum);
    for (const std::string& in : matmul.inputs()) fixed = fixed && uses.Fixed(in);
    if (!row || !fixed) continue;
    v1::Op fused = matmul;
    fused.add_inputs(bias);
    fused.set_outputs(0, sum);
    *ops->Mutable(i) = std::move(fused);
    deleted[m] = true;
  }
  Compact(ops, deleted);
}

// `q = convert(matmul(a, b))` to f32 of a bf16 GEMM's result read by nothing else: the matmul
// writes q itself, f32 (its f32 accumulator unrounded, as XLA's dot with preferred_element_type
// f32), so a bias or an accumulated gradient can join it in f32 next. A widened convert (a bf16
// op computed in f32) is folded only where OnlyReluReads. One sweep.
void FoldConvertIntoMatmul(v1::ShardMapProgram* p) {
  const Uses uses(*p);
  const auto decls = Decls(p->program());
  const std::set<std::string> args(p->inputs().begin(), p->inputs().end());
  Ops* ops = p->mutable_program()->mutable_functions(0)->mutable_ops();
  std::vector<bool> deleted(ops->size());
  for (int i = 0; i < ops->size(); ++i) {
    const v1::Op& convert = ops->Get(i);
    if (convert.kind() != v1::OP_CONVERT || convert.inputs_size() != 1 ||
        convert.outputs_size() != 1) {
      continue;
    }
    const std::string product = convert.inputs(0), q = convert.outputs(0);
    const int m = uses.PrivateWriter(product);
    if (m < 0 || deleted[m]) continue;
    const v1::Op& matmul = ops->Get(m);
    auto pd = decls.find(product), qd = decls.find(q);
    if (matmul.kind() != v1::OP_MATMUL || matmul.accumulate() || !matmul.fn().empty() ||
        pd == decls.end() || qd == decls.end() || pd->second->dtype() != v1::DTYPE_BF16 ||
        qd->second->dtype() != v1::DTYPE_F32 || DimsOf(pd->second) != DimsOf(qd->second) ||
        args.count(q) || !uses.Fixed(q) ||
        (convert.widened() && !OnlyReluReads(uses, *ops, q, decls))) {
      continue;
    }
    // q now exists from the matmul on: nothing between may read it.
    auto r = uses.readers.find(q);
    if (r != uses.readers.end() &&
        std::any_of(r->second.begin(), r->second.end(), [&](int k) { return k <= i; })) {
      continue;
    }
    ops->Mutable(m)->set_outputs(0, q);
    deleted[i] = true;
  }
  Compact(ops, deleted);
}

// `dx = unary_grad(relu, x, dy)` where an earlier `y = unary(relu, x)` (y written once, not an
// argument) exists reads y instead (grad_from_output): the same bits (but at a NaN x, see
// program.proto), and the backward pass no longer keeps x, so the matmul that writes x can take
// the relu next (FuseMatmulActivation).
void ReluGradFromOutput(v1::ShardMapProgram* p) {
  const Uses uses(*p);
  const std::set<std::string> args(p->inputs().begin(), p->inputs().end());
  Ops* ops = p->mutable_program()->mutable_functions(0)->mutable_ops();
  for (int i = 0; i < ops->size(); ++i) {
    const v1::Op& grad = ops->Get(i);
    if (grad.kind() != v1::OP_UNARY_GRAD || grad.fn() != "relu" || grad.grad_from_output() ||
        grad.inputs_size() != 2 || !uses.Fixed(grad.inputs(0))) {
      continue;
    }
    auto r = uses.readers.find(grad.inputs(0));
    for (int k : r->second) {
      const v1::Op& relu = ops->Get(k);
      if (k >= i || relu.kind() != v1::OP_UNARY || relu.fn() != "relu" || relu.inputs_size() != 1 ||
          relu.outputs_size() != 1 || !uses.Fixed(relu.outputs(0)) || args.count(relu.outputs(0))) {
        continue;
      }
      v1::Op* g = ops->Mutable(i);
      g->set_inputs(0, relu.outputs(0));
      g->set_grad_from_output(true);
      break;
    }
  }
}

// `y = unary(fn, c)` of a matmul's f32 result c that nothing else reads becomes that matmul with
// fn as its post-op, writing y (one pass over the result fewer; oneDNN applies fn to the
// accumulator, which the f32 result holds unrounded, so the bits are the same). fn: OP_MATMUL's
// activations (program.proto; the worker's kernels::EltwiseAlgs but pow and log, which refuses
// others), but tanh, exp and logistic.
void FuseMatmulActivation(v1::ShardMapProgram* p) {
  // Not tanh, exp or logistic: their unaries are XLA's approximations (CreateUnary), oneDNN's
  // post-ops are not.
  static const std::set<std::string> kActivations = {"sqrt",   "rsqrt", "neg", "abs",
                                                     "square", "relu",  "silu"};
  const Uses uses(*p);
  const auto decls = Decls(p->program());
  const std::set<std::string> args(p->inputs().begin(), p->inputs().end());
  Ops* ops = p->mutable_program()->mutable_functions(0)->mutable_ops();
  std::vector<bool> deleted(ops->size());
  for (int i = 0; i < ops->size(); ++i) {
    const v1::Op& unary = ops->Get(i);
    if (unary.kind() != v1::OP_UNARY || !kActivations.count(unary.fn()) ||
        unary.inputs_size() != 1 || unary.outputs_size() != 1) {
      continue;
    }
    const std::string product = unary.inputs(0), y = unary.outputs(0);
    const int m = uses.PrivateWriter(product);
    if (m < 0 || deleted[m]) continue;
    const v1::Op& matmul = ops->Get(m);
    auto pd = decls.find(product);
    if (!PlainMatmul(matmul) || pd == decls.end() || pd->second->dtype() != v1::DTYPE_F32 ||
        !uses.Fixed(y) || args.count(y)) {
      continue;
    }
    // The fused op runs where the unary ran: its operands must hold the values they had.
    bool fixed = true;
    for (const std::string& in : matmul.inputs()) fixed = fixed && uses.Fixed(in);
    if (!fixed) continue;
    v1::Op fused = matmul;
    fused.set_fn(unary.fn());
    fused.set_outputs(0, y);
    *ops->Mutable(i) = std::move(fused);
    deleted[m] = true;
  }
  Compact(ops, deleted);
}

}  // namespace simplify_internal
}  // namespace meshrun
