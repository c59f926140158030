#include "worker/combine_reductions.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/tensor.h"

namespace meshrun {
namespace {

int64_t Bytes(const v1::BufferDecl& d) {
  return NumElements(Dims(d.shape().dims().begin(), d.shape().dims().end())) *
         static_cast<int64_t>(DTypeSize(d.dtype()));
}

bool Combinable(const v1::Op& op, const std::map<std::string, v1::BufferDecl>& decls,
                size_t max_bytes) {
  if (op.kind() != v1::OP_PSUM && op.kind() != v1::OP_PMEAN) return false;
  if (op.inputs_size() != 1 || op.outputs_size() != 1 || op.inputs(0) == op.outputs(0))
    return false;
  auto it = decls.find(op.inputs(0));
  return it != decls.end() && it->second.dtype() == v1::DTYPE_F32 &&
         Bytes(it->second) < static_cast<int64_t>(max_bytes);
}

// Step 1: small fused updates (Adam's, and element-wise ones over axes) become a reduction and
// an update. The updates of a run of consecutive Adam updates are independent of each other, so
// the run's reductions go first and its updates after them, where step 2 finds the reductions
// side by side.
void SplitSmallUpdates(v1::StepProgram* program, size_t max_bytes, size_t direct_min_bytes) {
  std::map<std::string, v1::BufferDecl> decls;
  for (const v1::BufferDecl& d : program->buffers()) decls[d.name()] = d;
  v1::Function* f = program->mutable_functions(0);
  // The run's updates: those that reduce their gradient themselves first, then the split ones,
  // so that step 3 finds the combined reductions next to a fused update.
  google::protobuf::RepeatedPtrField<v1::Op> out, fused, updates;
  auto end_run = [&] {
    for (v1::Op& u : fused) *out.Add() = std::move(u);
    for (v1::Op& u : updates) *out.Add() = std::move(u);
    fused.Clear();
    updates.Clear();
  };
  // Whether the update `op` reduces its partial operand (input `p`) itself but should not.
  auto small = [&](const v1::Op& op, int p) {
    const auto partial = p < op.inputs_size() ? decls.find(op.inputs(p)) : decls.end();
    return op.axis_names_size() > 0 && partial != decls.end() &&
           (op.fn() == "sum" || op.fn() == "mean") &&
           Bytes(partial->second) < static_cast<int64_t>(max_bytes) &&
           (direct_min_bytes == 0 ||
            Bytes(partial->second) < static_cast<int64_t>(direct_min_bytes));
  };
  // Emits the reduction of `update`'s input `p` into a new buffer, which the update then reads.
  // Each split has its own buffer: two updates may reduce the same operand (a comparison and a
  // select over one partial sum), and that operand may be rewritten in between.
  auto split = [&](v1::Op* update, int p) {
    v1::BufferDecl reduced = decls.at(update->inputs(p));
    std::string name = absl::StrCat(update->inputs(p), "/reduced");
    for (int k = 2; decls.count(name) > 0; ++k)
      name = absl::StrCat(update->inputs(p), "/reduced", k);
    reduced.set_name(name);
    decls[name] = reduced;
    *program->add_buffers() = reduced;
    v1::Op* reduce = out.Add();
    reduce->set_kind(update->fn() == "sum" ? v1::OP_PSUM : v1::OP_PMEAN);
    reduce->add_inputs(update->inputs(p));
    reduce->add_outputs(reduced.name());
    *reduce->mutable_axis_names() = update->axis_names();
    update->set_inputs(p, reduced.name());
    update->clear_axis_names();
    update->clear_fn();
  };
  for (const v1::Op& op : f->ops()) {
    if (op.kind() == v1::OP_FUSED_ELEMENTWISE && small(op, 0)) {
      end_run();
      v1::Op update = op;
      split(&update, 0);
      *out.Add() = std::move(update);
      continue;
    }
    if (op.kind() != v1::OP_ADAM_UPDATE) {
      end_run();
      *out.Add() = op;
      continue;
    }
    if (op.inputs_size() != 5 || !small(op, 1)) {
      *fused.Add() = op;
      continue;
    }
    v1::Op* update = updates.Add();
    *update = op;
    split(update, 1);
  }
  end_run();
  *f->mutable_ops() = std::move(out);
}

// A reduction that may ride along with a fused Adam update: f32 operands, none its own result,
// an OP_PSUM / OP_PMEAN of one or a combined OP_PSUM of several ('s' or 'm' each). Its letters.
std::optional<std::string> RiderLetters(const v1::Op& op,
                                        const std::map<std::string, v1::BufferDecl>& decls,
                                        size_t max_bytes) {
  if (op.kind() != v1::OP_PSUM && op.kind() != v1::OP_PMEAN) return std::nullopt;
  if (op.inputs_size() == 0 || op.inputs_size() != op.outputs_size()) return std::nullopt;
  std::string letters = op.fn();
  if (op.inputs_size() == 1 && letters.empty()) letters = op.kind() == v1::OP_PMEAN ? "m" : "s";
  if (static_cast<int>(letters.size()) != op.inputs_size() ||
      letters.find_first_not_of("sm") != std::string::npos ||
      (op.kind() == v1::OP_PMEAN && letters != "m")) {
    return std::nullopt;
  }
  int64_t total = 0;
  for (int i = 0; i < op.inputs_size(); ++i) {
    auto in = decls.find(op.inputs(i)), out = decls.find(op.outputs(i));
    if (in == decls.end() || out == decls.end() || in->second.dtype() != v1::DTYPE_F32 ||
        op.inputs(i) == op.outputs(i)) {
      return std::nullopt;
    }
    total += Bytes(in->second);
  }
  if (total >= static_cast<int64_t>(max_bytes)) return std::nullopt;
  return letters;
}

// An update that reduces its partial operand single-copy over its axes (the executor's test:
// at least `direct_min_bytes`), with no riders yet: an Adam update (the gradient, input 1) or an
// element-wise one (input 0).
bool FusedDirectUpdate(const v1::Op& op, const std::map<std::string, v1::BufferDecl>& decls,
                       size_t direct_min_bytes) {
  if (op.axis_names_size() == 0 || (op.fn() != "sum" && op.fn() != "mean")) return false;
  const bool adam =
      op.kind() == v1::OP_ADAM_UPDATE && op.inputs_size() == 5 && op.outputs_size() == 3;
  const bool elementwise = op.kind() == v1::OP_FUSED_ELEMENTWISE && op.inputs_size() > 0 &&
                           op.outputs_size() == op.fused_outputs_size();
  if (!adam && !elementwise) return false;
  auto grad = decls.find(op.inputs(adam ? 1 : 0));
  return grad != decls.end() && Bytes(grad->second) >= static_cast<int64_t>(direct_min_bytes);
}

// Whether `r` may run inside `update` (just before or after it): neither reads what the other
// writes.
bool Independent(const v1::Op& r, const v1::Op& update) {
  std::set<std::string> written(update.outputs().begin(), update.outputs().end());
  std::set<std::string> touched = written;
  touched.insert(update.inputs().begin(), update.inputs().end());
  for (const std::string& y : r.outputs()) {
    if (touched.count(y)) return false;
  }
  for (const std::string& x : r.inputs()) {
    if (written.count(x)) return false;
  }
  return true;
}

// Step 3: a small reduction right before or after a fused single-copy update over the same
// axes joins it (its operands and results appended, fn "<grad>:<letters>"), so both are one
// meeting of the group instead of two: the executor sums them in the update's session.
void JoinReductionsToDirectUpdates(v1::StepProgram* program, size_t max_bytes,
                                   size_t direct_min_bytes) {
  if (direct_min_bytes == 0) return;
  std::map<std::string, v1::BufferDecl> decls;
  for (const v1::BufferDecl& d : program->buffers()) decls[d.name()] = d;
  v1::Function* f = program->mutable_functions(0);
  google::protobuf::RepeatedPtrField<v1::Op> out;
  auto join = [](v1::Op* update, const v1::Op& r, const std::string& letters) {
    for (const std::string& x : r.inputs()) update->add_inputs(x);
    for (const std::string& y : r.outputs()) update->add_outputs(y);
    update->set_fn(absl::StrCat(update->fn(), ":", letters));
  };
  const auto& ops = f->ops();
  for (int i = 0; i < ops.size(); ++i) {
    const v1::Op& op = ops[i];
    const std::optional<std::string> letters = RiderLetters(op, decls, max_bytes);
    auto fits = [&](const v1::Op& u) {
      return FusedDirectUpdate(u, decls, direct_min_bytes) &&
             absl::StrJoin(u.axis_names(), ",") == absl::StrJoin(op.axis_names(), ",") &&
             Independent(op, u);
    };
    if (letters && !out.empty() && fits(out[out.size() - 1])) {
      join(&out[out.size() - 1], op, *letters);
    } else if (letters && i + 1 < ops.size() && fits(ops[i + 1])) {
      v1::Op* update = out.Add();
      *update = ops[i + 1];
      join(update, op, *letters);
      ++i;
    } else {
      *out.Add() = op;
    }
  }
  *f->mutable_ops() = std::move(out);
}

// A combined reduction: its operands and results in order, each a sum or a mean.
struct Group {
  std::string axes;
  v1::Op op;                 // OP_PSUM; fn: one letter per operand, 's' sum or 'm' mean
  std::vector<int> members;  // their indices in the program
};

void AddMember(Group* g, const v1::Op& r) {
  g->op.add_inputs(r.inputs(0));
  g->op.add_outputs(r.outputs(0));
  g->op.set_fn(g->op.fn() + (r.kind() == v1::OP_PMEAN ? "m" : "s"));
}

}  // namespace

void CombineReductions(v1::StepProgram* program, size_t max_bytes, size_t direct_min_bytes) {
  if (program->functions_size() != 1 || max_bytes == 0) return;
  SplitSmallUpdates(program, max_bytes, direct_min_bytes);
  std::map<std::string, v1::BufferDecl> decls;
  for (const v1::BufferDecl& d : program->buffers()) decls[d.name()] = d;
  const auto& ops = program->functions(0).ops();
  std::map<std::string, std::vector<int>> writers;
  for (int i = 0; i < ops.size(); ++i) {
    for (const std::string& o : ops[i].outputs()) writers[o].push_back(i);
  }
  // The combinable reductions, in order, with their axes and their operand's writers (a flush
  // looks at these alone: linear in the reductions, not in the program, per flush).
  std::vector<int> candidates;
  std::vector<char> combinable(ops.size(), 0);
  std::vector<std::string> axes_of(ops.size());
  std::vector<const std::vector<int>*> operand_writers(ops.size(), nullptr);
  for (int i = 0; i < ops.size(); ++i) {
    if (!Combinable(ops[i], decls, max_bytes)) continue;
    candidates.push_back(i);
    combinable[i] = 1;
    axes_of[i] = absl::StrJoin(ops[i].axis_names(), ",");
    auto w = writers.find(ops[i].inputs(0));
    if (w != writers.end()) operand_writers[i] = &w->second;
  }
  std::vector<char> taken(ops.size(), 0);  // 0: to do, 2: pending in a group, 1: emitted
  google::protobuf::RepeatedPtrField<v1::Op> out;
  std::vector<Group> pending;  // by axes, in the order of their first member
  // Emits group `g` before op `at`, with every later reduction over its axes whose operand is
  // final by then (all its writers are before `at` and emitted): it moves up to join.
  auto flush = [&](size_t g, int at) {
    Group group = std::move(pending[g]);
    pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(g));
    for (int m : group.members) taken[m] = 1;
    // Not a reduction of one of the group's own results: that one needs the group done first.
    std::set<int> in_group(group.members.begin(), group.members.end());
    for (auto c = std::lower_bound(candidates.begin(), candidates.end(), at); c != candidates.end();
         ++c) {
      const int j = *c;
      if (taken[j] || axes_of[j] != group.axes) continue;
      bool ready = true;
      if (operand_writers[j] != nullptr) {
        for (int w : *operand_writers[j])
          ready = ready && w < at && taken[w] != 2 && !in_group.count(w);
      }
      if (!ready) continue;
      AddMember(&group, ops[j]);
      in_group.insert(j);
      taken[j] = 1;  // emitted with the group
    }
    if (group.op.inputs_size() == 1) {  // alone: as it was
      group.op.set_kind(group.op.fn() == "m" ? v1::OP_PMEAN : v1::OP_PSUM);
      group.op.clear_fn();
    }
    *out.Add() = std::move(group.op);
  };
  for (int i = 0; i < ops.size(); ++i) {
    if (taken[i]) continue;
    const v1::Op& op = ops[i];
    // A pending reduction runs before the first op that reads one of its results or writes one
    // of its operands or results, a reduction included (a psum of a psum's result waits for it).
    std::set<std::string> touched(op.inputs().begin(), op.inputs().end());
    touched.insert(op.outputs().begin(), op.outputs().end());
    for (size_t g = 0; g < pending.size();) {
      const v1::Op& r = pending[g].op;
      bool needed = false;
      for (const std::string& b : r.outputs()) needed = needed || touched.count(b) > 0;
      for (const std::string& b : op.outputs()) {
        for (const std::string& in : r.inputs()) needed = needed || b == in;
      }
      if (!needed) {
        ++g;
        continue;
      }
      flush(g, i);
    }
    if (combinable[i]) {
      const std::string& axes = axes_of[i];
      auto it = std::find_if(pending.begin(), pending.end(),
                             [&](const Group& g) { return g.axes == axes; });
      if (it == pending.end()) {
        Group g{axes, {}, {}};
        g.op.set_kind(v1::OP_PSUM);
        *g.op.mutable_axis_names() = op.axis_names();
        pending.push_back(std::move(g));
        it = pending.end() - 1;
      }
      AddMember(&*it, op);
      it->members.push_back(i);
      taken[i] = 2;  // pending: not yet emitted
      continue;
    }
    *out.Add() = op;
  }
  while (!pending.empty()) flush(0, ops.size());
  *program->mutable_functions(0)->mutable_ops() = std::move(out);
  JoinReductionsToDirectUpdates(program, max_bytes, direct_min_bytes);
}

}  // namespace meshrun
