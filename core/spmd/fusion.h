// Rewrites of a per-shard program that make it cheaper without changing what it computes, as
// XLA's fusion passes do after partitioning.
#ifndef MESHRUN_CORE_SPMD_FUSION_H_
#define MESHRUN_CORE_SPMD_FUSION_H_

#include "meshrun/v1/program.pb.h"

namespace meshrun {

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

}  // namespace meshrun

#endif  // MESHRUN_CORE_SPMD_FUSION_H_
