// Executor::AnalyzeBuffers (executor.h): which buffers may share memory, as XLA's buffer
// assignment decides: views of their input, results written over donated inputs, concatenation
// parts computed where the concatenation puts them, all-reductions in their operand's memory,
// converts to bf16 that read their input's bf16 copy (Tensor::bf16_copy) where it lies.
#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/array_ops.h"
#include "worker/executor.h"

namespace meshrun {

// Every writer and reader of every buffer of a program, as (function, op index).
struct Executor::BufferUses {
  std::map<std::string, std::vector<std::pair<int, int>>> writers, readers;
  // The buffers that may view each buffer's memory (outputs of view ops on it, their views,
  // ...): they would see an in-place update of it.
  std::map<std::string, std::vector<std::string>> view_outputs;
  std::set<std::string> results;

  // Whether the buffers `pending`, and every buffer that views their memory, are not results
  // and are read only before op `i` of function `f`.
  bool ReadOnlyBefore(std::vector<std::string> pending, int f, int i) {
    std::set<std::string> seen;
    while (!pending.empty()) {
      const std::string v = pending.back();
      pending.pop_back();
      if (!seen.insert(v).second) continue;
      if (results.count(v)) return false;
      for (const auto& [rf, ri] : readers[v]) {
        if (rf != f || ri >= i) return false;
      }
      for (const std::string& w : view_outputs[v]) pending.push_back(w);
    }
    return true;
  }
};

bool Executor::IsViewKind(v1::OpKind kind) {
  return kind == v1::OP_RESHAPE || kind == v1::OP_SLICE || kind == v1::OP_DYNAMIC_SLICE;
}

void Executor::AnalyzeBuffers() {
  BufferUses u;
  u.results.insert(options_.results.begin(), options_.results.end());
  for (int f = 0; f < program_.functions_size(); ++f) {
    const v1::Function& fn = program_.functions(f);
    for (int i = 0; i < fn.ops_size(); ++i) {
      const v1::Op& op = fn.ops(i);
      for (const std::string& out : op.outputs()) u.writers[out].push_back({f, i});
      for (const std::string& in : op.inputs()) u.readers[in].push_back({f, i});
      if (IsViewKind(op.kind()) && op.inputs_size() > 0) {
        for (const std::string& out : op.outputs()) u.view_outputs[op.inputs(0)].push_back(out);
      }
    }
  }
  for (const auto& [name, unused] : u.writers) written_.insert(name);
  PlanDonations(u);
  PlanViews(u);
  PlanReductionsInPlace(u, PlanPlacements(u));
  PlanBf16Copies(u);
}

void Executor::PlanDonations(BufferUses& u) {
  // Whether op i of function f may write its output y over its input x when x is donated: x has
  // no writer and is read by no later op (nor through a view), y has this op as its one writer
  // and is not among its inputs, and x is read once by it.
  auto may_write_over = [&](const v1::Op& op, int f, int i, const std::string& x,
                            const std::string& y) {
    bool ok = x != y && u.writers[x].empty() && u.ReadOnlyBefore(u.view_outputs[x], f, i) &&
              u.writers[y] == std::vector<std::pair<int, int>>{{f, i}} &&
              std::count(op.inputs().begin(), op.inputs().end(), x) == 1 &&
              std::count(op.inputs().begin(), op.inputs().end(), y) == 0;
    for (const auto& [rf, ri] : u.readers[x]) ok = ok && rf == f && ri <= i;
    return ok;
  };
  for (int f = 0; f < program_.functions_size(); ++f) {
    const v1::Function& fn = program_.functions(f);
    for (int i = 0; i < fn.ops_size(); ++i) {
      const v1::Op& op = fn.ops(i);
      if (op.kind() == v1::OP_ADAM_UPDATE && op.inputs_size() >= 5 &&
          op.outputs_size() == op.inputs_size() - 2) {
        // (output, input): new param over param, new mu over mu, new nu over nu.
        for (const auto& [k, j] : {std::pair<int, int>{0, 0}, {1, 2}, {2, 3}}) {
          if (!may_write_over(op, f, i, op.inputs(j), op.outputs(k))) continue;
          over_donated_.push_back({op.outputs(k), {op.inputs(j)}});
        }
      } else if (op.kind() == v1::OP_FUSED_ELEMENTWISE) {
        // Each output over any input of its dtype and element count (every element of each input
        // is read before that element of any output is written; input 0 of a reduce-update is
        // read from the reduction's memory), the first of them donated and not yet taken when
        // it runs. XLA's buffer donation.
        // An undeclared buffer is no candidate (Compile refuses the op by name).
        for (const std::string& y : op.outputs()) {
          const auto yt = buffers_.find(y);
          if (yt == buffers_.end()) continue;
          std::vector<std::string> xs;
          for (int j = op.axis_names_size() > 0 ? 1 : 0; j < op.inputs_size(); ++j) {
            const std::string& x = op.inputs(j);
            const auto xt = buffers_.find(x);
            if (xt == buffers_.end() || xt->second.dtype() != yt->second.dtype() ||
                xt->second.num_elements() != yt->second.num_elements() ||
                !may_write_over(op, f, i, x, y))
              continue;
            xs.push_back(x);
          }
          if (!xs.empty()) over_donated_.push_back({y, std::move(xs)});
        }
      }
    }
  }
}

// Reshapes and slices whose output may view their input: it has no other writer, and the input
// is written only by earlier ops of the same function.
void Executor::PlanViews(BufferUses& u) {
  for (int f = 0; f < program_.functions_size(); ++f) {
    const v1::Function& fn = program_.functions(f);
    for (int i = 0; i < fn.ops_size(); ++i) {
      const v1::Op& op = fn.ops(i);
      if (!IsViewKind(op.kind()) || op.inputs_size() < 1 || op.outputs_size() != 1 ||
          op.inputs(0) == op.outputs(0))
        continue;
      const std::vector<std::pair<int, int>>& y_writers = u.writers[op.outputs(0)];
      bool ok = y_writers.size() == 1 && y_writers[0] == std::make_pair(f, i);
      for (const auto& [wf, wi] : u.writers[op.inputs(0)]) ok = ok && wf == f && wi >= 0 && wi < i;
      if (ok) view_ops_.insert(&op);
    }
  }
}

std::set<std::string> Executor::PlanPlacements(BufferUses& u) {
  // Concatenations along a leading dim whose parts can be computed in place, each where the
  // concatenation puts it (XLA's buffer assignment does the same): a part, or the buffer a
  // reshape views as the part, has one writer, earlier in the function, and nothing else is
  // placed there; the result has no other writer.
  std::set<std::string> placed;
  const std::set<std::string> donation_sources = DonationSources();
  for (int f = 0; f < program_.functions_size(); ++f) {
    const v1::Function& fn = program_.functions(f);
    for (int c = 0; c < fn.ops_size(); ++c) {
      const v1::Op& op = fn.ops(c);
      if (op.kind() != v1::OP_CONCATENATE || op.outputs_size() != 1) continue;
      const std::string& out = op.outputs(0);
      const auto single = [&](const std::string& b, int before) {
        const std::vector<std::pair<int, int>>& w = u.writers[b];
        return w.size() == 1 && w[0].first == f && w[0].second >= 0 && w[0].second < before
                   ? w[0].second
                   : -1;
      };
      auto out_it = buffers_.find(out);
      if (out_it == buffers_.end() || single(out, c + 1) != c || donation_sources.count(out))
        continue;
      const Dims& od = out_it->second.dims();
      bool ok = op.dim() >= 0 && op.dim() < static_cast<int64_t>(od.size());
      for (int64_t d = 0; ok && d < op.dim(); ++d) ok = od[d] == 1;
      std::vector<std::pair<std::string, size_t>> parts;
      size_t offset = 0;
      for (int k = 0; ok && k < op.inputs_size(); ++k) {
        std::string target = op.inputs(k);
        const int w = single(target, c);
        ok = w >= 0 && buffers_.count(target);
        if (ok && view_ops_.count(&fn.ops(w)) && fn.ops(w).kind() == v1::OP_RESHAPE) {
          target = fn.ops(w).inputs(0);  // the reshape's input is where the part is computed
          ok = single(target, w) >= 0;
        }
        ok = ok && target != out && !placed.count(target) && !donation_sources.count(target) &&
             buffers_.count(target);
        for (const auto& [name, unused] : parts) ok = ok && name != target;
        if (!ok) break;
        parts.push_back({target, offset});
        offset += buffers_.at(target).size_bytes();
      }
      if (!ok || offset != out_it->second.size_bytes()) continue;
      for (const auto& [name, off] : parts) {
        placed.insert(name);
        placements_.push_back({name, out, off});
      }
    }
  }
  return placed;
}

void Executor::PlanReductionsInPlace(BufferUses& u, const std::set<std::string>& placed) {
  // All-reductions whose input nothing reads afterwards: the result is reduced in the input's
  // memory instead of a copy of it (XLA's buffer assignment lets an all-reduce reuse its dead
  // operand). The input is an intermediate of the same function, written only before the op, not
  // a view, a donated input's target or a result; whatever shares its memory (its views, the
  // parts a concatenation placed in it) is read only before the op and is not a result either.
  std::set<std::string> adam_targets;
  for (const auto& [y, xs] : over_donated_) adam_targets.insert(y);
  for (int f = 0; f < program_.functions_size(); ++f) {
    const v1::Function& fn = program_.functions(f);
    for (int i = 0; i < fn.ops_size(); ++i) {
      const v1::Op& op = fn.ops(i);
      const v1::OpKind k = op.kind();
      // An Adam update that all-reduces its partial gradient (input 1), or a fused update its
      // input 0, may do so in its memory.
      const bool adam = k == v1::OP_ADAM_UPDATE && op.axis_names_size() > 0 &&
                        op.inputs_size() >= 5 && op.outputs_size() == op.inputs_size() - 2;
      const bool fused =
          k == v1::OP_FUSED_ELEMENTWISE && op.axis_names_size() > 0 && op.inputs_size() > 0;
      const bool update = adam || fused;
      if (!update && ((k != v1::OP_PSUM && k != v1::OP_PMEAN && k != v1::OP_PMAX) ||
                      op.inputs_size() != 1 || op.outputs_size() != 1)) {
        continue;
      }
      const std::string& x = op.inputs(adam ? 1 : 0);
      bool ok = !u.results.count(x) && !placed.count(x) && !adam_targets.count(x) &&
                !u.writers[x].empty() && u.readers[x] == std::vector<std::pair<int, int>>{{f, i}} &&
                u.ReadOnlyBefore(u.view_outputs[x], f, i);
      for (int o = 0; !update && o < op.outputs_size(); ++o) {
        const std::string& y = op.outputs(o);
        ok = ok && x != y && !placed.count(y) && !adam_targets.count(y) &&
             u.writers[y] == std::vector<std::pair<int, int>>{{f, i}};
      }
      for (const auto& [wf, wi] : u.writers[x]) {
        ok = ok && wf == f && wi >= 0 && wi < i && !IsViewKind(fn.ops(wi).kind());
      }
      for (const Placement& p : placements_) {
        if (ok && p.whole == x) ok = u.ReadOnlyBefore({p.part}, f, i);
      }
      if (ok) reduce_in_place_.insert(&op);
    }
  }
}

void Executor::PlanBf16Copies(BufferUses& u) {
  // Buffers whose memory some op other than their writer may write: placed parts and wholes,
  // and the operands of all-reductions done in place.
  std::set<std::string> shared;
  for (const Placement& p : placements_) shared.insert({p.part, p.whole});
  for (const v1::Op* op : reduce_in_place_)
    shared.insert(op->inputs(op->kind() == v1::OP_ADAM_UPDATE ? 1 : 0));
  auto sole_writer = [&](const std::string& b, int f, int i) {
    return u.writers[b] == std::vector<std::pair<int, int>>{{f, i}} && !shared.count(b);
  };
  auto has = [&](const std::string& b, DType dtype, const Dims* dims) {
    auto it = buffers_.find(b);
    return it != buffers_.end() && it->second.dtype() == dtype &&
           (dims == nullptr || it->second.dims() == *dims);
  };
  // The buffer that no op writes of which op i of function f reads `x` as a contiguous block
  // (x itself, or through the slices and reshapes before op i that are the sole writers of x
  // and its ancestors), with x's element offset in it; nullopt if there is none.
  auto block_of = [&](std::string x, int f, int i) -> std::optional<CopyBlock> {
    const v1::Function& fn = program_.functions(f);
    CopyBlock block{x, 0};
    while (!u.writers[block.root].empty()) {
      const int w = u.writers[block.root][0].second;
      if (!sole_writer(block.root, f, w) || w >= i) return std::nullopt;
      const v1::Op& view = fn.ops(w);
      if (view.inputs_size() < 1 || view.outputs_size() != 1) return std::nullopt;
      const std::string& in = view.inputs(0);
      if (!has(in, buffers_.at(block.root).dtype(), nullptr)) return std::nullopt;
      std::optional<int64_t> offset;
      if (view.kind() == v1::OP_RESHAPE) offset = 0;
      if (view.kind() == v1::OP_SLICE)
        offset = SliceBlockOffset(view, buffers_.at(in).dims(), buffers_.at(block.root).dims());
      if (!offset.has_value()) return std::nullopt;
      block = {in, block.offset + *offset};
      i = w;
    }
    return block;
  };
  std::set<std::string> converted;  // f32 buffers some planned convert reads (a block of)
  for (int f = 0; f < program_.functions_size(); ++f) {
    const v1::Function& fn = program_.functions(f);
    for (int i = 0; i < fn.ops_size(); ++i) {
      const v1::Op& op = fn.ops(i);
      if (op.kind() != v1::OP_CONVERT || op.inputs_size() != 1 || op.outputs_size() != 1) continue;
      const std::string &x = op.inputs(0), &y = op.outputs(0);
      if (!has(x, v1::DTYPE_F32, nullptr) || !has(y, v1::DTYPE_BF16, &buffers_.at(x).dims()) ||
          !sole_writer(y, f, i) || u.results.count(y))
        continue;
      const std::optional<CopyBlock> block = block_of(x, f, i);  // (f32, as x)
      if (!block.has_value()) continue;
      bf16_copy_converts_[&op] = *block;
      converted.insert(block->root);
    }
  }
  for (int f = 0; f < program_.functions_size(); ++f) {
    const v1::Function& fn = program_.functions(f);
    for (int i = 0; i < fn.ops_size(); ++i) {
      const v1::Op& op = fn.ops(i);
      if (op.kind() != v1::OP_ADAM_UPDATE || op.inputs_size() < 5 || op.outputs_size() < 3 ||
          !converted.count(op.inputs(0)))
        continue;
      const std::string& p_out = op.outputs(0);
      const Dims& dims = buffers_.at(op.inputs(0)).dims();
      if (!has(p_out, v1::DTYPE_F32, &dims) || !sole_writer(p_out, f, i)) continue;
      bf16_copies_[p_out].values = Tensor::Shareable(v1::DTYPE_BF16, dims);
    }
  }
}

Executor::Bf16Copy* Executor::Bf16CopyOf(const std::string& param_out) {
  auto it = bf16_copies_.find(param_out);
  return it == bf16_copies_.end() ? nullptr : &it->second;
}

Executor::CompiledOp CompileConvertReadingCopy(const Tensor* root, int64_t offset, const Tensor* x,
                                               Tensor* y) {
  auto own = std::make_shared<Tensor>(Tensor::Uninitialized(y->dtype(), y->dims()));
  return [root, offset, x, y, own](const RunContext&) {
    const std::shared_ptr<const Tensor>& copy = root->bf16_copy();
    if (copy != nullptr && copy->dtype() == v1::DTYPE_BF16 && copy->dims() == root->dims() &&
        offset >= 0 && offset + y->num_elements() <= copy->num_elements()) {
      // (nothing writes y: the plan's condition)
      y->ShareMemory(*copy, offset * DTypeSize(v1::DTYPE_BF16));
      return absl::OkStatus();
    }
    y->ShareMemory(*own, 0);
    Convert(*x, *y);
    return absl::OkStatus();
  };
}

std::set<std::string> Executor::DonationSources() const {
  std::set<std::string> sources;
  for (const auto& [y, xs] : over_donated_) sources.insert(xs.begin(), xs.end());
  return sources;
}

}  // namespace meshrun
