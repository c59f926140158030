// Rewrites of a per-shard program that make it cheaper without changing what it computes, as
// XLA's fusion passes do after partitioning.
#ifndef MESHRUN_CORE_SPMD_FUSION_H_
#define MESHRUN_CORE_SPMD_FUSION_H_

#include "meshrun/v1/program.pb.h"

namespace meshrun {

// Algebraic simplification, as XLA's CSE, AlgebraicSimplifier and DCE passes (in this order):
//  - a slice (static or dynamic) of a broadcast that only shortens dims the broadcast's source
//    has as 1 is that broadcast at the slice's shape (a replicated constant, sliced to a
//    sharded operand's block, is no longer made at its global shape first);
//  - an op that repeats an earlier one (same kind, attributes and inputs, outputs of the same
//    dtypes and shapes, every input written once) is deleted and its readers read the first's
//    results (a traced step computes a max, an iota or a convert once per use);
//  - a binary op reads a broadcast's source instead of the broadcast (OP_BINARY broadcasts its
//    second operand; a commutative fn has its operands swapped for it);
//  - `add(matmul(a, b), bias)`, bias [N] or [1, N] over an [M, N] product read by nothing else,
//    is one OP_MATMUL with a bias (oneDNN's epilogue), as a Dense layer is;
//  - a bf16 matmul whose result only a convert to f32 reads writes that f32 result itself (the
//    GEMM's f32 accumulator, one rounding to bf16 fewer: XLA's dot with preferred_element_type
//    f32), so that its bias and gradient accumulation fuse as in f32; a convert the partitioner
//    inserted to compute a bf16 op in f32 (Op.widened) only where the rounding cannot show, a
//    relu reading it (XLA rounds the product before a bias add, a tanh or a GELU reads it);
//  - relu's gradient reads relu's output rather than its input where both exist (oneDNN's
//    use_dst_for_bwd: the same bits but at a NaN pre-activation, which oneDNN's relu maps to 0
//    and whose gradient is then 0 rather than dy), and then an activation (relu, silu, sqrt,
//    ...; not tanh, exp or logistic, whose unaries are XLA's) that alone reads an f32 matmul's
//    result is that matmul's post-op, as XLA fuses a dot's output fusion: the pre-activation is
//    never written when nothing else needs it;
//  - a convert of f32 to bf16 that only a convert back to f32 reads, the pair a widened bf16
//    op's rounding, is one OP_UNARY round_bf16 (core/float_ops.h's RoundToBf16: the same bits in
//    one pass, and an f32 op FuseElementwise can take into a loop);
//  - pure ops none of whose results is read or returned are deleted, and so are declarations of
//    buffers nothing names any more.
// Collectives, OP_ADAM_UPDATE, OP_RANDOM_INIT and accumulating matmuls are never moved or
// deleted, so every rank still runs the same collectives in the same order. Results are bitwise
// those of the program as given (the same operations on the same values), but for the convert
// folded into a bf16 matmul, which skips a rounding.
void SimplifyProgram(v1::ShardMapProgram* program);

// Gradient accumulation into a GEMM: `c = a + matmul(x, w)` (OP_BINARY add, either operand
// order) becomes `a = matmul(x, w) + a` (OP_MATMUL with accumulate, GEMM's beta = 1) and every
// later use of c reads a, when the matmul's result and `a` are read by nothing else, `a` is
// written whole by an earlier op of its own (not a view, not an argument or a result) and
// afterwards only by matmuls that accumulate into it, and the matmul has no bias. A sum over k
// minibatches, ((g1 + g2) + g3) + ..., becomes one accumulator and k GEMMs. A minibatch's weight
// gradient is then added into the sum in the GEMM's epilogue instead of in a separate pass over the
// whole gradient. The same values: oneDNN's sum post-op adds `a` to the finished product, as the
// separate add did.
void FuseGradientAccumulation(v1::ShardMapProgram* program);

// Deletes the declarations of buffers that no op of the (one-function) program, argument or
// result names any more (after a rewrite dropped the ops that wrote them).
void EraseUnnamedBuffers(v1::ShardMapProgram* program);

// Loop fusion of element-wise ops, as XLA's: within each run of consecutive element-wise f32
// ops (OP_BINARY and OP_UNARY with an IEEE-exact fn, and OP_SELECT, see OP_FUSED_ELEMENTWISE;
// OP_FILL_VALUEs in the run move to its front; any element-wise op, convert or reshape on
// one-element values joins the run and runs with its one-element results), the ops with one output
// shape become one OP_FUSED_ELEMENTWISE when there are at least two of them: one pass over the
// elements instead of one per op, and results read only inside the group are never written to
// memory (an optimizer's update chain, a relu's select). Ops whose results have one element run
// first, as they are; no other op of a run depends on an op of another shape, so the groups keep
// every dependency. Only buffers written once are fused. Bitwise the same results for finite and
// infinite values (NaN payloads, and comparisons with NaN, may differ from oneDNN's).
void FuseElementwise(v1::ShardMapProgram* program);

// An all-reduce fused with the element-wise update that consumes it, as XLA's weight-update
// sharding (and the C++ SDK's OP_ADAM_UPDATE) does: an f32 OP_PSUM / OP_PMEAN of one operand x
// over axes A whose result is read only by one later OP_FUSED_ELEMENTWISE of its shape, every
// other input of which is the same on every device of A (by shard_map's replication inference:
// in_specs, collectives, axis_index, per-device draws), is deleted, and the update reads x as its
// input 0 with axis_names A and fn "sum" / "mean" (program.proto). x must not be written between
// the two, be an argument or result, or share memory with another buffer (a view or a
// concatenation's part). A worker then reduces one segment of x per device, updates it and stores
// it into every device's results, instead of every device updating all of it. The same results:
// the worker reduces each element as the all-reduce did. Every device rewrites alike, so the
// collectives keep one order.
void FuseReductionsIntoUpdates(v1::ShardMapProgram* program);

}  // namespace meshrun

#endif  // MESHRUN_CORE_SPMD_FUSION_H_
