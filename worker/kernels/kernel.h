// The compute kernels a worker runs, each a oneDNN primitive created once over fixed buffers and
// then executed any number of times. This folder is the only place that includes dnnl.hpp; every
// dnnl::error is caught here and returned as absl::Status.
#ifndef MESHRUN_WORKER_KERNELS_KERNEL_H_
#define MESHRUN_WORKER_KERNELS_KERNEL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/tensor.h"

namespace meshrun {

// A primitive bound to its buffers. Run() is not thread-safe for one kernel; distinct kernels may
// run concurrently. The Tensors given at creation must outlive the kernel and must not move; their
// memory may change between runs (each run reads and writes the tensors' current storage).
class Kernel {
 public:
  virtual ~Kernel() = default;
  // Errors: Internal carrying oneDNN's message.
  virtual absl::Status Run() = 0;
};

// Sets the number of compute threads oneDNN uses on the calling thread (OpenMP runtime).
void SetComputeThreads(int num_threads);

// c [m, n] = alpha * op(a) @ op(b) (+ bias [n] broadcast over rows) (+ c when accumulate):
// GEMM with beta in {0, 1} (oneDNN output scales and a sum post-op). op(a) is [m, k]: a is stored
// [m, k], or [k, m] when transpose_a. op(b) is [k, n]: b stored [k, n], or [n, k] when
// transpose_b. Also batched: a [B, M, K] @ b [B, K, N] -> c [B, M, N] (no transposes or bias).
// a and b are both f32, or both bf16 (mixed precision: products accumulated in f32, as
// jnp.dot(..., preferred_element_type=...) with bf16 operands; AVX512-BF16 / AMX kernels where the
// CPU has them, chosen by oneDNN at run time; where oneDNN has no bf16 matmul, below AVX512 core,
// the operands are widened to f32 first: the same products and f32 sums); c and bias are f32 or
// bf16 either way.
// With an `activation`, c = activation(the product + bias), applied to the f32 accumulator by
// oneDNN's eltwise post-op before c is stored (one pass instead of a GEMM and an eltwise
// primitive): one of CreateUnary's oneDNN fns but pow (tanh exp log sqrt rsqrt neg abs square relu
// logistic silu); f32 results are bitwise those of the matmul then CreateUnary.
// REQUIRES: no bias when alpha != 1. Errors: InvalidArgument naming the mismatched dims, the
// unsupported dtype, or an unknown activation, or one with `accumulate` or alpha != 1.
struct MatmulOptions {
  bool transpose_a = false;
  bool transpose_b = false;
  float alpha = 1.0f;
  bool accumulate = false;
  std::string activation{};  // empty: none
};
absl::StatusOr<std::unique_ptr<Kernel>> CreateMatmul(const Tensor& a, const Tensor& b,
                                                     const Tensor* bias, Tensor& c,
                                                     const MatmulOptions& options = {});

// out = alpha * the sum of x over its leading dims, x viewed as [rows, x.num_elements() / rows]
// and out as [1, cols], as a oneDNN matmul ones[1, rows] @ x (oneDNN's reduction primitive has
// only a slow reference kernel for this shape: 220 us against 2 us for [32, 512]).
absl::StatusOr<std::unique_ptr<Kernel>> CreateLeadingSum(const Tensor& x, int64_t rows, Tensor& out,
                                                         float alpha = 1.0f);

// y = fn(x) element-wise, f32, same shape (oneDNN eltwise). fn: sqrt rsqrt neg abs square relu
// silu, or pow (x ** exponent); tanh, exp and logistic (1 / (1 + exp(-x))) as XLA's CPU backend
// computes them (its approximations in FMAs, denormal results flushed: bitwise jax.jit's); and,
// as a loop over libm's functions, log
// (within an ulp; oneDNN 2.6's is ~1.4e-6 absolute) erf sin erfc cos tan atan asin acos sinh cosh
// atanh asinh acosh log1p expm1 exp2 floor ceil round_even round_away, lgamma (log|Gamma(x)|,
// +inf at the poles), digamma (in double; NaN at 0, -1, -2, ... and -inf, as XLA's), and erf_inv
// (XLA's polynomial, core/random/threefry.h); and round_bf16, x rounded to bf16 and widened back
// (core/float_ops.h's RoundToBf16: the bits of a convert to bf16 and back).
// Errors: InvalidArgument naming an unknown fn.
absl::StatusOr<std::unique_ptr<Kernel>> CreateUnary(const std::string& fn, const Tensor& x,
                                                    Tensor& y, float exponent = 1.0f);
// The unary fns CreateUnary computes by a loop rather than oneDNN: tanh exp logistic (XLA's
// approximations), the libm fns, erf_inv, round_bf16 and neg (the sign bit flipped, a NaN's
// too, as lax.neg). CreateLoopUnary: y = fn(x), f32, one shape
// (CreateUnary checks); null for any other fn.
bool IsLoopUnary(const std::string& fn);
std::vector<std::string> LoopUnaryFns();
std::unique_ptr<Kernel> CreateLoopUnary(const std::string& fn, const Tensor& x, Tensor& y);

// dx = dy * fn'(x) element-wise, f32, all three the same shape: the VJP of CreateUnary's fn, as a
// oneDNN eltwise backward primitive (from x, not from y). fn: tanh exp log sqrt abs square relu
// logistic silu (relu'(0) = 0, as jax.nn.relu). With `from_output`, `x` holds y = fn(x) instead
// (oneDNN's *_use_dst_for_bwd), fn relu only: y > 0 exactly where x > 0, so dx is bitwise the
// same for every x but NaN (oneDNN's relu(NaN) is 0, whose gradient is 0 where the one from x
// passes dy), and x need not be kept for the backward pass. Errors: InvalidArgument naming an
// unknown fn.
absl::StatusOr<std::unique_ptr<Kernel>> CreateUnaryGrad(const std::string& fn, const Tensor& x,
                                                        const Tensor& dy, Tensor& dx,
                                                        bool from_output = false);

// out = fn(a, b) element-wise, out shaped like a; b has a's rank with each dim equal or 1 (numpy
// broadcasting). f32: add sub mul div on oneDNN's binary primitive; pow nextafter rem atan2 max min
// and the comparisons eq ne lt le gt ge (1 or 0, IEEE's: false with a NaN but for ne) as loops
// (CreateLoopBinary). i32 and u32: the integer fns of CreateLoopBinary.
// The binary fns computed by a loop rather than oneDNN: for f32, pow, nextafter and rem
// (std::pow, std::nextafter and std::fmod, as jax.lax.pow, nextafter and rem), atan2 and max / min
// (NaN-propagating as jax.lax.max / min, core/float_ops.h, where oneDNN's binary_max drops a
// NaN) and the comparisons (oneDNN's binary_gt / ge hold for a NaN operand); for i32 and u32 (a, b
// and out one dtype), add sub mul (wrapping modulo 2^32), max min, eq ne lt le gt ge (1 or 0), and
// or xor, shift_left shift_right_logical shift_right_arithmetic (jax.lax's: a shift by 32 or more
// gives 0, or -1 for an arithmetic shift of a negative). Errors: InvalidArgument naming the fn or
// dtypes. CreateLoopBinary REQUIRES: b broadcasts to a and out has a's dims (CreateBinary checks).
bool IsLoopBinary(const std::string& fn, DType dtype);
std::string LoopBinaryFns(DType dtype);
absl::StatusOr<std::unique_ptr<Kernel>> CreateLoopBinary(const std::string& fn, const Tensor& a,
                                                         const Tensor& b, Tensor& out);
// f32 add, sub, mul or div (IEEE's, element by element, as oneDNN's binary primitive) as a
// loop: CreateBinary's kernel where oneDNN has only its reference implementation for the
// broadcast (b broadcast along the last dim, as a softmax's row max and sum are: about 100x
// slower than the loop). Errors: InvalidArgument for another fn or dtype. REQUIRES: as
// CreateLoopBinary.
absl::StatusOr<std::unique_ptr<Kernel>> CreateArithmeticLoop(const std::string& fn, const Tensor& a,
                                                             const Tensor& b, Tensor& out);

absl::StatusOr<std::unique_ptr<Kernel>> CreateBinary(const std::string& fn, const Tensor& a,
                                                     const Tensor& b, Tensor& out);

// out = fn of x over the dims where out has size 1, same rank and dtype. f32: sum mean (oneDNN's
// reduction) max min (CreateLoopReduce); i32, u32: sum max min (CreateLoopReduce).
// y = the cumulative fn (sum, prod, max or min) of x along `dim`, from its end when `reverse`
// (jax.lax.cumsum / cumprod / cummax / cummin), one shape: f32 (max / min NaN-propagating), or
// i32 / u32 in their integers (sum and prod wrapping). A loop (oneDNN has no scan).
// Errors: InvalidArgument naming an unknown fn, a dtype, shape or dim.
// out = fn of x over the dims where out has size 1, as a loop: f32 max / min NaN-propagating as
// XLA's reduce_max / reduce_min (core/float_ops.h; oneDNN's reduction drops NaN), and i32 / u32
// sum (wrapping modulo 2^32), max and min in their integers. Errors: InvalidArgument for another
// fn or dtype. REQUIRES: out of x's dtype and rank, each dim x's or 1, x not empty (CreateReduce
// checks).
absl::StatusOr<std::unique_ptr<Kernel>> CreateLoopReduce(const std::string& fn, const Tensor& x,
                                                         Tensor& out);

// y = the running `fn` of x along `dim` (from its end when `reverse`), as jax.lax.cumsum, cumprod,
// cummax, cummin and cumlogsumexp: fn "sum", "prod", "max", "min" (f32, i32 or u32; integer sums
// and products wrap modulo 2^32, f32 max / min propagate NaN) or "logsumexp" (f32 only, each step
// jnp.logaddexp). Errors: InvalidArgument for another fn, dtype, shape or dim.
absl::StatusOr<std::unique_ptr<Kernel>> CreateCumulative(const std::string& fn, int64_t dim,
                                                         bool reverse, const Tensor& x, Tensor& y);

// y = operand `result` of `operands` (f32, i32 or u32, y's shape) permuted along `dim` as
// jax.lax.sort(operands, dimension=dim, is_stable=True, num_keys) permutes it: a stable sort by
// the first num_keys operands, lexicographically, floats as lax.sort's comparator orders them
// (NaNs last; -0 equal to +0 and every NaN to every other NaN, so a stable sort keeps their order).
// Errors: InvalidArgument naming a dtype, shape, dim or key count.
absl::StatusOr<std::unique_ptr<Kernel>> CreateSort(const std::vector<const Tensor*>& operands,
                                                   int64_t dim, int num_keys, int result,
                                                   Tensor& y);

absl::StatusOr<std::unique_ptr<Kernel>> CreateReduce(const std::string& fn, const Tensor& x,
                                                     Tensor& out);

// y = x.astype(y's dtype) between f32 and bf16, as XLA converts: round to nearest even, -0.0
// and infinities kept, a NaN to the quiet NaN of its sign, 0x7FC0 or 0xFFC0 (array_ops.h's
// Convert, vectorised;
// oneDNN 2.6's reorder turned -0.0 into +0.0 below AVX512). Errors: InvalidArgument for other
// dtypes (array_ops.h's Convert covers every pair) or shapes that differ.
absl::StatusOr<std::unique_ptr<Kernel>> CreateConvert(const Tensor& x, Tensor& y);

// loss [b] = optax.softmax_cross_entropy_with_integer_labels(logits, labels): logits f32
// [b, c], labels [b] class indices (u8, i32, u32, or f32 holding integers); each row's
// logsumexp(logits) - logits[label], from oneDNN's log-softmax primitive (one pass over the
// logits, the max shifted out). Errors: InvalidArgument for other shapes or dtypes; at Run, for a
// label that is not an integer in [0, c) (naming the row and the value).
absl::StatusOr<std::unique_ptr<Kernel>> CreateSoftmaxCrossEntropy(const Tensor& logits,
                                                                  const Tensor& labels,
                                                                  Tensor& loss);

// dlogits [b, c] = (softmax(logits) - one_hot(labels)) * dloss[:, None]: the VJP of
// CreateSoftmaxCrossEntropy with respect to the logits (oneDNN's softmax primitive, then the
// label's entry and the row scale), f32. Errors: as CreateSoftmaxCrossEntropy's.
absl::StatusOr<std::unique_ptr<Kernel>> CreateSoftmaxCrossEntropyGrad(const Tensor& logits,
                                                                      const Tensor& labels,
                                                                      const Tensor& dloss,
                                                                      Tensor& dlogits);

// One op of a fused element-wise kernel: fn over args, each an input (0 .. n - 1) or an earlier
// op's result (n + k).
struct FusedInstruction {
  // add sub mul div max min eq ne lt le gt ge (2 args); neg abs square sqrt (1); select (3:
  // pred, on_false, on_true)
  std::string fn;
  std::vector<int> args;
};

// How a fused element-wise kernel runs its ops: kCompiled, as machine code holding every
// intermediate in a register (fused_elementwise_jit.h: AVX-512 where the CPU has it, else AVX2;
// interpreted on a CPU with neither); kAvx2, compiled for AVX2 even where AVX-512 exists (tests);
// kInterpreted, blocks of elements op by op through L1-resident scratch. The three give the same
// bits (NaN payloads aside).
enum class FusedLoop { kCompiled, kAvx2, kInterpreted };

// Element-wise ops fused into one pass (program.proto's OP_FUSED_ELEMENTWISE): f32 inputs of
// the outputs' shape or holding one element (broadcast), outputs[i] = the result of
// instrs[output_instrs[i]], in parallel over the compute threads. IEEE-exact ops without FMA
// contraction, so the results are bitwise those of oneDNN's separate binary and eltwise
// primitives (NaNs aside).
// Errors: InvalidArgument naming a bad fn, arg, dtype or shape.
absl::StatusOr<std::unique_ptr<Kernel>> CreateFusedElementwise(
    const std::vector<FusedInstruction>& instrs, const std::vector<const Tensor*>& inputs,
    const std::vector<int>& output_instrs, const std::vector<Tensor*>& outputs,
    FusedLoop loop = FusedLoop::kCompiled);

// A fused element-wise kernel that also runs over part of its elements, reading input 0 from
// other memory: what a single-copy all-reduce calls on each segment it reduces (program.proto's
// OP_FUSED_ELEMENTWISE with axis_names). Same arguments and errors as CreateFusedElementwise, and
// input 0 must have the outputs' shape. Never null (an empty output runs nothing).
class RangeKernel : public Kernel {
 public:
  // Elements [begin, begin + len) of every output, input 0 read from `input0` (its element 0 is
  // element `begin`), every other input from its own memory. REQUIRES: the range lies within the
  // outputs; no output overlaps `input0`.
  virtual absl::Status RunRange(int64_t begin, int64_t len, const float* input0) = 0;
};
absl::StatusOr<std::unique_ptr<RangeKernel>> CreateFusedElementwiseRange(
    const std::vector<FusedInstruction>& instrs, const std::vector<const Tensor*>& inputs,
    const std::vector<int>& output_instrs, const std::vector<Tensor*>& outputs,
    FusedLoop loop = FusedLoop::kCompiled);

}  // namespace meshrun

#endif  // MESHRUN_WORKER_KERNELS_KERNEL_H_
