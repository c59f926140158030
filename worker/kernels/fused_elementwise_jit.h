// FusedElementwiseJit: a fused element-wise loop (fused_elementwise_ops.h) compiled to AVX-512
// (or AVX2) machine code with Xbyak, every intermediate held in a zmm (ymm) register. The
// interpreter (fused_elementwise.cc) passes each op over a block in L1, a load and a store per op
// and element; here each element is loaded once and its results stored once, as XLA's compiled
// loops do. Each op is the same IEEE instruction the interpreter's clones run (vaddps, vdivps,
// vsqrtps...; no contraction to FMA), so the results are bitwise the interpreter's (NaN payloads
// aside). The one exception in how, not what: a division by a scalar input (Adam's bias
// corrections) multiplies by its reciprocal and corrects the quotient with FMAs (Markstein's
// method), whose result is the correctly rounded quotient vdivps gives, at a fraction of the
// divider's cost (DividesByReciprocals).
#ifndef MESHRUN_WORKER_KERNELS_FUSED_ELEMENTWISE_JIT_H_
#define MESHRUN_WORKER_KERNELS_FUSED_ELEMENTWISE_JIT_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "worker/kernels/fused_elementwise_ops.h"

namespace meshrun {

class FusedElementwiseJit {
 public:
  // kBest: AVX-512F where the CPU (and OS) has it, else AVX2; kAvx2: AVX2 even so.
  enum class Isa { kBest, kAvx2 };

  // The loop over `instrs` with `is_scalar[r]` saying which inputs are one value (read once,
  // broadcast) and `updated_in_place[r]` which are also outputs (the same elements: each vector
  // of those is loaded before any output of it is stored); `output_instrs[o]` is the op whose
  // result output o receives. nullptr where the CPU has neither instruction set, or the ops need
  // more registers than it has (32 zmm, 15 ymm) or more code than 64 KiB: the caller interprets
  // then.
  static std::unique_ptr<FusedElementwiseJit> Create(const std::vector<fused::Instr>& instrs,
                                                     const std::vector<bool>& is_scalar,
                                                     const std::vector<bool>& updated_in_place,
                                                     const std::vector<int>& output_instrs,
                                                     Isa isa = Isa::kBest);

  virtual ~FusedElementwiseJit() = default;

  // Elements per vector: 16 (AVX-512) or 8 (AVX2).
  virtual int64_t lanes() const = 0;

  // Whether a division by a scalar input runs without the divider (as x * (1/s) with two FMA
  // corrections, still correctly rounded) while every such divisor is in [2^-32, 2^32]: the
  // AVX-512 loop of ops that divide by one, where the registers allow it.
  virtual bool DividesByReciprocals() const = 0;

  // Elements [0, vectors * lanes()): inputs[r] points at a streamed input's first element or at
  // a scalar input's value; outputs[o] at output o's first element. An output overlaps no input
  // but the ones Create was told it updates in place (exactly: the same first element).
  // Thread-safe (the code is read-only); disjoint ranges may run at once.
  virtual void Run(const float* const* inputs, float* const* outputs, int64_t vectors) const = 0;
};

}  // namespace meshrun

#endif  // MESHRUN_WORKER_KERNELS_FUSED_ELEMENTWISE_JIT_H_
