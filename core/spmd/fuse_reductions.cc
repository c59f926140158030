// All-reductions fused with the element-wise update that consumes them (fusion.h's
// FuseReductionsIntoUpdates).
#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/spmd/fusion.h"

namespace meshrun {
namespace {

using Ops = google::protobuf::RepeatedPtrField<v1::Op>;
using AxisSet = std::set<std::string>;

bool Contains(const Ops& ops, int begin, int end, const std::string& name, bool outputs) {
  for (int i = begin; i < end; ++i) {
    const auto& names = outputs ? ops.Get(i).outputs() : ops.Get(i).inputs();
    if (std::find(names.begin(), names.end(), name) != names.end()) return true;
  }
  return false;
}

// The mesh axes each buffer may differ over between the devices of the program (shard_map's
// varying axes, as JAX's check_rep infers replication): an argument varies over the axes its
// in_spec names, axis_index and per-device random draws over theirs, psum / pmean / pmax and
// all_gather make their result the same over their axes, psum_scatter, ppermute and all_to_all
// make it differ; any other op's results vary over what its inputs vary over. A buffer written by
// several ops varies over the union. Conservative: a buffer may be marked varying where it is not.
class Varying {
 public:
  explicit Varying(const v1::ShardMapProgram& p) {
    for (int i = 0; i < p.inputs_size() && i < p.in_specs_size(); ++i) {
      for (const v1::PartitionSpecEntry& e : p.in_specs(i).entries())
        axes_[p.inputs(i)].insert(e.axis_names().begin(), e.axis_names().end());
    }
    // Arguments without a spec: varying over every axis named anywhere.
    AxisSet all;
    for (const v1::Op& op : p.program().functions(0).ops())
      all.insert(op.axis_names().begin(), op.axis_names().end());
    for (int i = p.in_specs_size(); i < p.inputs_size(); ++i) axes_[p.inputs(i)] = all;
    for (bool changed = true; changed;) {  // monotone: at most one pass per buffer and axis
      changed = false;
      for (const v1::Op& op : p.program().functions(0).ops()) changed |= Propagate(op);
    }
  }

  bool InvariantOver(const std::string& buffer, const AxisSet& axes) const {
    auto it = axes_.find(buffer);
    if (it == axes_.end()) return true;
    for (const std::string& a : axes) {
      if (it->second.count(a)) return false;
    }
    return true;
  }

 private:
  AxisSet Of(const std::string& name) const {
    auto it = axes_.find(name);
    return it == axes_.end() ? AxisSet() : it->second;
  }

  // An unreduced fused element-wise op: each output varies over what the inputs its
  // instructions read vary over (a chain computing several optimizer states reads the gradient
  // for some of them only).
  bool PropagateFused(const v1::Op& op) {
    const int n = op.inputs_size();
    AxisSet all;  // for an argument out of range (the executor refuses the op)
    for (const std::string& name : op.inputs()) {
      const AxisSet a = Of(name);
      all.insert(a.begin(), a.end());
    }
    std::vector<AxisSet> results;
    for (const v1::FusedInstr& f : op.fused()) {
      AxisSet axes;
      for (int a : f.args()) {
        const bool earlier = a >= n && a - n < static_cast<int>(results.size());
        const AxisSet from = a >= 0 && a < n ? Of(op.inputs(a)) : earlier ? results[a - n] : all;
        axes.insert(from.begin(), from.end());
      }
      results.push_back(std::move(axes));
    }
    bool changed = false;
    for (int o = 0; o < op.outputs_size() && o < op.fused_outputs_size(); ++o) {
      const int k = op.fused_outputs(o);
      const AxisSet& from = k >= 0 && k < static_cast<int>(results.size()) ? results[k] : all;
      AxisSet& out = axes_[op.outputs(o)];
      const size_t before = out.size();
      out.insert(from.begin(), from.end());
      changed |= out.size() != before;
    }
    return changed;
  }

  bool Propagate(const v1::Op& op) {
    if (op.kind() == v1::OP_FUSED_ELEMENTWISE && op.axis_names_size() == 0 &&
        op.fused_outputs_size() == op.outputs_size()) {
      return PropagateFused(op);
    }
    AxisSet in;
    for (const std::string& name : op.inputs()) {
      auto it = axes_.find(name);
      if (it != axes_.end()) in.insert(it->second.begin(), it->second.end());
    }
    const AxisSet own(op.axis_names().begin(), op.axis_names().end());
    switch (op.kind()) {
      case v1::OP_PSUM:
      case v1::OP_PMEAN:
      case v1::OP_PMAX:
      case v1::OP_ALL_GATHER:
        for (const std::string& a : own) in.erase(a);
        break;
      case v1::OP_ADAM_UPDATE:  // the gradient's partial sum over the grad axes counts as varying
      case v1::OP_FUSED_ELEMENTWISE:
      case v1::OP_AXIS_INDEX:
      case v1::OP_PSUM_SCATTER:
      case v1::OP_PPERMUTE:
      case v1::OP_ALL_TO_ALL:
        in.insert(own.begin(), own.end());
        break;
      default:
        break;
    }
    for (const v1::PartitionSpecEntry& e : op.spec().entries())  // per-device blocks of a draw
      in.insert(e.axis_names().begin(), e.axis_names().end());
    bool changed = false;
    for (const std::string& name : op.outputs()) {
      AxisSet& out = axes_[name];
      const size_t before = out.size();
      out.insert(in.begin(), in.end());
      changed |= out.size() != before;
    }
    return changed;
  }

  std::map<std::string, AxisSet> axes_;
};

class ReductionFuser {
 public:
  explicit ReductionFuser(v1::ShardMapProgram* p) : p_(p), varying_(*p) {
    for (const v1::BufferDecl& b : p->program().buffers()) decls_[b.name()] = &b;
    boundary_.insert(p->inputs().begin(), p->inputs().end());
    boundary_.insert(p->outputs().begin(), p->outputs().end());
    for (const v1::Op& op : ops()) {
      for (const std::string& o : op.outputs()) ++writes_[o];
      for (const std::string& i : op.inputs()) ++reads_[i];
      if (MayBeView(op)) {
        for (const std::string& name : op.inputs()) Join(name, op.outputs(0));
        for (const std::string& name : op.outputs()) Join(name, op.outputs(0));
      }
    }
  }

  void Run() {
    Ops* ops = p_->mutable_program()->mutable_functions(0)->mutable_ops();
    std::vector<bool> dropped(ops->size(), false);
    for (int i = 0; i < ops->size(); ++i) {
      const int f = Consumer(*ops, i);
      if (f < 0) continue;
      const v1::Op& reduce = ops->Get(i);
      Fuse(reduce, ops->Mutable(f));
      dropped[i] = true;
    }
    Ops kept;
    for (int i = 0; i < ops->size(); ++i) {
      if (!dropped[i]) *kept.Add() = std::move(*ops->Mutable(i));
    }
    *ops = std::move(kept);
    EraseUnnamedBuffers(p_);
  }

 private:
  const Ops& ops() const { return p_->program().functions(0).ops(); }
  int Count(const std::map<std::string, int>& m, const std::string& name) const {
    auto it = m.find(name);
    return it == m.end() ? 0 : it->second;
  }
  bool F32(const std::string& name) const {
    auto it = decls_.find(name);
    return it != decls_.end() && it->second->dtype() == v1::DTYPE_F32;
  }
  bool SameShape(const std::string& a, const std::string& b) const {
    auto x = decls_.find(a), y = decls_.find(b);
    if (x == decls_.end() || y == decls_.end()) return false;
    const auto &dx = x->second->shape().dims(), &dy = y->second->shape().dims();
    return std::equal(dx.begin(), dx.end(), dy.begin(), dy.end());
  }

  // Buffers that may share memory (a reshape, slice or concatenation may be a view) form one set.
  std::string Root(const std::string& name) const {
    std::string at = name;
    for (auto it = alias_parent_.find(at); it != alias_parent_.end() && it->second != at;
         it = alias_parent_.find(at)) {
      at = it->second;
    }
    return at;
  }
  void Join(const std::string& a, const std::string& b) {
    alias_parent_.emplace(a, a);
    alias_parent_.emplace(b, b);
    const std::string ra = Root(a), rb = Root(b);
    if (ra != rb) alias_parent_[ra] = rb;
  }
  static bool MayBeView(const v1::Op& op) {
    return op.kind() == v1::OP_RESHAPE || op.kind() == v1::OP_SLICE ||
           op.kind() == v1::OP_DYNAMIC_SLICE || op.kind() == v1::OP_CONCATENATE;
  }
  // Whether ops [begin, end) write `name` or a buffer that may share its memory. The op that
  // makes a view (the only writer of its output) writes none: it is the view or copies into a
  // buffer of its own.
  bool WritesAlias(const Ops& ops, int begin, int end, const std::string& name) const {
    const std::string root = Root(name);
    for (int i = begin; i < end; ++i) {
      for (const std::string& o : ops.Get(i).outputs()) {
        if (MayBeView(ops.Get(i)) && o != name && Count(writes_, o) == 1) continue;
        if (Root(o) == root) return true;
      }
    }
    return false;
  }

  // The index of the fused element-wise op that op `i`, a psum or pmean of x into r, can join,
  // or -1: r is read by that op alone and shares memory with no other buffer; neither x nor a
  // buffer that may share its memory is written from op i up to it; every other input of the op is
  // the same over the reduction's axes.
  int Consumer(const Ops& ops, int i) const {
    const v1::Op& reduce = ops.Get(i);
    if ((reduce.kind() != v1::OP_PSUM && reduce.kind() != v1::OP_PMEAN) ||
        reduce.inputs_size() != 1 || reduce.outputs_size() != 1 || reduce.axis_names_size() == 0 ||
        !reduce.fn().empty()) {
      return -1;
    }
    const std::string &x = reduce.inputs(0), &r = reduce.outputs(0);
    if (x == r || !F32(x) || !F32(r) || !SameShape(x, r) || boundary_.count(x) ||
        boundary_.count(r) || alias_parent_.count(r) || Count(writes_, r) != 1 ||
        Count(reads_, r) != 1) {
      return -1;
    }
    int f = i + 1;
    while (f < ops.size() && !Contains(ops, f, f + 1, r, /*outputs=*/false)) ++f;
    if (f == ops.size()) return -1;
    const v1::Op& update = ops.Get(f);
    if (update.kind() != v1::OP_FUSED_ELEMENTWISE || update.axis_names_size() > 0 ||
        update.outputs_size() == 0 || !SameShape(r, update.outputs(0)) ||
        WritesAlias(ops, i + 1, f + 1, x)) {
      return -1;
    }
    const AxisSet axes(reduce.axis_names().begin(), reduce.axis_names().end());
    for (const std::string& in : update.inputs()) {
      if (in == x || (in != r && !varying_.InvariantOver(in, axes))) return -1;
    }
    return f;
  }

  // `update` reads x (the reduction's operand) as its input 0 instead of r, and reduces it first.
  static void Fuse(const v1::Op& reduce, v1::Op* update) {
    const std::string& r = reduce.outputs(0);
    const int k = static_cast<int>(std::find(update->inputs().begin(), update->inputs().end(), r) -
                                   update->inputs().begin());
    // Input k moves to the front: inputs before it shift up by one.
    auto renumber = [k](int a) { return a == k ? 0 : a < k ? a + 1 : a; };
    const int n = update->inputs_size();
    for (v1::FusedInstr& instr : *update->mutable_fused()) {
      for (int& a : *instr.mutable_args()) {
        if (a < n) a = renumber(a);
      }
    }
    std::vector<std::string> inputs(update->inputs().begin(), update->inputs().end());
    inputs.erase(inputs.begin() + k);
    inputs.insert(inputs.begin(), reduce.inputs(0));
    update->clear_inputs();
    for (const std::string& name : inputs) update->add_inputs(name);
    *update->mutable_axis_names() = reduce.axis_names();
    update->set_fn(reduce.kind() == v1::OP_PSUM ? "sum" : "mean");
  }

  v1::ShardMapProgram* p_;
  Varying varying_;
  std::map<std::string, const v1::BufferDecl*> decls_;
  std::set<std::string> boundary_;
  std::map<std::string, std::string> alias_parent_;  // union-find over memory-sharing buffers
  std::map<std::string, int> writes_, reads_;
};

}  // namespace

void FuseReductionsIntoUpdates(v1::ShardMapProgram* program) {
  if (program->program().functions_size() != 1) return;
  ReductionFuser(program).Run();
}

}  // namespace meshrun
