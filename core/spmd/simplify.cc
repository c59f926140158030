// Algebraic simplification of a per-shard program (fusion.h): common subexpressions, broadcasts
// folded into the binary ops that read them, matmul + bias, dead ops and buffers.
#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/spmd/fusion.h"

namespace meshrun {
namespace {

using Ops = google::protobuf::RepeatedPtrField<v1::Op>;

// Ops that compute their outputs from their inputs and attributes alone: no collective (every
// rank must run the same ones), no in-place update.
bool IsPure(const v1::Op& op) {
  if (op.kind() >= v1::OP_PSUM) return false;
  if (op.kind() == v1::OP_ADAM_UPDATE || op.kind() == v1::OP_RANDOM_INIT) return false;
  if (op.kind() == v1::OP_MATMUL && op.accumulate()) return false;
  return op.kind() != v1::OP_UNSPECIFIED;
}

// Who writes and reads each buffer, and the buffers the program's caller sees.
struct Uses {
  std::map<std::string, std::vector<int>> writers, readers;
  std::set<std::string> boundary;

  explicit Uses(const v1::ShardMapProgram& p) {
    boundary.insert(p.inputs().begin(), p.inputs().end());
    boundary.insert(p.outputs().begin(), p.outputs().end());
    const Ops& ops = p.program().functions(0).ops();
    for (int i = 0; i < ops.size(); ++i) {
      for (const std::string& out : ops.Get(i).outputs()) writers[out].push_back(i);
      for (const std::string& in : ops.Get(i).inputs()) readers[in].push_back(i);
    }
  }
  // Written by op `i` alone (or never written, an argument): its value is fixed once it exists.
  bool Fixed(const std::string& name) const {
    auto w = writers.find(name);
    return w == writers.end() || w->second.size() == 1;
  }
  int Writer(const std::string& name) const {
    auto w = writers.find(name);
    return w == writers.end() || w->second.size() != 1 ? -1 : w->second[0];
  }
  size_t NumReaders(const std::string& name) const {
    auto r = readers.find(name);
    return r == readers.end() ? 0 : r->second.size();
  }
};

std::map<std::string, const v1::BufferDecl*> Decls(const v1::StepProgram& program) {
  std::map<std::string, const v1::BufferDecl*> decls;
  for (const v1::BufferDecl& b : program.buffers()) decls[b.name()] = &b;
  return decls;
}

// Drops the ops marked deleted (a sweep marks them, so that its Uses' indices stay valid).
void Compact(Ops* ops, const std::vector<bool>& deleted) {
  Ops kept;
  for (int i = 0; i < ops->size(); ++i)
    if (!deleted[i]) *kept.Add() = std::move(*ops->Mutable(i));
  *ops = std::move(kept);
}

std::vector<int64_t> DimsOf(const v1::BufferDecl* b) {
  if (b == nullptr) return {};
  return std::vector<int64_t>(b->shape().dims().begin(), b->shape().dims().end());
}

// An op that computes what an earlier one computed (same kind, attributes, inputs, output
// dtypes and shapes, inputs fixed) is deleted and its readers read the earlier results. One
// sweep in program order: reads are renamed before an op's key is made, so an op whose inputs
// became duplicates' is found in the same sweep (linear in the program, as an unrolled
// lax.scan's thousands of ops need).
void EliminateCommonSubexpressions(v1::ShardMapProgram* p) {
  const Uses uses(*p);
  const auto decls = Decls(p->program());
  Ops* ops = p->mutable_program()->mutable_functions(0)->mutable_ops();
  std::map<std::string, int> seen;             // key -> op index
  std::map<std::string, std::string> renamed;  // a deleted op's output -> the earlier one's
  std::vector<bool> deleted(ops->size());
  for (int i = 0; i < ops->size(); ++i) {
    v1::Op* op = ops->Mutable(i);
    for (std::string& in : *op->mutable_inputs()) {
      auto r = renamed.find(in);
      if (r != renamed.end()) in = r->second;
    }
    if (!IsPure(*op) || op->outputs_size() == 0) continue;
    bool eligible = true;
    for (const std::string& in : op->inputs()) eligible = eligible && uses.Fixed(in);
    for (const std::string& out : op->outputs())
      eligible = eligible && uses.Writer(out) == i && !uses.boundary.count(out);
    if (!eligible) continue;
    v1::Op key_op = *op;
    key_op.clear_outputs();
    std::string key;
    key_op.SerializeToString(&key);
    for (const std::string& out : op->outputs()) {
      auto d = decls.find(out);
      if (d == decls.end()) {
        eligible = false;
        break;
      }
      v1::BufferDecl shape_only;
      shape_only.set_dtype(d->second->dtype());
      *shape_only.mutable_shape() = d->second->shape();
      std::string s;
      shape_only.SerializeToString(&s);
      key += "|" + s;
    }
    if (!eligible) continue;
    auto [it, inserted] = seen.emplace(std::move(key), i);
    if (inserted) continue;
    const v1::Op& first = ops->Get(it->second);
    for (int o = 0; o < op->outputs_size(); ++o) renamed[op->outputs(o)] = first.outputs(o);
    deleted[i] = true;
  }
  Compact(ops, deleted);
}

// `y = slice(broadcast(x))` (OP_SLICE or OP_DYNAMIC_SLICE) where x has extent 1 on every dim
// the slice shortens becomes `y = broadcast(x)` at y's shape: along such a dim every element of
// the broadcast is the same, so where the slice starts does not matter. A replicated constant
// that the partitioner broadcast to its global shape and then sliced to a sharded operand's
// block (a mean's 1/n, relu's zeros in its gradient) is made at the block's shape directly, and
// the global broadcast dies. One sweep in program order: a slice of a slice of a broadcast is
// rewritten after the inner one.
void SliceBroadcasts(v1::ShardMapProgram* p) {
  const Uses uses(*p);
  const auto decls = Decls(p->program());
  Ops* ops = p->mutable_program()->mutable_functions(0)->mutable_ops();
  for (int i = 0; i < ops->size(); ++i) {
    v1::Op* op = ops->Mutable(i);
    if ((op->kind() != v1::OP_SLICE && op->kind() != v1::OP_DYNAMIC_SLICE) ||
        op->inputs_size() < 1 || op->outputs_size() != 1 || !uses.Fixed(op->inputs(0))) {
      continue;
    }
    const int w = uses.Writer(op->inputs(0));
    if (w < 0 || w >= i || ops->Get(w).kind() != v1::OP_BROADCAST ||
        ops->Get(w).inputs_size() != 1 || !uses.Fixed(ops->Get(w).inputs(0))) {
      continue;
    }
    const std::string x = ops->Get(w).inputs(0);
    auto xd = decls.find(x), bd = decls.find(op->inputs(0)), yd = decls.find(op->outputs(0));
    if (xd == decls.end() || bd == decls.end() || yd == decls.end() ||
        xd->second->dtype() != yd->second->dtype()) {
      continue;
    }
    const std::vector<int64_t> xdims = DimsOf(xd->second), bdims = DimsOf(bd->second),
                               ydims = DimsOf(yd->second);
    bool uniform = xdims.size() == bdims.size() && ydims.size() == bdims.size();
    for (size_t d = 0; uniform && d < ydims.size(); ++d)
      uniform = ydims[d] == bdims[d] ? (xdims[d] == 1 || xdims[d] == ydims[d]) : xdims[d] == 1;
    if (!uniform) continue;
    v1::Op broadcast;
    broadcast.set_kind(v1::OP_BROADCAST);
    broadcast.add_inputs(x);
    broadcast.add_outputs(op->outputs(0));
    *op = std::move(broadcast);
  }
}

bool Commutative(const std::string& fn) {
  return fn == "add" || fn == "mul" || fn == "max" || fn == "min" || fn == "eq" || fn == "ne";
}

// OP_BINARY broadcasts its second operand (dims equal or 1), so `fn(a, broadcast(x))` reads x
// itself, and `fn(broadcast(x), b)` becomes `fn(b, x)` when fn is commutative. One sweep: a
// rewrite of one op enables none of another.
void FoldBroadcasts(v1::ShardMapProgram* p) {
  const Uses uses(*p);
  const auto decls = Decls(p->program());
  Ops* ops = p->mutable_program()->mutable_functions(0)->mutable_ops();
  auto broadcast_source = [&](const std::string& name) -> std::string {
    const int w = uses.Writer(name);
    if (w < 0 || ops->Get(w).kind() != v1::OP_BROADCAST || ops->Get(w).inputs_size() != 1)
      return "";
    const std::string& x = ops->Get(w).inputs(0);
    return uses.Fixed(x) ? x : "";
  };
  for (int i = 0; i < ops->size(); ++i) {
    v1::Op* op = ops->Mutable(i);
    if (op->kind() != v1::OP_BINARY || op->inputs_size() != 2 || op->outputs_size() != 1) continue;
    auto out = decls.find(op->outputs(0));
    if (out == decls.end()) continue;
    const std::vector<int64_t> out_dims = DimsOf(out->second);
    auto full = [&](const std::string& name) {
      auto d = decls.find(name);
      return d != decls.end() && DimsOf(d->second) == out_dims;
    };
    const std::string x1 = broadcast_source(op->inputs(1));
    if (!x1.empty() && full(op->inputs(0))) {
      op->set_inputs(1, x1);
      continue;
    }
    const std::string x0 = broadcast_source(op->inputs(0));
    if (!x0.empty() && Commutative(op->fn()) && full(op->inputs(1))) {
      op->set_inputs(0, op->inputs(1));
      op->set_inputs(1, x0);
    }
  }
}

// A matmul that only multiplies (and scales by 1): no accumulation, no activation yet.
bool PlainMatmul(const v1::Op& op) {
  return op.kind() == v1::OP_MATMUL && !op.accumulate() && op.fn().empty() &&
         (op.alpha() == 0.0f || op.alpha() == 1.0f) && op.outputs_size() == 1;
}

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
    const int m = uses.Writer(product);
    if (m < 0 || deleted[m] || uses.boundary.count(product) || uses.NumReaders(product) != 1)
      continue;
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
// f32), so a bias or an accumulated gradient can join it in f32 next. One sweep.
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
    const int m = uses.Writer(product);
    if (m < 0 || deleted[m] || uses.boundary.count(product) || uses.NumReaders(product) != 1)
      continue;
    const v1::Op& matmul = ops->Get(m);
    auto pd = decls.find(product), qd = decls.find(q);
    if (deleted[m] || matmul.kind() != v1::OP_MATMUL || matmul.accumulate() ||
        !matmul.fn().empty() || pd == decls.end() || qd == decls.end() ||
        pd->second->dtype() != v1::DTYPE_BF16 || qd->second->dtype() != v1::DTYPE_F32 ||
        DimsOf(pd->second) != DimsOf(qd->second) || args.count(q) || !uses.Fixed(q)) {
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
    const int m = uses.Writer(product);
    if (m < 0 || deleted[m] || uses.boundary.count(product) || uses.NumReaders(product) != 1)
      continue;
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

// Deletes pure ops none of whose results is read or returned, and declarations of buffers that
// no op and no argument or result names any more.
void EliminateDeadCode(v1::ShardMapProgram* p) {
  std::set<std::string> boundary(p->inputs().begin(), p->inputs().end());
  boundary.insert(p->outputs().begin(), p->outputs().end());
  Ops* ops = p->mutable_program()->mutable_functions(0)->mutable_ops();
  std::map<std::string, int> reads;
  for (const v1::Op& op : *ops)
    for (const std::string& in : op.inputs()) ++reads[in];
  std::vector<bool> deleted(ops->size());
  for (int i = ops->size() - 1; i >= 0; --i) {
    const v1::Op& op = ops->Get(i);
    if (!IsPure(op)) continue;
    const bool dead = std::none_of(op.outputs().begin(), op.outputs().end(), [&](const auto& o) {
      return boundary.count(o) || reads[o] > 0;
    });
    if (!dead) continue;
    for (const std::string& in : op.inputs()) --reads[in];
    deleted[i] = true;
  }
  Compact(ops, deleted);
  EraseUnnamedBuffers(p);
}

}  // namespace

void EraseUnnamedBuffers(v1::ShardMapProgram* p) {
  std::set<std::string> named(p->inputs().begin(), p->inputs().end());
  named.insert(p->outputs().begin(), p->outputs().end());
  for (const v1::Op& op : p->program().functions(0).ops()) {
    named.insert(op.inputs().begin(), op.inputs().end());
    named.insert(op.outputs().begin(), op.outputs().end());
  }
  auto* buffers = p->mutable_program()->mutable_buffers();
  buffers->erase(std::remove_if(buffers->begin(), buffers->end(),
                                [&](const v1::BufferDecl& b) { return !named.count(b.name()); }),
                 buffers->end());
}

void SimplifyProgram(v1::ShardMapProgram* program) {
  if (program->program().functions_size() != 1) return;
  SliceBroadcasts(program);
  EliminateCommonSubexpressions(program);
  FoldConvertIntoMatmul(program);
  FoldBroadcasts(program);
  FuseMatmulBias(program);
  ReluGradFromOutput(program);
  FuseMatmulActivation(program);
  EliminateDeadCode(program);
}

}  // namespace meshrun
