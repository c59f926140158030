// Sharding rules of the SPMD partitioner: for one op of a global program (no collectives in it)
// and the shardings of its operands, the layout its local computation runs on, the collectives
// that get the operands there, and the layout (and pending reduction) of its result. This is
// what XLA's GSPMD partitioner decides per instruction for jax.jit; the rules here are its basic
// ones, documented per function. They are pure functions of shapes and specs: the coordinator
// runs them while planning, nothing is allocated.
//
// Shapes are row-major global dims; specs are PartitionSpecs on `mesh`. Two ways to change an
// operand's layout, cheapest first:
//   - slice (free): a dim replicated over some mesh axes becomes sharded over them, each device
//     keeping its block (lax.dynamic_slice at its axis_index; no communication);
//   - all_gather (communication): a dim sharded over axes becomes replicated over them
//     (jax.lax.all_gather(x, axes, axis=dim, tiled=True)).
// Thread-safety: pure functions; safe to call concurrently.
#ifndef MESHRUN_CORE_SPMD_SHARDING_RULES_H_
#define MESHRUN_CORE_SPMD_SHARDING_RULES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/sharding/mesh.h"
#include "core/sharding/partition_spec.h"

namespace meshrun {
namespace spmd {

// One change of an operand's layout along one dim.
struct Reshard {
  enum Kind { kSlice, kAllGather };
  Kind kind;
  int operand;  // 0: lhs (or the only operand), 1: rhs
  int dim;      // the operand dim
  std::vector<std::string>
      axes;  // mesh axes the dim becomes sharded over (kSlice) or gathered over
  bool operator==(const Reshard& o) const {
    return kind == o.kind && operand == o.operand && dim == o.dim && axes == o.axes;
  }
};
std::string ReshardToString(const Reshard& r);

// jax.lax.dot_general's dimension numbers. Result dims: batch dims (in the order given), then
// lhs's remaining dims, then rhs's remaining dims, each in operand order.
struct DotDimensionNumbers {
  std::vector<int> lhs_contracting, rhs_contracting;
  std::vector<int> lhs_batch, rhs_batch;
};

struct OpPlan {
  std::vector<PartitionSpec> operands;  // layouts the local computation runs on
  std::vector<Reshard> reshards;        // from the given layouts to `operands`, in order
  PartitionSpec result;                 // layout of the local results
  // The local results are partial sums over these mesh axes: a psum over them completes the op
  // (or a psum_scatter, when the consumer wants the result sharded over them).
  std::vector<std::string> partial_sum_axes;
};

// dot_general. Rules, in this order:
//  1. Contracting dim pairs. Same sharding on both sides: contract locally, the result is a
//     partial sum over those axes. Sharded on one side only: slice the other side to match if its
//     axes are unused in that operand (free), else all_gather the sharded side. Sharded
//     differently: all_gather the rhs's dim, then as before.
//  2. Batch dim pairs: as contracting pairs, but the shared sharding passes to the result dim.
//  3. Remaining dims keep their sharding in the result; if a mesh axis would shard two result
//     dims (lhs ('data', None) @ rhs (None, 'data')), the rhs's dim is all_gathered.
// So y('data','model') @ W2('model', None) runs locally and leaves partial sums over 'model'
// (psum, or psum_scatter), and x('data', None) @ W('data', None) (FSDP) all_gathers W over 'data'.
// Errors: InvalidArgument for dims out of range, unequal contracting/batch sizes, or a spec that
// does not fit its shape.
absl::StatusOr<OpPlan> PlanDotGeneral(const std::vector<int64_t>& lhs_shape,
                                      const PartitionSpec& lhs,
                                      const std::vector<int64_t>& rhs_shape,
                                      const PartitionSpec& rhs, const DotDimensionNumbers& dnums,
                                      const Mesh& mesh);

// Element-wise ops on operands of equal shape (broadcast first): the result takes the lhs's
// layout; each rhs dim laid out differently is all_gathered if sharded, then sliced to the lhs's
// axes. Errors: InvalidArgument for unequal shapes or specs that do not fit.
absl::StatusOr<OpPlan> PlanElementwise(const std::vector<int64_t>& shape, const PartitionSpec& lhs,
                                       const PartitionSpec& rhs, const Mesh& mesh);

// Reduction (sum, mean, max) over `dims`: reduce locally; the result drops those dims, and is a
// partial result over the axes that sharded them (psum / pmean / pmax completes it).
absl::StatusOr<OpPlan> PlanReduce(const std::vector<int64_t>& shape, const PartitionSpec& operand,
                                  const std::vector<int>& dims, const Mesh& mesh);

// Completing partial sums. A result laid out as `spec` holding partial sums over `partial_axes`
// becomes the fully summed array laid out as `target` (a sharding constraint, or the sharding of
// the parameter a gradient belongs to) through:
//   - psum_scatter over target[d]'s axes along dim d (jax.lax.psum_scatter(x, axes,
//     scatter_dimension=d, tiled=True)) for each dim d the target shards only over partial axes
//     and `spec` leaves whole: the FSDP gradient's reduce-scatter;
//   - psum over the partial axes left: the data-parallel gradient all-reduce, or tensor
//     parallelism's all-reduce after the second matmul;
//   - then reshards (slice / all_gather) for what still differs from `target`.
struct Reduction {
  enum Kind { kPsum, kPsumScatter };
  Kind kind;
  std::vector<std::string> axes;
  int dim = -1;  // kPsumScatter: the scatter dimension
  bool operator==(const Reduction& o) const {
    return kind == o.kind && axes == o.axes && dim == o.dim;
  }
};
std::string ReductionToString(const Reduction& r);

struct PartialSumPlan {
  std::vector<Reduction> reductions;  // in order; each changes the layout as described above
  std::vector<Reshard> reshards;      // after the reductions (operand 0)
};

// Errors: InvalidArgument when `spec` or `target` does not fit `shape`, or a partial axis is not
// a mesh axis or also shards a dim of `spec`.
absl::StatusOr<PartialSumPlan> PlanPartialSum(const std::vector<int64_t>& shape,
                                              const PartitionSpec& spec,
                                              const std::vector<std::string>& partial_axes,
                                              const PartitionSpec& target, const Mesh& mesh);

// Bytes each device sends (and receives) for `r` with a ring algorithm on an array of `shape`
// laid out as `spec` before it: psum 2 (n-1)/n, psum_scatter (n-1)/n of the local bytes, for n
// devices over r.axes (nccl-tests' bus-bandwidth accounting, shared/REFERENCE.md).
int64_t ReductionBytesPerDevice(const Reduction& r, const std::vector<int64_t>& shape,
                                const PartitionSpec& spec, const Mesh& mesh, int dtype_bytes);

// Bytes each device sends and receives to carry out `r` on an operand of `shape` (global) laid
// out as `spec` before the reshard, for `dtype_bytes`-byte elements: (n - 1) local blocks for an
// all_gather over n devices, 0 for a slice.
int64_t ReshardBytesPerDevice(const Reshard& r, const std::vector<int64_t>& shape,
                              const PartitionSpec& spec, const Mesh& mesh, int dtype_bytes);

}  // namespace spmd
}  // namespace meshrun

#endif  // MESHRUN_CORE_SPMD_SHARDING_RULES_H_
