// Algebraic simplification of a per-shard program (fusion.h): common subexpressions, broadcasts
// folded into the binary ops that read them, matmul + bias, bf16 round trips, dead ops and
// buffers.
#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/spmd/fusion.h"
#include "core/spmd/simplify_internal.h"

namespace meshrun {
namespace {

using simplify_internal::Compact;
using simplify_internal::Decls;
using simplify_internal::DimsOf;
using simplify_internal::IsPure;
using simplify_internal::Ops;
using simplify_internal::Uses;

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

// `c = convert(convert(a, bf16), f32)`, a f32, whose bf16 value only that second convert reads
// and the caller does not see, becomes `c = round_bf16(a)` (OP_UNARY; RoundToBf16,
// core/float_ops.h: the same bits) in the first convert's place, where a is read as before: one
// pass over the elements instead of two, no bf16 buffer, and an f32 op that FuseElementwise takes
// into a loop with its neighbours (a bf16 computation widened to f32 rounds each result so).
// c is then written earlier: it must be written by the second convert alone, read by nothing
// before it, and not be an argument.
void FoldBf16RoundTrips(v1::ShardMapProgram* p) {
  const Uses uses(*p);
  const auto decls = Decls(p->program());
  const std::set<std::string> arguments(p->inputs().begin(), p->inputs().end());
  Ops* ops = p->mutable_program()->mutable_functions(0)->mutable_ops();
  auto decl = [&](const std::string& name) -> const v1::BufferDecl* {
    auto d = decls.find(name);
    return d == decls.end() ? nullptr : d->second;
  };
  auto is = [&](const std::string& name, v1::DType dtype) {
    const v1::BufferDecl* d = decl(name);
    return d != nullptr && d->dtype() == dtype;
  };
  auto convert = [](const v1::Op& op) {
    return op.kind() == v1::OP_CONVERT && op.inputs_size() == 1 && op.outputs_size() == 1;
  };
  std::vector<bool> deleted(ops->size());
  for (int j = 0; j < ops->size(); ++j) {
    if (!convert(ops->Get(j))) continue;
    const std::string a = ops->Get(j).inputs(0), b = ops->Get(j).outputs(0);
    if (!is(a, v1::DTYPE_F32) || !is(b, v1::DTYPE_BF16) || uses.PrivateWriter(b) != j) continue;
    const int i = uses.readers.at(b)[0];
    if (i <= j || !convert(ops->Get(i))) continue;
    const std::string c = ops->Get(i).outputs(0);
    if (!is(c, v1::DTYPE_F32) || arguments.count(c) || uses.Writer(c) != i ||
        DimsOf(decl(c)) != DimsOf(decl(a))) {
      continue;
    }
    auto r = uses.readers.find(c);
    if (r != uses.readers.end() &&
        std::any_of(r->second.begin(), r->second.end(), [&](int k) { return k <= i; })) {
      continue;
    }
    v1::Op round;
    round.set_kind(v1::OP_UNARY);
    round.set_fn("round_bf16");
    round.add_inputs(a);
    round.add_outputs(c);
    *ops->Mutable(j) = std::move(round);
    deleted[i] = true;
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
  simplify_internal::FoldConvertIntoMatmul(program);
  FoldBroadcasts(program);
  simplify_internal::FuseMatmulBias(program);
  simplify_internal::ReluGradFromOutput(program);
  simplify_internal::FuseMatmulActivation(program);
  FoldBf16RoundTrips(program);
  EliminateDeadCode(program);
}

}  // namespace meshrun
