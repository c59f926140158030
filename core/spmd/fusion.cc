#include "core/spmd/fusion.h"

#include <map>
#include <set>
#include <string>
#include <vector>

namespace meshrun {
namespace {

// Ops whose result may be a view of their input's memory (worker/executor.h).
bool IsView(v1::OpKind kind) {
  return kind == v1::OP_RESHAPE || kind == v1::OP_SLICE || kind == v1::OP_DYNAMIC_SLICE;
}

// Whether the ops `writers` (indices into `ops`, ascending) after the first all add a product
// into the first one's result in place (a chain this pass has already made).
bool AccumulatesInPlace(const google::protobuf::RepeatedPtrField<v1::Op>& ops,
                        const std::vector<int>& writers) {
  for (size_t w = 1; w < writers.size(); ++w) {
    const v1::Op& op = ops.Get(writers[w]);
    if (op.kind() != v1::OP_MATMUL || !op.accumulate() || op.outputs_size() != 1) return false;
  }
  return true;
}

}  // namespace

void FuseGradientAccumulation(v1::ShardMapProgram* program) {
  if (program->program().functions_size() != 1) return;
  auto* ops = program->mutable_program()->mutable_functions(0)->mutable_ops();
  std::set<std::string> boundary(program->inputs().begin(), program->inputs().end());
  boundary.insert(program->outputs().begin(), program->outputs().end());
  bool changed = true;
  while (changed) {
    changed = false;
    std::map<std::string, std::vector<int>> writers, readers;
    for (int i = 0; i < ops->size(); ++i) {
      for (const std::string& out : ops->Get(i).outputs()) writers[out].push_back(i);
      for (const std::string& in : ops->Get(i).inputs()) readers[in].push_back(i);
    }
    for (int i = 0; i < ops->size() && !changed; ++i) {
      const v1::Op& add = ops->Get(i);
      if (add.kind() != v1::OP_BINARY || add.fn() != "add" || add.inputs_size() != 2 ||
          add.outputs_size() != 1 || add.inputs(0) == add.inputs(1)) {
        continue;
      }
      for (int m = 0; m < 2 && !changed; ++m) {
        const std::string product = add.inputs(m);  // copies: the add is deleted below
        const std::string acc = add.inputs(1 - m);
        const std::vector<int>& pw = writers[product];
        const std::vector<int>& aw = writers[acc];
        // The accumulator may already be a chain (a first product, then products added in
        // place): every op that writes it must come before this matmul.
        if (pw.size() != 1 || aw.empty() || aw.back() >= pw[0] || boundary.count(product) ||
            boundary.count(acc) || readers[product].size() != 1 || readers[acc].size() != 1) {
          continue;
        }
        const v1::Op& matmul = ops->Get(pw[0]);
        const v1::Op& first = ops->Get(aw[0]);
        if (matmul.kind() != v1::OP_MATMUL || matmul.inputs_size() != 2 || matmul.accumulate() ||
            !matmul.fn().empty() || IsView(first.kind()) || first.outputs_size() != 1 ||
            !AccumulatesInPlace(*ops, aw)) {
          continue;
        }
        const std::string sum = add.outputs(0);
        if (boundary.count(sum)) continue;
        v1::Op* fused = ops->Mutable(pw[0]);
        fused->set_outputs(0, acc);
        fused->set_accumulate(true);
        ops->DeleteSubrange(i, 1);
        // Every later use of the sum reads the accumulator.
        for (int k = i; k < ops->size(); ++k) {
          for (std::string& in : *ops->Mutable(k)->mutable_inputs())
            if (in == sum) in = acc;
        }
        changed = true;
      }
    }
  }
}

}  // namespace meshrun
