// FusedElementwiseJit (fused_elementwise_jit.h): Xbyak emits one loop over vectors of 16 (zmm,
// AVX-512) or 8 (ymm, AVX2) floats. Register use: vector registers are handed out as the ops are
// walked in order, an operand's register freed after its last reader; scalar inputs and constants
// keep theirs for the whole loop; compares write k1 (AVX-512) or ymm15 (AVX2). rdi: inputs,
// rsi: outputs, rdx: the end byte offset, rcx: the byte offset, r8: a pointer read from inputs /
// outputs.
#include "worker/kernels/fused_elementwise_jit.h"

#include <algorithm>
#include <cstdint>
#include <map>
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

// Room for the code: about 40 bytes per op (max and min take 9 instructions), and the loop.
constexpr size_t kCodeBytes = 64 * 1024;

// Written read-write, then made read-execute (never both at once).
class Generator : public Xbyak::CodeGenerator {
 public:
  Generator(bool avx512, const std::vector<Instr>& instrs, const std::vector<bool>& is_scalar,
            const std::vector<bool>& updated_in_place, const std::vector<int>& output_instrs)
      : Xbyak::CodeGenerator(kCodeBytes, Xbyak::DontSetProtectRWE),
        avx512_(avx512),
        instrs_(instrs),
        is_scalar_(is_scalar),
        updated_in_place_(updated_in_place),
        output_instrs_(output_instrs),
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

  // Constants the ops need, and the scalar inputs, broadcast once.
  bool Prologue() {
    bool sign = false, abs = false, one = false, zero = false;
    for (const Instr& in : instrs_) {
      sign |= in.fn == Fn::kNeg;
      abs |= in.fn == Fn::kAbs;
      one |= ComparePredicate(in.fn).has_value();
      zero |= in.fn == Fn::kSelect;
    }
    const std::pair<bool, uint32_t> wanted[] = {
        {sign, 0x80000000u}, {abs, 0x7fffffffu}, {one, 0x3f800000u}, {zero, 0u}};
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
      EmitOp(instrs_[k], Row(row));
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

  void EmitOp(const Instr& in, const Xbyak::Xmm& d) {
    const Xbyak::Xmm a = Row(in.a);
    if (std::optional<uint8_t> pred = ComparePredicate(in.fn)) {
      Compare(a, Row(in.b), *pred);
      if (avx512_) {
        Bits(d, d, d, BitOp::kXor);
        vmovaps(d | k1, Constant(0x3f800000u));
      } else {
        vandps(d, Mask(), Constant(0x3f800000u));  // all ones -> 1.0f, zeros -> 0.0f
      }
      return;
    }
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
  const int n_;
  std::vector<int> last_use_;          // per row: the last op reading it, -1 if none
  std::vector<int> reg_;               // per row: its zmm register while live, -1 otherwise
  std::vector<int> free_;              // zmm registers not in use
  std::map<uint32_t, int> constants_;  // bit pattern -> zmm register
};

class Compiled : public FusedElementwiseJit {
 public:
  Compiled(std::unique_ptr<Generator> gen, int64_t lanes)
      : gen_(std::move(gen)),
        fn_(gen_->getCode<void (*)(const float* const*, float* const*, int64_t)>()),
        lanes_(lanes) {}
  int64_t lanes() const override { return lanes_; }
  void Run(const float* const* inputs, float* const* outputs, int64_t vectors) const override {
    fn_(inputs, outputs, vectors);
  }

 private:
  std::unique_ptr<Generator> gen_;
  void (*fn_)(const float* const*, float* const*, int64_t);
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
  auto gen =
      std::make_unique<Generator>(avx512, instrs, is_scalar, updated_in_place, output_instrs);
  try {
    if (!gen->Emit()) return nullptr;
    gen->ready();
    gen->setProtectModeRE();
  } catch (const Xbyak::Error&) {  // more code than fits, or a buffer the OS will not execute
    return nullptr;
  }
  return std::make_unique<Compiled>(std::move(gen), avx512 ? 16 : 8);
}

}  // namespace meshrun
