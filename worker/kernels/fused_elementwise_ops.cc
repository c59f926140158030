// The interpreter's ops (fused_elementwise_ops.h). Compiled with -ffp-contract=off
// (worker/CMakeLists.txt): a multiply followed by an add must round twice, as the separate
// primitives and the compiled loop do; and -fno-math-errno, so that sqrt vectorises (errno is
// never read).
#include "worker/kernels/fused_elementwise_ops.h"

#include <cmath>

#include "core/float_ops.h"

namespace meshrun {
namespace fused {

const std::map<std::string, std::pair<Fn, int>>& Fns() {
  static const auto* fns = new std::map<std::string, std::pair<Fn, int>>{
      {"add", {Fn::kAdd, 2}},   {"sub", {Fn::kSub, 2}},       {"mul", {Fn::kMul, 2}},
      {"div", {Fn::kDiv, 2}},   {"max", {Fn::kMax, 2}},       {"min", {Fn::kMin, 2}},
      {"eq", {Fn::kEq, 2}},     {"ne", {Fn::kNe, 2}},         {"lt", {Fn::kLt, 2}},
      {"le", {Fn::kLe, 2}},     {"gt", {Fn::kGt, 2}},         {"ge", {Fn::kGe, 2}},
      {"neg", {Fn::kNeg, 1}},   {"abs", {Fn::kAbs, 1}},       {"square", {Fn::kSquare, 1}},
      {"sqrt", {Fn::kSqrt, 1}}, {"select", {Fn::kSelect, 3}}, {"round_bf16", {Fn::kRoundBf16, 1}}};
  return *fns;
}

// r[j] = EXPR(a, b) for j < m, with a = x[j] (or x[0]) and b = y[j] (or y[0]) by `scalar`.
#define MESHRUN_BINARY_LOOP(EXPR)       \
  do {                                  \
    if (scalar == kScalarX) {           \
      const float a = x[0];             \
      for (int64_t j = 0; j < m; ++j) { \
        const float b = y[j];           \
        r[j] = (EXPR);                  \
      }                                 \
    } else if (scalar == kScalarY) {    \
      const float b = y[0];             \
      for (int64_t j = 0; j < m; ++j) { \
        const float a = x[j];           \
        r[j] = (EXPR);                  \
      }                                 \
    } else {                            \
      for (int64_t j = 0; j < m; ++j) { \
        const float a = x[j], b = y[j]; \
        r[j] = (EXPR);                  \
      }                                 \
    }                                   \
  } while (0)

// One block: r = fn(x, y[, z]) over m elements, in clones for AVX-512, AVX2 and the baseline
// chosen at load time (the same IEEE operations in each, so the same bits). `scalar` says which
// operand of a two-operand fn is a single value (x[0] or y[0]).
__attribute__((target_clones("avx512f", "avx2", "default"))) void Apply(
    Fn fn, Scalar scalar, const float* __restrict x, const float* __restrict y,
    const float* __restrict z, float* __restrict r, int64_t m) {
  switch (fn) {
    case Fn::kAdd:
      MESHRUN_BINARY_LOOP(a + b);
      break;
    case Fn::kSub:
      MESHRUN_BINARY_LOOP(a - b);
      break;
    case Fn::kMul:
      MESHRUN_BINARY_LOOP(a * b);
      break;
    case Fn::kDiv:
      MESHRUN_BINARY_LOOP(a / b);
      break;
    case Fn::kMax:
      MESHRUN_BINARY_LOOP(NanPropagatingMax(a, b));
      break;
    case Fn::kMin:
      MESHRUN_BINARY_LOOP(NanPropagatingMin(a, b));
      break;
    case Fn::kEq:
      MESHRUN_BINARY_LOOP(a == b ? 1.0f : 0.0f);
      break;
    case Fn::kNe:
      MESHRUN_BINARY_LOOP(a != b ? 1.0f : 0.0f);
      break;
    case Fn::kLt:
      MESHRUN_BINARY_LOOP(a < b ? 1.0f : 0.0f);
      break;
    case Fn::kLe:
      MESHRUN_BINARY_LOOP(a <= b ? 1.0f : 0.0f);
      break;
    case Fn::kGt:
      MESHRUN_BINARY_LOOP(a > b ? 1.0f : 0.0f);
      break;
    case Fn::kGe:
      MESHRUN_BINARY_LOOP(a >= b ? 1.0f : 0.0f);
      break;
    case Fn::kNeg:
      for (int64_t j = 0; j < m; ++j) r[j] = -x[j];
      break;
    case Fn::kAbs:
      for (int64_t j = 0; j < m; ++j) r[j] = std::fabs(x[j]);
      break;
    case Fn::kSelect:
      for (int64_t j = 0; j < m; ++j) r[j] = x[j] != 0.0f ? z[j] : y[j];
      break;
    case Fn::kSquare:
      for (int64_t j = 0; j < m; ++j) r[j] = x[j] * x[j];
      break;
    case Fn::kSqrt:
      for (int64_t j = 0; j < m; ++j) r[j] = std::sqrt(x[j]);
      break;
    case Fn::kRoundBf16:
      for (int64_t j = 0; j < m; ++j) r[j] = RoundToBf16(x[j]);
      break;
  }
}

#undef MESHRUN_BINARY_LOOP

}  // namespace fused
}  // namespace meshrun
