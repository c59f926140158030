// Generator (fused_elementwise_jit_generator.h): the loop, the prologue that broadcasts scalars
// and constants, and the register each row holds while live.
#include "worker/kernels/fused_elementwise_jit_generator.h"

#include <algorithm>
#include <cmath>

namespace meshrun {
namespace fused_jit {

namespace {

bool Unary(Fn fn) {
  return fn == Fn::kNeg || fn == Fn::kAbs || fn == Fn::kSquare || fn == Fn::kSqrt ||
         fn == Fn::kRoundBf16;
}

}  // namespace

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

bool IsScalarDivision(const Instr& in, const std::vector<bool>& is_scalar) {
  const int n = static_cast<int>(is_scalar.size());
  return in.fn == Fn::kDiv && in.b < n && is_scalar[in.b] && !(in.a < n && is_scalar[in.a]);
}

bool ScalarDivisorIsSafe(float s) {
  const float m = std::fabs(s);
  return m >= 0x1p-32f && m <= 0x1p32f;  // false for NaN
}

bool Generator::Emit() {
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

bool Generator::Prologue() {
  bool sign = false, abs = false, one = false, zero = false, round = false;
  std::vector<bool> divisor(n_, false);  // per input row: a scalar DivideByScalar divides by
  reciprocal_.assign(n_, -1);
  for (const Instr& in : instrs_) {
    sign |= in.fn == Fn::kNeg;
    abs |= in.fn == Fn::kAbs;
    one |= ComparePredicate(in.fn).has_value();
    zero |= in.fn == Fn::kSelect;
    round |= in.fn == Fn::kRoundBf16;
    if (reciprocal_division_ && IsScalarDivision(in, is_scalar_)) divisor[in.b] = true;
  }
  const bool divides = std::count(divisor.begin(), divisor.end(), true) > 0;
  const std::pair<bool, uint32_t> wanted[] = {{sign || round, 0x80000000u},
                                              {abs || divides, 0x7fffffffu},
                                              {one, 0x3f800000u},
                                              {zero || divides, 0u},
                                              {divides, kSafeLowBits},
                                              {divides, kSafeRangeBits},
                                              {round, 1u},
                                              {round, 0x7fffu},
                                              {round, 0xffff0000u},
                                              {round, kQuietNanBits}};
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
    if (!divisor[r]) continue;
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

bool Generator::Body() {
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

bool Generator::Load(int r) {
  std::optional<int> z = Allocate();
  if (!z) return false;
  reg_[r] = *z;
  mov(r8, ptr[rdi + 8 * r]);
  vmovups(Row(r), ptr[r8 + rcx]);
  return true;
}

}  // namespace fused_jit
}  // namespace meshrun
