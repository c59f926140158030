// FusedElementwiseJit (fused_elementwise_jit.h): Xbyak emits one loop over vectors of 16 (zmm,
// AVX-512) or 8 (ymm, AVX2) floats. Register use: vector registers are handed out as the ops are
// walked in order, an operand's register freed after its last reader; scalar inputs and constants
// keep theirs for the whole loop; compares write k1 (AVX-512) or ymm15 (AVX2). rdi: inputs,
// rsi: outputs, rdx: the end byte offset, rcx: the byte offset, r8: a pointer read from inputs /
// outputs.
#include "worker/kernels/fused_elementwise_jit.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>

#include "xbyak/xbyak.h"
#include "xbyak/xbyak_util.h"

namespace meshrun {
namespace {

using fused::Fn;
using fused::Instr;

// vcmpps predicates (Intel SDM, table 3-1): ordered compares are false with a NaN operand, as
// C++'s ==, <, <=, >, >= are; != is unordered (true with a NaN), as C++'s is.
constexpr uint8_t kEqOq = 0x00, kUnordQ = 0x03, kNeqUq = 0x04, kLtOq = 0x11, kLeOq = 0x12,
                  kGeOq = 0x1d, kGtOq = 0x1e;

enum class BitOp { kAnd, kOr, kXor };

bool Unary(Fn fn) {
  return fn == Fn::kNeg || fn == Fn::kAbs || fn == Fn::kSquare || fn == Fn::kSqrt;
}

std::vector<int> Operands(const Instr& in) {
  if (Unary(in.fn)) return {in.a};
  if (in.fn == Fn::kSelect) return {in.a, in.b, in.c};
  return {in.a, in.b};
}

std::optional<uint8_t> ComparePredicate(Fn fn) {
  switch (fn) {
    case Fn::kEq:
      return kEqOq;
    case Fn::kNe:
      return kNeqUq;
    case Fn::kLt:
      return kLtOq;
    case Fn::kLe:
      return kLeOq;
    case Fn::kGt:
      return kGtOq;
    case Fn::kGe:
      return kGeOq;
    default:
      return std::nullopt;
  }
}

// A division x / s whose divisor is a scalar input and whose dividend is not.
bool IsScalarDivision(const Instr& in, const std::vector<bool>& is_scalar) {
  const int n = static_cast<int>(is_scalar.size());
  return in.fn == Fn::kDiv && in.b < n && is_scalar[in.b] && !(in.a < n && is_scalar[in.a]);
}

// The dividends DivideByScalar divides without the divider: |x| in [2^-64, 2^64], as bits
// 0x1f800000 + [0, 0x40000000].
constexpr uint32_t kSafeLowBits = 0x1f800000u, kSafeRangeBits = 0x40000000u;

// A divisor DivideByScalar's loop takes: 2^-32 <= |s| <= 2^32 (so 1/s and every quotient of a
// dividend in its range are normal and finite).
bool ScalarDivisorIsSafe(float s) {
  const float m = std::fabs(s);
  return m >= 0x1p-32f && m <= 0x1p32f;  // false for NaN
}

// Room for the code: about 40 bytes per op (max and min take 9 instructions), and the loop.
constexpr size_t kCodeBytes = 64 * 1024;

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
  bool Emit() {
    const int rows = n_ + static_cast<int>(instrs_.size());
    last_use_.assign(rows, -1);
    for (size_t k = 0; k < instrs_.size(); ++k) {
      for (int r : Operands(instrs_[k])) last_use_[r] = static_cast<int>(k);
    }
    reg_.assign(rows, -1);
    // AVX2 keeps its last register for compare masks (AVX-512 has k1 for those).
    for (int i = avx512_ ? 31 : 14; i >= 0; --i) free_.push_back(i);
    if (!Prologue()) return false;
    Xbyak::Label loop, done;
    xor_(ecx, ecx);
    shl(rdx, avx512_ ? 6 : 5);
    test(rdx, rdx);
    jz(done, T_NEAR);
    L(loop);
    if (!Body()) return false;
    add(rcx, avx512_ ? 64 : 32);
    cmp(rcx, rdx);
    jb(loop, T_NEAR);
    L(done);
    vzeroupper();
    ret();
    for (SlowDivision& slow : slow_divisions_) {  // out of line: vectors DivideByScalar hands on
      L(slow.slow);
      vdivps(Vec(slow.d), Vec(slow.x), Vec(slow.s));
      jmp(slow.back, T_NEAR);
    }
    return true;
  }

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

  // Constants the ops need, the scalar inputs, broadcast once, and 1 / s of DivideByScalar's
  // divisors.
  bool Prologue() {
    bool sign = false, abs = false, one = false, zero = false;
    divisor_.assign(n_, false);
    reciprocal_.assign(n_, -1);
    for (const Instr& in : instrs_) {
      sign |= in.fn == Fn::kNeg;
      abs |= in.fn == Fn::kAbs;
      one |= ComparePredicate(in.fn).has_value();
      zero |= in.fn == Fn::kSelect;
      if (reciprocal_division_ && IsScalarDivision(in, is_scalar_)) divisor_[in.b] = true;
    }
    const bool divides = std::count(divisor_.begin(), divisor_.end(), true) > 0;
    const std::pair<bool, uint32_t> wanted[] = {
        {sign, 0x80000000u},   {abs || divides, 0x7fffffffu}, {one, 0x3f800000u},
        {zero || divides, 0u}, {divides, kSafeLowBits},       {divides, kSafeRangeBits}};
    for (const auto& [want, bits] : wanted) {
      if (!want) continue;
      std::optional<int> r = Allocate();
      if (!r) return false;
      constants_[bits] = *r;
      mov(eax, bits);
      if (avx512_) {
        vpbroadcastd(Vec(*r), eax);
      } else {
        vmovd(Xbyak::Xmm(*r), eax);
        vpbroadcastd(Vec(*r), Xbyak::Xmm(*r));
      }
    }
    for (int r = 0; r < n_; ++r) {
      if (!is_scalar_[r] || last_use_[r] < 0) continue;
      std::optional<int> z = Allocate();
      if (!z) return false;
      reg_[r] = *z;
      mov(r8, ptr[rdi + 8 * r]);
      vbroadcastss(Row(r), dword[r8]);
      if (!divisor_[r]) continue;
      std::optional<int> y = Allocate();  // 1 / s, correctly rounded
      if (!y) return false;
      mov(eax, 0x3f800000u);
      vmovd(Xbyak::Xmm(*y), eax);
      vbroadcastss(Vec(*y), Xbyak::Xmm(*y));
      vdivps(Vec(*y), Vec(*y), Row(r));
      reciprocal_[r] = *y;
    }
    return true;
  }
  Xbyak::Xmm Constant(uint32_t bits) const { return Vec(constants_.at(bits)); }

  // One vector: each streamed input loaded before its first reader (those an output updates in
  // place before any store), each output stored as soon as its op has run.
  bool Body() {
    for (int r = 0; r < n_; ++r) {
      if (!is_scalar_[r] && last_use_[r] >= 0 && updated_in_place_[r] && !Load(r)) return false;
    }
    for (size_t k = 0; k < instrs_.size(); ++k) {
      for (int r : Operands(instrs_[k])) {
        if (r < n_ && reg_[r] < 0 && !Load(r)) return false;
      }
      const int row = n_ + static_cast<int>(k);
      std::optional<int> z = Allocate();
      if (!z) return false;
      reg_[row] = *z;
      if (!EmitOp(instrs_[k], Row(row))) return false;
      for (size_t o = 0; o < output_instrs_.size(); ++o) {
        if (output_instrs_[o] != static_cast<int>(k)) continue;
        mov(r8, ptr[rsi + 8 * o]);
        vmovups(ptr[r8 + rcx], Row(row));
      }
      std::vector<int> dying = Operands(instrs_[k]);
      if (last_use_[row] < 0) dying.push_back(row);  // read by no later op
      std::sort(dying.begin(), dying.end());
      dying.erase(std::unique(dying.begin(), dying.end()), dying.end());
      for (int r : dying) {
        if ((r < n_ && is_scalar_[r]) || (last_use_[r] > static_cast<int>(k))) continue;
        free_.push_back(reg_[r]);
        reg_[r] = -1;
      }
    }
    return true;
  }
  bool Load(int r) {
    std::optional<int> z = Allocate();
    if (!z) return false;
    reg_[r] = *z;
    mov(r8, ptr[rdi + 8 * r]);
    vmovups(Row(r), ptr[r8 + rcx]);
    return true;
  }

  // False when a division by a scalar finds no registers for its temporaries.
  bool EmitOp(const Instr& in, const Xbyak::Xmm& d) {
    const Xbyak::Xmm a = Row(in.a);
    if (std::optional<uint8_t> pred = ComparePredicate(in.fn)) {
      Compare(a, Row(in.b), *pred);
      if (avx512_) {
        Bits(d, d, d, BitOp::kXor);
        vmovaps(d | k1, Constant(0x3f800000u));
      } else {
        vandps(d, Mask(), Constant(0x3f800000u));  // all ones -> 1.0f, zeros -> 0.0f
      }
      return true;
    }
    if (in.fn == Fn::kDiv && in.b < n_ && divisor_[in.b]) return DivideByScalar(in, d);
    EmitArithmetic(in, d);
    return true;
  }
  void EmitArithmetic(const Instr& in, const Xbyak::Xmm& d) {
    const Xbyak::Xmm a = Row(in.a);
    switch (in.fn) {
      case Fn::kAdd:
        return vaddps(d, a, Row(in.b));
      case Fn::kSub:
        return vsubps(d, a, Row(in.b));
      case Fn::kMul:
        return vmulps(d, a, Row(in.b));
      case Fn::kDiv:
        return vdivps(d, a, Row(in.b));
      case Fn::kMax:
        return MaxOrMin(d, a, Row(in.b), /*max=*/true);
      case Fn::kMin:
        return MaxOrMin(d, a, Row(in.b), /*max=*/false);
      case Fn::kNeg:
        return Bits(d, a, Constant(0x80000000u), BitOp::kXor);
      case Fn::kAbs:
        return Bits(d, a, Constant(0x7fffffffu), BitOp::kAnd);
      case Fn::kSquare:
        return vmulps(d, a, a);
      case Fn::kSqrt:
        return vsqrtps(d, a);
      case Fn::kSelect:  // x != 0 ? z : y
        Compare(a, Constant(0u), kNeqUq);
        vmovaps(d, Row(in.b));
        Take(d, Row(in.c));
        return;
      default:
        return;  // the compares, above
    }
  }

  // d = x / s for a scalar input s, correctly rounded as vdivps is, without the divider (whose
  // throughput bounds a loop such as Adam's bias corrections): with y = 1/s from the prologue,
  // q = x * y, then Markstein's correction q + (x - q * s) * y (two FMAs, the remainder exact),
  // done twice so that the last one starts from a faithful q. A lane of x = +-0 takes q (the
  // correction would lose the zero's sign). Sound while s is one ScalarDivisorIsSafe takes and
  // |x| lies in [2^-64, 2^64], where nothing under- or overflows; a vector with another nonzero
  // x (tiny, huge, infinite or NaN) runs vdivps out of line.
  bool DivideByScalar(const Instr& in, const Xbyak::Xmm& d) {
    const Xbyak::Xmm x = Row(in.a), s = Row(in.b);
    const Xbyak::Zmm y(reciprocal_[in.b]), zero(constants_.at(0u)), abs(constants_.at(0x7fffffffu)),
        low(constants_.at(kSafeLowBits)), range(constants_.at(kSafeRangeBits));
    std::optional<int> r1 = Allocate(), r2 = Allocate();
    if (!r1 || !r2) return false;
    const Xbyak::Xmm q = Vec(*r1), e = Vec(*r2);
    vmulps(q, x, y);
    vmovaps(d, q);
    for (int step = 0; step < 2; ++step) {
      vmovaps(e, x);
      vfnmadd231ps(e, d, s);  // e = x - d * s, exactly
      vfmadd231ps(d, e, y);   // d += e * y, rounded once
    }
    SlowDivision& slow = slow_divisions_.emplace_back();
    slow.d = d.getIdx();
    slow.x = x.getIdx();
    slow.s = s.getIdx();
    vcmpps(k2, x, zero, kEqOq);
    vmovaps(d | k2, q);
    vpandd(e, x, abs);
    vpsubd(e, e, low);
    vpcmpud(k1, e, range, 6);          // |x| outside the range (NLE, unsigned)
    vcmpps(k1 | k1, x, zero, kNeqUq);  // ... and x nonzero
    kortestw(k1, k1);
    jnz(slow.slow, T_NEAR);
    L(slow.back);
    free_.push_back(*r2);
    free_.push_back(*r1);
    return true;
  }

  // d = a & b, a | b or a ^ b, bit by bit: AVX-512F's integer forms (its vandps needs
  // AVX512DQ), AVX's float ones.
  void Bits(const Xbyak::Xmm& d, const Xbyak::Xmm& a, const Xbyak::Xmm& b, BitOp op) {
    if (op == BitOp::kAnd) return avx512_ ? vpandd(d, a, b) : vandps(d, a, b);
    if (op == BitOp::kOr) return avx512_ ? vpord(d, a, b) : vorps(d, a, b);
    return avx512_ ? vpxord(d, a, b) : vxorps(d, a, b);
  }

  // The mask of `pred(a, b)`: k1 (AVX-512) or Mask() (AVX2).
  void Compare(const Xbyak::Xmm& a, const Xbyak::Xmm& b, uint8_t pred) {
    if (avx512_) {
      vcmpps(k1, a, b, pred);
    } else {
      vcmpps(Mask(), a, b, pred);
    }
  }
  // d = src where the last Compare held.
  void Take(const Xbyak::Xmm& d, const Xbyak::Xmm& src) {
    if (avx512_) {
      vmovaps(d | k1, src);
    } else {
      vblendvps(d, d, src, Mask());
    }
  }

  // NanPropagatingMax / Min (core/float_ops.h), lowest precedence first: of equal values a & b
  // (max) or a | b (min); the greater (lesser); b if NaN; a if NaN.
  void MaxOrMin(const Xbyak::Xmm& d, const Xbyak::Xmm& a, const Xbyak::Xmm& b, bool max) {
    Bits(d, a, b, max ? BitOp::kAnd : BitOp::kOr);
    Compare(a, b, max ? kLtOq : kGtOq);
    Take(d, b);
    Compare(a, b, max ? kGtOq : kLtOq);
    Take(d, a);
    Compare(b, b, kUnordQ);
    Take(d, b);
    Compare(a, a, kUnordQ);
    Take(d, a);
  }

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
  std::vector<bool> divisor_;                // per input row: a scalar DivideByScalar divides by
  std::vector<int> reciprocal_;              // per input row: 1 / it's register (AVX-512), else -1
  std::vector<int> last_use_;                // per row: the last op reading it, -1 if none
  std::vector<int> reg_;                     // per row: its zmm register while live, -1 otherwise
  std::vector<int> free_;                    // zmm registers not in use
  std::map<uint32_t, int> constants_;        // bit pattern -> zmm register
};

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
