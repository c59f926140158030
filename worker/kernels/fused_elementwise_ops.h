// The compiled form of a fused element-wise loop (kernel.h's CreateFusedElementwise), shared by its
// interpreter (fused_elementwise.cc) and its code generator (fused_elementwise_jit.h), and the
// interpreter's per-op step.
#ifndef MESHRUN_WORKER_KERNELS_FUSED_ELEMENTWISE_OPS_H_
#define MESHRUN_WORKER_KERNELS_FUSED_ELEMENTWISE_OPS_H_

#include <cstdint>
#include <map>
#include <string>
#include <utility>

namespace meshrun {
namespace fused {

// Each fn is the IEEE f32 operation the separate primitive rounds as: max and min are lax's
// (core/float_ops.h: NaN-propagating, max(-0, +0) = +0); comparisons give 1.0f or 0.0f;
// select(x, y, z) is x != 0 ? z : y; round_bf16 is core/float_ops.h's RoundToBf16 (x rounded to
// bf16 and widened back).
enum class Fn {
  kAdd,
  kSub,
  kMul,
  kDiv,
  kMax,
  kMin,
  kEq,
  kNe,
  kLt,
  kLe,
  kGt,
  kGe,
  kNeg,
  kAbs,
  kSquare,
  kSqrt,
  kSelect,
  kRoundBf16
};

// Which operand of a two-operand op is one value for every element (a one-element input):
// the interpreter's loop then reads it once, not a broadcast row per element.
enum Scalar : int { kNoScalar = 0, kScalarX = 1, kScalarY = 2 };

// One op: rows are the inputs (0 .. inputs - 1), then each op's result (inputs + op index).
// A one-operand fn reads a; select reads a, b and c.
struct Instr {
  Fn fn;
  int a = 0, b = 0, c = 0;
  Scalar scalar = kNoScalar;  // a two-operand fn's one-element input, if exactly one is
};

// program.proto's fn names: name -> (fn, number of operands).
const std::map<std::string, std::pair<Fn, int>>& Fns();

// The interpreter's step: r[j] = fn(x[j], y[j], z[j]) for j < m, reading x[0] (y[0]) for every
// j where `scalar` says so; z is read by select only. In clones for AVX-512, AVX2 and the
// baseline, picked at load time (the same IEEE operations in each, so the same bits).
void Apply(Fn fn, Scalar scalar, const float* __restrict x, const float* __restrict y,
           const float* __restrict z, float* __restrict r, int64_t m);

}  // namespace fused
}  // namespace meshrun

#endif  // MESHRUN_WORKER_KERNELS_FUSED_ELEMENTWISE_OPS_H_
