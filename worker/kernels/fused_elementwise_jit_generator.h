// The code generator behind FusedElementwiseJit (fused_elementwise_jit.h), internal to it: Xbyak
// emits one loop over vectors of 16 (zmm, AVX-512) or 8 (ymm, AVX2) floats. Register use: vector
// registers are handed out as the ops are walked in order, an operand's register freed after its
// last reader; scalar inputs and constants keep theirs for the whole loop; compares write k1
// (AVX-512) or ymm15 (AVX2). rdi: inputs, rsi: outputs, rdx: the end byte offset, rcx: the byte
// offset, r8: a pointer read from inputs / outputs. The loop and its registers:
// fused_elementwise_jit_generator.cc; each op's instructions: fused_elementwise_jit_ops.cc.
#ifndef MESHRUN_WORKER_KERNELS_FUSED_ELEMENTWISE_JIT_GENERATOR_H_
#define MESHRUN_WORKER_KERNELS_FUSED_ELEMENTWISE_JIT_GENERATOR_H_

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <vector>

#include "worker/kernels/fused_elementwise_ops.h"
#include "xbyak/xbyak.h"

namespace meshrun {
namespace fused_jit {

using fused::Fn;
using fused::Instr;

// vcmpps predicates (Intel SDM, table 3-1): ordered compares are false with a NaN operand, as
// C++'s ==, <, <=, >, >= are; != is unordered (true with a NaN), as C++'s is.
constexpr uint8_t kEqOq = 0x00, kUnordQ = 0x03, kNeqUq = 0x04, kLtOq = 0x11, kLeOq = 0x12,
                  kGeOq = 0x1d, kGtOq = 0x1e;

// The rows an op reads.
std::vector<int> Operands(const Instr& in);

// The vcmpps predicate of a compare fn; nullopt for the others.
std::optional<uint8_t> ComparePredicate(Fn fn);

// A division x / s whose divisor is a scalar input and whose dividend is not.
bool IsScalarDivision(const Instr& in, const std::vector<bool>& is_scalar);

// The dividends DivideByScalar divides without the divider: |x| in [2^-64, 2^64], as bits
// 0x1f800000 + [0, 0x40000000].
constexpr uint32_t kSafeLowBits = 0x1f800000u, kSafeRangeBits = 0x40000000u;

// A divisor DivideByScalar's loop takes: 2^-32 <= |s| <= 2^32 (so 1/s and every quotient of a
// dividend in its range are normal and finite).
bool ScalarDivisorIsSafe(float s);

// The quiet NaN RoundToBf16 (core/float_ops.h) returns for every NaN, with the NaN's sign.
constexpr uint32_t kQuietNanBits = 0x7fc00000u;

// Room for the code: about 40 bytes per op (max and min take 9 instructions), and the loop.
constexpr size_t kCodeBytes = 64 * 1024;

enum class BitOp { kAnd, kOr, kXor };

// Written read-write, then made read-execute (never both at once).
class Generator : public Xbyak::CodeGenerator {
 public:
  // `reciprocal_division` (AVX-512 only): a division by a scalar input runs as DivideByScalar
  // does (the caller runs the loop only while every such divisor is one ScalarDivisorIsSafe
  // takes).
  Generator(bool avx512, bool reciprocal_division, const std::vector<Instr>& instrs,
            const std::vector<bool>& is_scalar, const std::vector<bool>& updated_in_place,
            const std::vector<int>& output_instrs)
      : Xbyak::CodeGenerator(kCodeBytes, Xbyak::DontSetProtectRWE),
        avx512_(avx512),
        instrs_(instrs),
        is_scalar_(is_scalar),
        updated_in_place_(updated_in_place),
        output_instrs_(output_instrs),
        reciprocal_division_(reciprocal_division && avx512),
        n_(static_cast<int>(is_scalar.size())) {}

  // False when the ops need more registers than there are.
  bool Emit();

 private:
  std::optional<int> Allocate() {
    if (free_.empty()) return std::nullopt;
    const int r = free_.back();
    free_.pop_back();
    return r;
  }
  Xbyak::Xmm Vec(int i) const {
    if (avx512_) return Xbyak::Zmm(i);
    return Xbyak::Ymm(i);
  }
  Xbyak::Xmm Row(int r) const { return Vec(reg_[r]); }
  Xbyak::Xmm Mask() const { return Xbyak::Ymm(15); }  // AVX2's compare results
  Xbyak::Xmm Constant(uint32_t bits) const { return Vec(constants_.at(bits)); }

  // Constants the ops need, the scalar inputs, broadcast once, and 1 / s of DivideByScalar's
  // divisors.
  bool Prologue();
  // One vector: each streamed input loaded before its first reader (those an output updates in
  // place before any store), each output stored as soon as its op has run.
  bool Body();
  bool Load(int r);  // a streamed input's vector into a register; false if none is free
  // False when a division by a scalar finds no registers for its temporaries.
  bool EmitOp(const Instr& in, const Xbyak::Xmm& d);
  void EmitArithmetic(const Instr& in, const Xbyak::Xmm& d);
  // d = x / s for a scalar input s, correctly rounded as vdivps is, without the divider (whose
  // throughput bounds a loop such as Adam's bias corrections): with y = 1/s from the prologue,
  // q = x * y, then Markstein's correction q + (x - q * s) * y (two FMAs, the remainder exact),
  // done twice so that the last one starts from a faithful q. A lane of x = +-0 takes q (the
  // correction would lose the zero's sign). Sound while s is one ScalarDivisorIsSafe takes and
  // |x| lies in [2^-64, 2^64], where nothing under- or overflows; a vector with another nonzero
  // x (tiny, huge, infinite or NaN) runs vdivps out of line.
  bool DivideByScalar(const Instr& in, const Xbyak::Xmm& d);
  // d = RoundToBf16(a) (core/float_ops.h); false when AVX2 finds no register for its temporary.
  bool RoundToBf16(const Instr& in, const Xbyak::Xmm& d);
  // d = a & b, a | b or a ^ b, bit by bit: AVX-512F's integer forms (its vandps needs
  // AVX512DQ), AVX's float ones.
  void Bits(const Xbyak::Xmm& d, const Xbyak::Xmm& a, const Xbyak::Xmm& b, BitOp op);
  // The mask of `pred(a, b)`: k1 (AVX-512) or Mask() (AVX2).
  void Compare(const Xbyak::Xmm& a, const Xbyak::Xmm& b, uint8_t pred);
  // d = src where the last Compare held.
  void Take(const Xbyak::Xmm& d, const Xbyak::Xmm& src);
  // NanPropagatingMax / Min (core/float_ops.h), lowest precedence first: of equal values a & b
  // (max) or a | b (min); the greater (lesser); b if NaN; a if NaN.
  void MaxOrMin(const Xbyak::Xmm& d, const Xbyak::Xmm& a, const Xbyak::Xmm& b, bool max);

  const bool avx512_;
  const std::vector<Instr> instrs_;
  const std::vector<bool> is_scalar_;
  const std::vector<bool> updated_in_place_;
  const std::vector<int> output_instrs_;
  const bool reciprocal_division_;
  const int n_;
  struct SlowDivision {
    Xbyak::Label slow, back;
    int d = 0, x = 0, s = 0;  // registers
  };
  std::deque<SlowDivision> slow_divisions_;  // emitted after the loop
  std::vector<int> reciprocal_;        // per input row: the register holding 1 / it when a division
                                       // divides by it (a scalar, AVX-512: DivideByScalar), else -1
  std::vector<int> last_use_;          // per row: the last op reading it, -1 if none
  std::vector<int> reg_;               // per row: its zmm register while live, -1 otherwise
  std::vector<int> free_;              // zmm registers not in use
  std::map<uint32_t, int> constants_;  // bit pattern -> zmm register
};

}  // namespace fused_jit
}  // namespace meshrun

#endif  // MESHRUN_WORKER_KERNELS_FUSED_ELEMENTWISE_JIT_GENERATOR_H_
