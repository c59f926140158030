// Fused element-wise kernel (kernel.h's CreateFusedElementwise): the whole vectors through the
// AVX-512 or AVX2 loop fused_elementwise_jit.h compiles; the rest, and everything on a CPU with
// neither, through the interpreter here (its per-op step: fused_elementwise_ops.h).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "worker/kernels/fused_elementwise_jit.h"
#include "worker/kernels/fused_elementwise_ops.h"
#include "worker/kernels/kernel.h"

namespace meshrun {
namespace {

using fused::Apply;
using fused::Fn;
using fused::Fns;
using fused::Instr;
using fused::kNoScalar;
using fused::kScalarX;
using fused::kScalarY;

constexpr int64_t kBlock = 256;  // elements per block: every op's scratch row stays in L1

class FusedElementwiseKernel : public RangeKernel {
 public:
  FusedElementwiseKernel(std::vector<Instr> instrs, std::vector<const Tensor*> inputs,
                         std::vector<int> output_instrs, std::vector<Tensor*> outputs, int64_t n,
                         FusedLoop loop)
      : instrs_(std::move(instrs)),
        inputs_(std::move(inputs)),
        output_instrs_(std::move(output_instrs)),
        outputs_(std::move(outputs)),
        n_(n),
        loop_(loop) {
    for (const Tensor* t : inputs_) is_scalar_.push_back(t->num_elements() == 1);
  }

  absl::Status Run() override {
    Sweep(0, n_, nullptr);
    return absl::OkStatus();
  }
  absl::Status RunRange(int64_t begin, int64_t len, const float* input0) override {
    if (begin < 0 || len < 0 || begin + len > n_ || input0 == nullptr || inputs_.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("fused_elementwise: range [", begin, ", ",
                                                     begin + len, ") of ", n_, " elements"));
    }
    Sweep(begin, len, input0);
    return absl::OkStatus();
  }

 private:
  // Elements [begin, begin + len), input 0 from `input0` (element `begin` first) when given:
  // the whole vectors by the loop compiled for the outputs' present in-place pattern, if it
  // compiles; the rest interpreted.
  void Sweep(int64_t begin, int64_t len, const float* input0) {
    const std::optional<std::vector<bool>> in_place = InPlaceInputs();
    const FusedElementwiseJit* jit = nullptr;
    if (loop_ != FusedLoop::kInterpreted && len > 1 && !OutputsOverlap(input0, begin, len)) {
      jit = CompiledFor(in_place);
    }
    if (jit != nullptr && len >= jit->lanes()) {
      const int64_t done = len / jit->lanes() * jit->lanes();
      RunCompiled(*jit, begin, done / jit->lanes(), input0);
      begin += done;
      len -= done;
      if (input0 != nullptr) input0 += done;
    }
    const bool overlap =
        !in_place || std::find(in_place->begin(), in_place->end(), true) != in_place->end();
    Interpret(begin, len, input0, overlap);
  }

  // The loop compiled for outputs that update `in_place`'s inputs in place, compiled on first
  // use (the executor may bind the tensors to other memory from run to run: donated arguments);
  // null where outputs overlap inputs otherwise or the ops cannot be compiled.
  const FusedElementwiseJit* CompiledFor(const std::optional<std::vector<bool>>& in_place) {
    if (!in_place.has_value()) return nullptr;
    absl::MutexLock lock(&jit_mu_);
    auto it = jits_.find(*in_place);
    if (it == jits_.end()) {
      const auto isa = loop_ == FusedLoop::kAvx2 ? FusedElementwiseJit::Isa::kAvx2
                                                 : FusedElementwiseJit::Isa::kBest;
      it = jits_
               .emplace(*in_place, FusedElementwiseJit::Create(instrs_, is_scalar_, *in_place,
                                                               output_instrs_, isa))
               .first;
    }
    return it->second.get();
  }

  // Whole vectors from element `begin` by the compiled loop, in parallel over the compute
  // threads in tasks of kTaskElements.
  void RunCompiled(const FusedElementwiseJit& jit, int64_t begin, int64_t vectors,
                   const float* input0) {
    constexpr int64_t kTaskElements = 4096;
    const int64_t lanes = jit.lanes(), task_vectors = kTaskElements / lanes;
    const int64_t tasks = (vectors + task_vectors - 1) / task_vectors;
#pragma omp parallel for schedule(static) if (tasks > 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t at = begin + t * task_vectors * lanes;
      std::vector<const float*> in(inputs_.size());
      std::vector<float*> out(outputs_.size());
      for (size_t r = 0; r < inputs_.size(); ++r) {
        if (is_scalar_[r]) {
          in[r] = inputs_[r]->data<float>();
        } else if (r == 0 && input0 != nullptr) {
          in[r] = input0 + (at - begin);
        } else {
          in[r] = inputs_[r]->data<float>() + at;
        }
      }
      for (size_t o = 0; o < outputs_.size(); ++o) out[o] = outputs_[o]->data<float>() + at;
      jit.Run(in.data(), out.data(), std::min(task_vectors, vectors - t * task_vectors));
    }
  }

  // The interpreter: blocks of kBlock elements, op by op through scratch rows. `overlap`: an
  // output shares memory with an input.
  void Interpret(int64_t begin, int64_t len, const float* input0, bool overlap) {
    const int64_t blocks = (len + kBlock - 1) / kBlock;
    const int n = static_cast<int>(inputs_.size());
    const int rows = n + static_cast<int>(instrs_.size());
    if (blocks == 0) return;
    // An op whose result is an output writes it in place (no copy out of the scratch), unless an
    // output shares memory with an input (a view), which a later op of the block may still read.
    std::vector<float*> direct(instrs_.size(), nullptr);
    if (!overlap) {
      for (size_t o = 0; o < outputs_.size(); ++o) {
        if (direct[output_instrs_[o]] == nullptr)
          direct[output_instrs_[o]] = outputs_[o]->data<float>();
      }
    }
#pragma omp parallel if (blocks > 1)
    {
      // Kept by the thread between calls: a reduce-update calls RunRange chunk by chunk.
      thread_local std::vector<float> scratch;
      if (scratch.size() < static_cast<size_t>(rows) * kBlock)
        scratch.resize(static_cast<size_t>(rows) * kBlock);
      // Each row's element `begin`: an input's, a direct output's, or a scratch row (results,
      // and one-element inputs broadcast once per call).
      std::vector<float*> base(rows, nullptr);
      std::vector<bool> moves(rows, true);  // advances with the block (else a scratch row)
      for (int r = 0; r < rows; ++r) {
        float* own = &scratch[static_cast<size_t>(r) * kBlock];
        if (r == 0 && input0 != nullptr) {
          base[r] = const_cast<float*>(input0);
        } else if (r < n && inputs_[r]->num_elements() != 1) {
          base[r] = const_cast<float*>(inputs_[r]->data<float>()) + begin;
        } else if (r < n) {
          std::fill_n(own, kBlock, inputs_[r]->data<float>()[0]);
          base[r] = own;
          moves[r] = false;
        } else if (direct[r - n] != nullptr) {
          base[r] = direct[r - n] + begin;
        } else {
          base[r] = own;
          moves[r] = false;
        }
      }
#pragma omp for schedule(static)
      for (int64_t blk = 0; blk < blocks; ++blk) {
        const int64_t at = blk * kBlock, m = std::min(kBlock, len - at);
        auto row = [&](int r) -> float* { return moves[r] ? base[r] + at : base[r]; };
        for (size_t k = 0; k < instrs_.size(); ++k) {
          const Instr& in = instrs_[k];
          Apply(in.fn, in.scalar, row(in.a), row(in.b), row(in.c), row(n + static_cast<int>(k)), m);
        }
        for (size_t o = 0; o < outputs_.size(); ++o) {
          float* to = outputs_[o]->data<float>() + begin + at;
          const float* from = row(n + output_instrs_[o]);
          if (from != to) std::copy_n(from, m, to);
        }
      }
    }
  }

  // Per input, whether an output is that input itself (the same elements: an in-place update);
  // nullopt if an output overlaps an input in any other way (a shifted view).
  std::optional<std::vector<bool>> InPlaceInputs() const {
    std::vector<bool> in_place(inputs_.size(), false);
    for (const Tensor* o : outputs_) {
      const char* ob = static_cast<const char*>(o->raw());
      const char* oe = ob + o->num_elements() * sizeof(float);
      for (size_t i = 0; i < inputs_.size(); ++i) {
        const char* ib = static_cast<const char*>(inputs_[i]->raw());
        const char* ie = ib + inputs_[i]->num_elements() * sizeof(float);
        if (ob == ib && oe == ie) {
          in_place[i] = true;
        } else if (ob < ie && ib < oe) {
          return std::nullopt;
        }
      }
    }
    return in_place;
  }

  // Whether elements [begin, begin + len) of an output overlap `from`'s len elements.
  bool OutputsOverlap(const float* from, int64_t begin, int64_t len) const {
    if (from == nullptr) return false;
    for (const Tensor* o : outputs_) {
      const float* ob = o->data<float>() + begin;
      if (ob < from + len && from < ob + len) return true;
    }
    return false;
  }

  std::vector<Instr> instrs_;
  std::vector<const Tensor*> inputs_;
  std::vector<int> output_instrs_;
  std::vector<Tensor*> outputs_;
  int64_t n_;
  const FusedLoop loop_;
  std::vector<bool> is_scalar_;  // per input: holds one element
  absl::Mutex jit_mu_;
  // By the inputs updated in place: the compiled loop (null: interpreted).
  std::map<std::vector<bool>, std::unique_ptr<FusedElementwiseJit>> jits_ ABSL_GUARDED_BY(jit_mu_);
};

}  // namespace

namespace {

// Checks and compiles the ops; the kernel over `outputs`, of any size.
absl::StatusOr<std::unique_ptr<FusedElementwiseKernel>> Compile(
    const std::vector<FusedInstruction>& instrs, const std::vector<const Tensor*>& inputs,
    const std::vector<int>& output_instrs, const std::vector<Tensor*>& outputs, FusedLoop loop) {
  if (instrs.empty() || outputs.empty() || outputs.size() != output_instrs.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("fused_elementwise: ", instrs.size(), " ops, ", outputs.size(),
                     " outputs and ", output_instrs.size(),
                     " output ops; expected at least one op and one output per output op"));
  }
  const Dims& dims = outputs[0]->dims();
  for (const Tensor* t : outputs) {
    if (t->dtype() != v1::DTYPE_F32 || t->dims() != dims) {
      return absl::InvalidArgumentError(absl::StrCat("fused_elementwise: outputs must be f32 ",
                                                     DimsToString(dims), "; got ",
                                                     DimsToString(t->dims())));
    }
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor* t = inputs[i];
    if (t->dtype() != v1::DTYPE_F32 || (t->dims() != dims && t->num_elements() != 1)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "fused_elementwise: input ", i, " is ", DTypeName(t->dtype()), DimsToString(t->dims()),
          "; expected f32 ", DimsToString(dims), " or one element"));
    }
  }
  std::vector<Instr> compiled;
  const int n = static_cast<int>(inputs.size());
  for (size_t k = 0; k < instrs.size(); ++k) {
    auto it = Fns().find(instrs[k].fn);
    if (it == Fns().end() || static_cast<int>(instrs[k].args.size()) != it->second.second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "fused_elementwise op ", k, ": fn '", instrs[k].fn, "' with ", instrs[k].args.size(),
          " args is not one of add sub mul div max min eq ne lt le gt ge (2 args), neg abs square "
          "sqrt round_bf16 (1), select (3)"));
    }
    for (int a : instrs[k].args) {
      if (a < 0 || a >= n + static_cast<int>(k)) {
        return absl::InvalidArgumentError(absl::StrCat("fused_elementwise op ", k, ": arg ", a,
                                                       " is not an input (0..", n - 1,
                                                       ") or an earlier result"));
      }
    }
    Instr in;
    in.fn = it->second.first;
    in.a = instrs[k].args[0];
    in.b = instrs[k].args.size() > 1 ? instrs[k].args[1] : in.a;
    in.c = instrs[k].args.size() > 2 ? instrs[k].args[2] : in.a;
    if (it->second.second == 2) {
      auto one_value = [&](int arg) { return arg < n && inputs[arg]->num_elements() == 1; };
      if (one_value(in.a) && !one_value(in.b)) in.scalar = kScalarX;
      if (one_value(in.b) && !one_value(in.a)) in.scalar = kScalarY;
    }
    compiled.push_back(in);
  }
  for (int o : output_instrs) {
    if (o < 0 || o >= static_cast<int>(instrs.size()))
      return absl::InvalidArgumentError(
          absl::StrCat("fused_elementwise: output op ", o, " does not exist"));
  }
  return std::make_unique<FusedElementwiseKernel>(std::move(compiled), inputs, output_instrs,
                                                  outputs, outputs[0]->num_elements(), loop);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Kernel>> CreateFusedElementwise(
    const std::vector<FusedInstruction>& instrs, const std::vector<const Tensor*>& inputs,
    const std::vector<int>& output_instrs, const std::vector<Tensor*>& outputs, FusedLoop loop) {
  absl::StatusOr<std::unique_ptr<FusedElementwiseKernel>> k =
      Compile(instrs, inputs, output_instrs, outputs, loop);
  if (!k.ok()) return k.status();
  if (outputs[0]->num_elements() == 0) return std::unique_ptr<Kernel>(nullptr);
  return std::unique_ptr<Kernel>(*std::move(k));
}

absl::StatusOr<std::unique_ptr<RangeKernel>> CreateFusedElementwiseRange(
    const std::vector<FusedInstruction>& instrs, const std::vector<const Tensor*>& inputs,
    const std::vector<int>& output_instrs, const std::vector<Tensor*>& outputs, FusedLoop loop) {
  absl::StatusOr<std::unique_ptr<FusedElementwiseKernel>> k =
      Compile(instrs, inputs, output_instrs, outputs, loop);
  if (!k.ok()) return k.status();
  if (inputs.empty() || inputs[0]->dims() != outputs[0]->dims()) {
    return absl::InvalidArgumentError(
        absl::StrCat("fused_elementwise over a range: input 0 is ",
                     inputs.empty() ? std::string("missing") : DimsToString(inputs[0]->dims()),
                     "; expected the outputs' shape ", DimsToString(outputs[0]->dims())));
  }
  return std::unique_ptr<RangeKernel>(*std::move(k));
}

}  // namespace meshrun
