// The coordinator's half of sharded checkpoints (core/checkpoint/checkpoint.h has the format):
// it plans which blocks each worker writes or reads and commits the manifest; the workers write
// and read their own blocks (worker/checkpoint_shards.cc). Shared by the array registry (the
// SDK's TrainState) and the job driver (the main job's checkpoint policy).
#ifndef MESHRUN_SERVER_CHECKPOINT_OPS_H_
#define MESHRUN_SERVER_CHECKPOINT_OPS_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/checkpoint/checkpoint.h"
#include "core/sharding/mesh.h"
#include "core/sharding/partition_spec.h"
#include "core/tensor.h"
#include "meshrun/v1/coordinator.pb.h"
#include "meshrun/v1/worker.grpc.pb.h"

namespace meshrun {

// One call to one worker: its rank, its stub, a context that already carries a deadline.
using WorkerCall =
    std::function<grpc::Status(int rank, v1::Worker::Stub& stub, grpc::ClientContext* ctx)>;
// Runs a WorkerCall on every worker (ranks 0..mesh.size()-1) in parallel and returns the first
// failure, naming the worker's rank.
using ForEachWorker = std::function<absl::Status(const WorkerCall& call)>;

// An array of a checkpoint: `array_id` is the workers' shard-store id of its blocks, `name` its
// name in the checkpoint ("params/input_dense/kernel"); `shape` global (row-major), laid out as
// `spec` on the mesh (at save time: the layout it has; at restore: the layout wanted).
struct CheckpointArray {
  std::string name;
  std::string array_id;
  DType dtype = v1::DTYPE_F32;
  Dims shape;
  PartitionSpec spec;
};

// Saves `arrays` as the checkpoint <root>/step_<step>: every worker writes the blocks it owns
// (a replicated block once, by its lowest rank) into <root>/step_<step>.tmp-*, then the manifest
// is written last and fsynced and the directory committed by a rename; committed checkpoints
// beyond the newest `keep` (> 0) and uncommitted leftovers are removed. A failure (a full disk,
// a dead worker) removes the temporary directory and leaves the committed checkpoints as they
// were. Errors: InvalidArgument for an empty root or a name given twice; the failing worker's
// error (naming its rank and file); Internal for a rename or mkdir that fails.
absl::StatusOr<v1::SaveCheckpointResponse> WriteCheckpoint(
    const std::string& root, int64_t step, int keep, const Mesh& mesh,
    const std::vector<CheckpointArray>& arrays, const ForEachWorker& for_each);

// Restores `targets` (each by name, into its own spec on `mesh`) from the checkpoint `m` read from
// directory `path`: per rank, the LoadShards request that reads only the saved blocks its target
// blocks intersect. Errors (before anything is read): NotFound naming an array the checkpoint
// lacks; InvalidArgument naming an array whose saved shape or dtype differs from the target's or
// whose target layout cannot hold it.
absl::StatusOr<std::vector<v1::LoadShardsRequest>> PlanLoad(
    const checkpoint::Manifest& m, const std::string& path, const Mesh& mesh,
    const std::vector<CheckpointArray>& targets);

// The registry's record of `target` restored on `mesh`: its id, dtype, shape and sharding, and
// the bytes of each worker's block (0 when the layout cannot hold the shape).
v1::ArrayInfo RestoredArrayInfo(const Mesh& mesh, const CheckpointArray& target);

// Deletes the arrays' blocks (array_id) from every worker's store; best effort, errors ignored
// (a worker that lacks one has nothing to drop).
void DeleteOnWorkers(const std::vector<CheckpointArray>& arrays, const ForEachWorker& for_each);

// Runs the per-rank requests of PlanLoad; the bytes all workers read. On failure the ids are
// deleted again on every worker, so nothing half-restored stays.
absl::StatusOr<int64_t> LoadBlocks(const std::vector<v1::LoadShardsRequest>& loads,
                                   const std::vector<CheckpointArray>& targets,
                                   const ForEachWorker& for_each);

}  // namespace meshrun

#endif  // MESHRUN_SERVER_CHECKPOINT_OPS_H_
