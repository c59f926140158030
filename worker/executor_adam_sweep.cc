// Joining a model's Adam updates into one sweep over all its parameters (the optimizer "one
// sweep" of PyTorch's fused Adam and of XLA's fusion of optax over a pytree): consecutive
// OP_ADAM_UPDATEs with nothing to reduce run as one core/optim AdamWSweep, so every compute
// thread works on the update whatever the parameters' sizes.
#include <algorithm>
#include <cstring>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/optim/adamw.h"
#include "worker/executor.h"

namespace meshrun {
namespace {

// Whether two updates step alike (what AdamWHyperParamsOf reads of them).
bool SameHyperParams(const v1::AdamWAttrs& a, const v1::AdamWAttrs& b) {
  const AdamWHyperParams x = AdamWHyperParamsOf(a), y = AdamWHyperParamsOf(b);
  return x.learning_rate == y.learning_rate && x.b1 == y.b1 && x.b2 == y.b2 && x.eps == y.eps &&
         x.weight_decay == y.weight_decay;
}

}  // namespace

bool Executor::IsLocalAdamUpdate(const v1::Op& op) {
  if (op.kind() != v1::OP_ADAM_UPDATE || op.inputs_size() < 5 ||
      op.outputs_size() != op.inputs_size() - 2) {
    return false;
  }
  if (op.axis_names_size() == 0) return op.inputs_size() == 5;
  absl::StatusOr<Communicator*> c =
      CommunicatorFor(std::vector<std::string>(op.axis_names().begin(), op.axis_names().end()));
  return c.ok() && (*c)->size() == 1;
}

bool Executor::SharesNoMemory(const std::vector<const v1::Op*>& run) {
  std::set<std::string> placed;
  for (const Placement& p : placements_) {
    placed.insert(p.part);
    placed.insert(p.whole);
  }
  std::set<std::string> seen;           // every array of the ops so far
  std::set<std::string> rider_results;  // their riders' results
  auto own = [&](const std::string& name) {
    // Not another array of the run, nor memory that is another buffer's (a view, a placed part,
    // or a whole holding parts).
    return seen.insert(name).second && !views_.count(name) && !placed.count(name);
  };
  for (const v1::Op* op : run) {
    for (int k = 0; k < op->inputs_size(); ++k) {
      if (k == 4) continue;  // the step, read by all
      // A gradient that an earlier update's riders summed (the small gradients' bucket riding
      // with a large one): the riders are copied before the sweep starts.
      if (k == 1 && rider_results.count(op->inputs(k))) continue;
      if (!own(op->inputs(k))) return false;
    }
    for (int k = 0; k < op->outputs_size(); ++k) {
      if (!own(op->outputs(k))) return false;
      if (k >= 3) rider_results.insert(op->outputs(k));
    }
  }
  return true;
}

absl::StatusOr<Executor::CompiledOp> Executor::CompileAdamSweep(
    const std::vector<const v1::Op*>& run) {
  struct Arrays {
    const Tensor *param, *grad, *mu, *nu;
    Tensor *p_out, *mu_out, *nu_out;
    Bf16Copy* copy;  // or null
  };
  std::vector<Arrays> arrays;
  // Joined reductions over a group of one: their sums are their operands.
  std::vector<std::pair<const Tensor*, Tensor*>> riders;
  for (const v1::Op* op : run) {
    for (int k = 5; k < op->inputs_size(); ++k) {
      absl::StatusOr<Tensor*> x = Buffer(*op, op->inputs(k));
      if (!x.ok()) return x.status();
      absl::StatusOr<Tensor*> y = Buffer(*op, op->outputs(k - 2));
      if (!y.ok()) return y.status();
      riders.emplace_back(*x, *y);
    }
    std::vector<Tensor*> t;
    for (const std::string& name : {op->inputs(0), op->inputs(1), op->inputs(2), op->inputs(3),
                                    op->outputs(0), op->outputs(1), op->outputs(2)}) {
      absl::StatusOr<Tensor*> b = Buffer(*op, name);
      if (!b.ok()) return b.status();
      t.push_back(*b);
    }
    arrays.push_back({t[0], t[1], t[2], t[3], t[4], t[5], t[6], Bf16CopyOf(op->outputs(0))});
  }
  absl::StatusOr<Tensor*> step = Buffer(*run[0], run[0]->inputs(4));
  if (!step.ok()) return step.status();
  const AdamWHyperParams hp = AdamWHyperParamsOf(run[0]->adamw());
  const Tensor* t = *step;
  return CompiledOp([arrays, riders, hp, t](const RunContext&) {
    for (const auto& [x, y] : riders) std::memcpy(y->raw(), x->raw(), x->size_bytes());
    // (Read at each run: a step binds its arguments and results anew.)
    std::vector<AdamWSegment> segments;
    segments.reserve(arrays.size());
    for (const Arrays& a : arrays) {
      segments.push_back({a.param->data<float>(), a.grad->data<float>(), a.mu->data<float>(),
                          a.nu->data<float>(), a.p_out->data<float>(), a.mu_out->data<float>(),
                          a.nu_out->data<float>(), a.param->num_elements(),
                          a.copy != nullptr ? a.copy->values.data<uint16_t>() : nullptr});
    }
    absl::StatusOr<int64_t> count = AdamWCount(*t);
    if (!count.ok()) return count.status();
    AdamWSweep(hp, *count, segments);
    for (const Arrays& a : arrays) {
      if (a.copy != nullptr) a.copy->written = true;
    }
    return absl::OkStatus();
  });
}

absl::Status Executor::JoinAdamUpdates(const v1::Function& f, std::vector<CompiledOp>& ops) {
  int i = 0;
  while (i < f.ops_size()) {
    if (!IsLocalAdamUpdate(f.ops(i))) {
      ++i;
      continue;
    }
    std::vector<const v1::Op*> run = {&f.ops(i)};
    int end = i + 1;
    while (end < f.ops_size() && IsLocalAdamUpdate(f.ops(end)) &&
           f.ops(end).inputs(4) == f.ops(i).inputs(4) &&
           SameHyperParams(f.ops(end).adamw(), f.ops(i).adamw())) {
      run.push_back(&f.ops(end));
      ++end;
    }
    if (run.size() > 1 && SharesNoMemory(run)) {
      absl::StatusOr<CompiledOp> sweep = CompileAdamSweep(run);
      if (!sweep.ok()) return sweep.status();
      ops[i] = *std::move(sweep);
      for (int k = i + 1; k < end; ++k)
        ops[k] = [](const RunContext&) { return absl::OkStatus(); };  // done by op i's sweep
      ++adam_sweeps_;
    }
    i = end;
  }
  return absl::OkStatus();
}

}  // namespace meshrun
