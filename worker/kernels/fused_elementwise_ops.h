// The compiled form of a fused element-wise loop (kernel.h's CreateFusedElementwise), shared by its
// interpreter (fused_elementwise.cc) and its AVX-512 code generator (fused_elementwise_jit.h).
#ifndef MESHRUN_WORKER_KERNELS_FUSED_ELEMENTWISE_OPS_H_
#define MESHRUN_WORKER_KERNELS_FUSED_ELEMENTWISE_OPS_H_

namespace meshrun {
namespace fused {

// Each fn is the IEEE f32 operation the separate primitive rounds as: max and min are lax's
// (core/float_ops.h: NaN-propagating, max(-0, +0) = +0); comparisons give 1.0f or 0.0f;
// select(x, y, z) is x != 0 ? z : y.
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
  kSelect
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

}  // namespace fused
}  // namespace meshrun

#endif  // MESHRUN_WORKER_KERNELS_FUSED_ELEMENTWISE_OPS_H_
