// ppermute and all_to_all: point-to-point exchanges inside a group, sent straight to the target
// (no ring). Large blocks go out in chunks of at most chunk_bytes.
//
// ppermute(perm): for each (src, dst) pair of group positions, src's block goes to dst; a
// position that is no pair's destination gets zeros (jax.lax.ppermute). Self pairs copy locally.
// all_to_all: the input is P blocks; block j goes to position j, and block i of the output came
// from position i (jax.lax.all_to_all over flat blocks; communicator.h adds split/concat dims).
// Each rank sends every block before receiving any, which the transports' buffered sends allow.
#ifndef MESHRUN_CORE_COLLECTIVES_PERMUTE_H_
#define MESHRUN_CORE_COLLECTIVES_PERMUTE_H_

#include <utility>
#include <vector>

#include "core/collectives/communicator.h"

namespace meshrun {

// OK if every source and every destination is a position in [0, size) and appears at most once.
// Errors: InvalidArgument naming the offending pair, e.g. "perm [(0, 1), (0, 2)] is not a
// permutation: source 0 appears twice".
absl::Status ValidatePermutation(const std::vector<std::pair<int, int>>& perm, int size);

// `in` and `out`: count elements each; must not overlap.
absl::Status Permute(Communicator& comm, const void* in, int64_t count, DType dtype,
                     const std::vector<std::pair<int, int>>& perm, void* out);

// `in` and `out`: size() * count elements each; must not overlap.
absl::Status AllToAll(Communicator& comm, const void* in, int64_t count, DType dtype, void* out);

}  // namespace meshrun

#endif  // MESHRUN_CORE_COLLECTIVES_PERMUTE_H_
