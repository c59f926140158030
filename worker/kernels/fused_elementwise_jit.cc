// FusedElementwiseJit (fused_elementwise_jit.h): the loops fused_elementwise_jit_generator.h
// emits, and which of them a run takes.
#include "worker/kernels/fused_elementwise_jit.h"

#include <algorithm>
#include <memory>

#include "worker/kernels/fused_elementwise_jit_generator.h"
#include "xbyak/xbyak_util.h"

namespace meshrun {
namespace {

using fused::Instr;
using fused_jit::Generator;
using fused_jit::IsScalarDivision;
using fused_jit::ScalarDivisorIsSafe;

using LoopFn = void (*)(const float* const*, float* const*, int64_t);

// The loop emitted, or null where it needs more registers or code than there are.
std::unique_ptr<Generator> Emitted(bool avx512, bool reciprocal_division,
                                   const std::vector<Instr>& instrs,
                                   const std::vector<bool>& is_scalar,
                                   const std::vector<bool>& updated_in_place,
                                   const std::vector<int>& output_instrs) {
  auto gen = std::make_unique<Generator>(avx512, reciprocal_division, instrs, is_scalar,
                                         updated_in_place, output_instrs);
  try {
    if (!gen->Emit()) return nullptr;
    gen->ready();
    gen->setProtectModeRE();
  } catch (const Xbyak::Error&) {  // more code than fits, or a buffer the OS will not execute
    return nullptr;
  }
  return gen;
}

// The loop with every division through vdivps, and where the ops divide by scalar inputs and
// registers allow, the one dividing by their reciprocals (DivideByScalar), run while each such
// divisor's present value is one ScalarDivisorIsSafe takes.
class Compiled : public FusedElementwiseJit {
 public:
  Compiled(std::unique_ptr<Generator> exact, std::unique_ptr<Generator> reciprocal,
           std::vector<int> divisors, int64_t lanes)
      : exact_(std::move(exact)),
        reciprocal_(std::move(reciprocal)),
        exact_fn_(exact_->getCode<LoopFn>()),
        reciprocal_fn_(reciprocal_ ? reciprocal_->getCode<LoopFn>() : nullptr),
        divisors_(std::move(divisors)),
        lanes_(lanes) {}
  int64_t lanes() const override { return lanes_; }
  bool DividesByReciprocals() const override { return reciprocal_fn_ != nullptr; }
  void Run(const float* const* inputs, float* const* outputs, int64_t vectors) const override {
    bool safe = reciprocal_fn_ != nullptr;
    for (size_t i = 0; safe && i < divisors_.size(); ++i)
      safe = ScalarDivisorIsSafe(*inputs[divisors_[i]]);
    (safe ? reciprocal_fn_ : exact_fn_)(inputs, outputs, vectors);
  }

 private:
  std::unique_ptr<Generator> exact_, reciprocal_;
  LoopFn exact_fn_, reciprocal_fn_;
  std::vector<int> divisors_;  // the scalar inputs divided by
  int64_t lanes_;
};

}  // namespace

std::unique_ptr<FusedElementwiseJit> FusedElementwiseJit::Create(
    const std::vector<fused::Instr>& instrs, const std::vector<bool>& is_scalar,
    const std::vector<bool>& updated_in_place, const std::vector<int>& output_instrs, Isa isa) {
  static const Xbyak::util::Cpu cpu;
  const bool avx512 = isa == Isa::kBest && cpu.has(Xbyak::util::Cpu::tAVX512F);
  if ((!avx512 && !cpu.has(Xbyak::util::Cpu::tAVX2)) || instrs.empty() ||
      is_scalar.size() != updated_in_place.size()) {
    return nullptr;
  }
  std::unique_ptr<Generator> exact =
      Emitted(avx512, false, instrs, is_scalar, updated_in_place, output_instrs);
  if (exact == nullptr) return nullptr;
  std::vector<int> divisors;
  for (const Instr& in : instrs) {
    if (IsScalarDivision(in, is_scalar) &&
        std::find(divisors.begin(), divisors.end(), in.b) == divisors.end())
      divisors.push_back(in.b);
  }
  std::unique_ptr<Generator> reciprocal;
  // AVX-512 only: on AVX2, with half the registers and no mask registers, the range checks cost
  // what the divider did (fused_update_bench: no gain on a Xeon).
  if (!divisors.empty() && avx512)
    reciprocal = Emitted(avx512, true, instrs, is_scalar, updated_in_place, output_instrs);
  return std::make_unique<Compiled>(std::move(exact), std::move(reciprocal), std::move(divisors),
                                    avx512 ? 16 : 8);
}

}  // namespace meshrun
