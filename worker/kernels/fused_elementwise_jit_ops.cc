// Generator (fused_elementwise_jit_generator.h): each op's instructions, the same IEEE operation
// the interpreter's loops run (fused_elementwise_ops.h).
#include <optional>

#include "worker/kernels/fused_elementwise_jit_generator.h"

namespace meshrun {
namespace fused_jit {

bool Generator::EmitOp(const Instr& in, const Xbyak::Xmm& d) {
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
  if (in.fn == Fn::kDiv && in.b < n_ && reciprocal_[in.b] >= 0) return DivideByScalar(in, d);
  if (in.fn == Fn::kRoundBf16) return RoundToBf16(in, d);
  EmitArithmetic(in, d);
  return true;
}

void Generator::EmitArithmetic(const Instr& in, const Xbyak::Xmm& d) {
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

bool Generator::DivideByScalar(const Instr& in, const Xbyak::Xmm& d) {
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

// RoundToBf16 (core/float_ops.h): (x + 0x7fff + (x >> 16 & 1)) & 0xffff0000, and a NaN lane
// the quiet NaN of its sign, (x & 0x80000000) | kQuietNanBits (AVX-512: masked ops in place;
// AVX2: in a temporary, then blended).
bool Generator::RoundToBf16(const Instr& in, const Xbyak::Xmm& d) {
  const Xbyak::Xmm a = Row(in.a);
  vpsrld(d, a, 16);
  Bits(d, d, Constant(1u), BitOp::kAnd);
  vpaddd(d, d, a);
  vpaddd(d, d, Constant(0x7fffu));
  Bits(d, d, Constant(0xffff0000u), BitOp::kAnd);
  Compare(a, a, kUnordQ);
  if (avx512_) {
    vpandd(d | k1, a, Constant(0x80000000u));
    vpord(d | k1, d, Constant(kQuietNanBits));
    return true;
  }
  std::optional<int> r = Allocate();
  if (!r) return false;
  const Xbyak::Xmm nan = Vec(*r);
  Bits(nan, a, Constant(0x80000000u), BitOp::kAnd);
  Bits(nan, nan, Constant(kQuietNanBits), BitOp::kOr);
  Take(d, nan);
  free_.push_back(*r);
  return true;
}

void Generator::Bits(const Xbyak::Xmm& d, const Xbyak::Xmm& a, const Xbyak::Xmm& b, BitOp op) {
  if (op == BitOp::kAnd) return avx512_ ? vpandd(d, a, b) : vandps(d, a, b);
  if (op == BitOp::kOr) return avx512_ ? vpord(d, a, b) : vorps(d, a, b);
  return avx512_ ? vpxord(d, a, b) : vxorps(d, a, b);
}

void Generator::Compare(const Xbyak::Xmm& a, const Xbyak::Xmm& b, uint8_t pred) {
  if (avx512_) {
    vcmpps(k1, a, b, pred);
  } else {
    vcmpps(Mask(), a, b, pred);
  }
}

void Generator::Take(const Xbyak::Xmm& d, const Xbyak::Xmm& src) {
  if (avx512_) {
    vmovaps(d | k1, src);
  } else {
    vblendvps(d, d, src, Mask());
  }
}

void Generator::MaxOrMin(const Xbyak::Xmm& d, const Xbyak::Xmm& a, const Xbyak::Xmm& b, bool max) {
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

}  // namespace fused_jit
}  // namespace meshrun
