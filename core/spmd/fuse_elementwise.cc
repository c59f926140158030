// Loop fusion of element-wise ops (fusion.h's FuseElementwise).
#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/spmd/fusion.h"

namespace meshrun {
namespace {

using Ops = google::protobuf::RepeatedPtrField<v1::Op>;

bool ExactFn(const v1::Op& op) {
  static const std::set<std::string> binary = {"add", "sub", "mul", "div", "max", "min",
                                               "eq",  "ne",  "lt",  "le",  "gt",  "ge"};
  static const std::set<std::string> unary = {"neg", "abs", "square", "sqrt", "round_bf16"};
  if (op.kind() == v1::OP_BINARY) return op.inputs_size() == 2 && binary.count(op.fn());
  if (op.kind() == v1::OP_UNARY) return op.inputs_size() == 1 && unary.count(op.fn());
  return op.kind() == v1::OP_SELECT && op.inputs_size() == 3;
}

bool SameShape(const v1::BufferDecl& a, const v1::BufferDecl& b) {
  return std::equal(a.shape().dims().begin(), a.shape().dims().end(), b.shape().dims().begin(),
                    b.shape().dims().end());
}

int64_t NumElements(const v1::BufferDecl& b) {
  int64_t n = 1;
  for (int64_t d : b.shape().dims()) n *= d;
  return n;
}

class Fuser {
 public:
  explicit Fuser(v1::ShardMapProgram* p) : p_(p) {
    for (const v1::BufferDecl& b : p->program().buffers()) decls_[b.name()] = &b;
    boundary_.insert(p->inputs().begin(), p->inputs().end());
    boundary_.insert(p->outputs().begin(), p->outputs().end());
    for (const v1::Op& op : ops()) {
      for (const std::string& o : op.outputs()) ++writes_[o];
      for (const std::string& i : op.inputs()) ++reads_[i];
    }
  }

  void Run() {
    Ops out;
    std::vector<int> run;
    const Ops& in = ops();
    for (int i = 0; i <= in.size(); ++i) {
      if (i < in.size() &&
          (Candidate(in.Get(i)) || MovableFill(in.Get(i)) || ScalarView(in.Get(i)))) {
        run.push_back(i);
        continue;
      }
      if (i < in.size() && Hoistable(in.Get(i), run)) {  // runs before the run: it goes on
        *out.Add() = in.Get(i);
        continue;
      }
      EmitRun(run, &out);
      run.clear();
      if (i < in.size()) *out.Add() = in.Get(i);
    }
    *p_->mutable_program()->mutable_functions(0)->mutable_ops() = std::move(out);
    EraseUnnamedBuffers(p_);  // the buffers of results read only inside a group
  }

 private:
  const Ops& ops() const { return p_->program().functions(0).ops(); }
  const v1::BufferDecl* Decl(const std::string& name) const {
    auto it = decls_.find(name);
    return it == decls_.end() ? nullptr : it->second;
  }
  // Written by one op, and not an argument (which an op would update in place).
  bool WrittenOnce(const std::string& name) const {
    auto it = writes_.find(name);
    return it != writes_.end() && it->second == 1 &&
           std::find(p_->inputs().begin(), p_->inputs().end(), name) == p_->inputs().end();
  }
  // An exact f32 element-wise op whose operands have its output's shape or one element.
  bool Candidate(const v1::Op& op) const {
    if (!ExactFn(op) || op.outputs_size() != 1) return false;
    const v1::BufferDecl* o = Decl(op.outputs(0));
    if (o == nullptr || o->dtype() != v1::DTYPE_F32 || !WrittenOnce(op.outputs(0))) return false;
    for (const std::string& name : op.inputs()) {
      const v1::BufferDecl* b = Decl(name);
      if (b == nullptr || b->dtype() != v1::DTYPE_F32) return false;
      if (NumElements(*b) != 1 && !SameShape(*b, *o)) return false;
      if (name == op.outputs(0)) return false;
    }
    return true;
  }
  // A fill of a fresh buffer: it reads nothing, so it can run earlier.
  bool MovableFill(const v1::Op& op) const {
    return op.kind() == v1::OP_FILL_VALUE && op.inputs_size() == 0 && op.outputs_size() == 1 &&
           WrittenOnce(op.outputs(0));
  }
  // A pure op on one-element values alone (a scalar made [1, 1], an optimizer's bias
  // correction, a step count converted): it runs with the run's one-element results, before
  // the groups that read it, whatever its fn.
  bool ScalarView(const v1::Op& op) const {
    const v1::OpKind k = op.kind();
    if ((k != v1::OP_RESHAPE && k != v1::OP_BROADCAST && k != v1::OP_BINARY && k != v1::OP_UNARY &&
         k != v1::OP_CONVERT && k != v1::OP_SELECT) ||
        op.outputs_size() != 1 || !WrittenOnce(op.outputs(0))) {
      return false;
    }
    const v1::BufferDecl* y = Decl(op.outputs(0));
    if (y == nullptr || NumElements(*y) != 1) return false;
    for (const std::string& name : op.inputs()) {
      const v1::BufferDecl* x = Decl(name);
      if (x == nullptr || NumElements(*x) != 1 || name == op.outputs(0)) return false;
    }
    return true;
  }

  // An all-reduce that touches nothing the run's ops read or write: it may run before them, so
  // that the element-wise ops on either side of it fuse (an optimizer's update of one parameter
  // with its states', around the all-reduce of the next parameter's gradient).
  bool Hoistable(const v1::Op& op, const std::vector<int>& run) const {
    const v1::OpKind k = op.kind();
    if ((k != v1::OP_PSUM && k != v1::OP_PMEAN && k != v1::OP_PMAX) || op.inputs_size() != 1 ||
        op.outputs_size() != 1 || !WrittenOnce(op.outputs(0)) || run.empty()) {
      return false;
    }
    for (int j : run) {
      const v1::Op& r = ops().Get(j);
      for (const std::string& o : r.outputs()) {
        if (o == op.inputs(0) || o == op.outputs(0)) return false;
      }
      for (const std::string& name : r.inputs()) {
        if (name == op.outputs(0)) return false;
      }
    }
    return true;
  }

  void EmitRun(const std::vector<int>& run, Ops* out) {
    const Ops& in = ops();
    // Fills first, then the one-element results, then each shape's group.
    std::vector<std::vector<int>> groups;
    std::map<std::string, size_t> group_of;  // shape key -> index in groups
    for (int i : run) {
      if (MovableFill(in.Get(i))) *out->Add() = in.Get(i);
    }
    for (int i : run) {
      const v1::Op& op = in.Get(i);
      if (MovableFill(op)) continue;
      const v1::BufferDecl* o = Decl(op.outputs(0));
      if (ScalarView(op) || NumElements(*o) == 1) {
        *out->Add() = op;
        continue;
      }
      std::string key;
      for (int64_t d : o->shape().dims()) absl::StrAppend(&key, d, ",");
      auto [it, fresh] = group_of.emplace(key, groups.size());
      if (fresh) groups.emplace_back();
      groups[it->second].push_back(i);
    }
    for (const std::vector<int>& g : groups) {
      if (g.size() < 2) {
        *out->Add() = in.Get(g[0]);
      } else {
        *out->Add() = Fuse(g);
      }
    }
  }

  v1::Op Fuse(const std::vector<int>& group) const {
    const Ops& in = ops();
    v1::Op fused;
    fused.set_kind(v1::OP_FUSED_ELEMENTWISE);
    std::map<std::string, int> result_of;                 // a member's output -> its instr index
    std::map<std::string, int> input_of;                  // an outside buffer -> its input index
    std::vector<std::vector<std::pair<bool, int>>> args;  // (is_result, index) per instr
    for (size_t k = 0; k < group.size(); ++k) {
      const v1::Op& op = in.Get(group[k]);
      std::vector<std::pair<bool, int>> a;
      for (const std::string& name : op.inputs()) {
        auto r = result_of.find(name);
        if (r != result_of.end()) {
          a.push_back({true, r->second});
          continue;
        }
        auto [it, fresh] = input_of.emplace(name, fused.inputs_size());
        if (fresh) fused.add_inputs(name);
        a.push_back({false, it->second});
      }
      args.push_back(std::move(a));
      result_of[op.outputs(0)] = static_cast<int>(k);
    }
    const int n = fused.inputs_size();
    std::map<std::string, int> inside;  // reads of each buffer by the group's members
    for (int m : group)
      for (const std::string& name : in.Get(m).inputs()) ++inside[name];
    for (size_t k = 0; k < group.size(); ++k) {
      const v1::Op& op = in.Get(group[k]);
      v1::FusedInstr* instr = fused.add_fused();
      instr->set_fn(op.kind() == v1::OP_SELECT ? "select" : op.fn());
      for (auto [is_result, index] : args[k]) instr->add_args(is_result ? n + index : index);
      // Kept when anything outside the group reads it, or the caller sees it.
      const std::string& o = op.outputs(0);
      auto r = reads_.find(o);
      const int total = r == reads_.end() ? 0 : r->second;
      auto i = inside.find(o);
      if (boundary_.count(o) || total > (i == inside.end() ? 0 : i->second)) {
        fused.add_outputs(o);
        fused.add_fused_outputs(static_cast<int>(k));
      }
    }
    return fused;
  }

  v1::ShardMapProgram* p_;
  std::map<std::string, const v1::BufferDecl*> decls_;
  std::set<std::string> boundary_;
  std::map<std::string, int> writes_, reads_;
};

}  // namespace

void FuseElementwise(v1::ShardMapProgram* program) {
  if (program->program().functions_size() != 1) return;
  Fuser(program).Run();
}

}  // namespace meshrun
