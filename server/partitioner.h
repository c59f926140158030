// The coordinator's SPMD partitioner: turns a client's global program (jax.jit's traced program,
// no collectives) into the per-shard program the workers run, by replaying it through
// core/spmd/jit.h's JitBuilder on the cluster's mesh: sharding propagation per op
// (core/spmd/sharding_rules.h), collectives inserted where layouts disagree, the VJP of GRAD ops
// derived here. Partitioned programs are cached by the global program's bytes, as jax.jit caches
// compiled programs, so a train step is partitioned once, not every step.
#ifndef MESHRUN_SERVER_PARTITIONER_H_
#define MESHRUN_SERVER_PARTITIONER_H_

#include <functional>
#include <list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/sharding/mesh.h"
#include "meshrun/v1/program.pb.h"

namespace meshrun {

// Thread-safe.
class Partitioner {
 public:
  struct Partitioned {
    v1::ShardMapProgram program;  // per shard, with in_specs / out_specs
    std::string serialized;       // `program`'s bytes, as RunShardMapRequest carries them
    std::vector<std::string>
        collectives;  // inserted, in order: "psum(model)", "all_gather(data)@1"
  };
  // Partitions for the mesh `mesh` returns at each call (the cluster's, which recovery may shrink;
  // the cache is keyed by the mesh and the program).
  explicit Partitioner(std::function<Mesh()> mesh, size_t capacity = 8)
      : mesh_(std::move(mesh)), capacity_(capacity) {}
  explicit Partitioner(const Mesh& mesh, size_t capacity = 8)
      : Partitioner([mesh] { return mesh; }, capacity) {}

  // Errors: InvalidArgument naming the op (its index and kind) for a malformed program, or the
  // op and dim whose shape or layout does not partition on the mesh. `cache_hit` (optional) says
  // whether an earlier call partitioned the same program for the same mesh.
  absl::StatusOr<std::shared_ptr<const Partitioned>> Partition(const v1::GlobalProgram& program,
                                                               bool* cache_hit = nullptr);

 private:
  const std::function<Mesh()> mesh_;
  const size_t capacity_;
  absl::Mutex mu_;
  // Most recently used first.
  std::list<std::pair<std::string, std::shared_ptr<const Partitioned>>> cache_ ABSL_GUARDED_BY(mu_);
};

}  // namespace meshrun

#endif  // MESHRUN_SERVER_PARTITIONER_H_
