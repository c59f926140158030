// The `meshrun` subcommands; each returns a process exit code and prints errors to stderr.
#ifndef MESHRUN_CLIENT_CLI_COMMANDS_H_
#define MESHRUN_CLIENT_CLI_COMMANDS_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "core/config/job_config.h"
#include "core/sharding/mesh.h"
#include "meshrun/job.h"
#include "meshrun/nn.h"
#include "meshrun/v1/program.pb.h"

namespace meshrun::cli {

// The mesh a job runs on, as Mesh::Parse reads it: `given` when non-empty, else the config's,
// else `fallback`.
std::string JobMeshText(const JobConfig& config, const std::string& given,
                        const std::string& fallback);

// A job config planned without a cluster, on its mesh (`mesh_text` when non-empty, else the
// config's, else data=8). Errors: the mesh's, PlanJob's.
absl::StatusOr<PlannedJob> PlanConfigJob(const JobConfig& config, const std::string& mesh_text);

struct UpArgs {
  std::string mesh = "data=8";
  int port = 50051;
  std::string log_dir;
  bool no_shm = false;      // collectives over gRPC only
  bool no_respawn = false;  // a worker that dies stays dead (default: started again)
  // The cluster's credentials (net/credentials.h); empty: ~/.meshrun/tls, made there if absent,
  // where the CLI's other commands find them.
  std::string tls_dir;
  bool insecure = false;
  // Also stop when standard input ends (EOF or hang-up): the starting program's lifeline.
  bool stop_on_stdin_eof = false;
};
// Starts a local cluster and keeps it up until SIGINT / SIGTERM (or, with stop_on_stdin_eof,
// the end of standard input), then stops it cleanly.
int Up(const UpArgs& args);
// `meshrun certs init DIR`: a new CA, node certificate and token (net/credentials.h).
int CertsInit(const std::string& dir);

struct TrainArgs {
  std::string config_path;
  std::string coordinator;  // empty: an embedded local cluster for the run
  std::string mesh;         // for the embedded cluster; empty: the config's mesh, else data=8
  std::string log_dir;
  std::string ckpt_dir;  // non-empty: replaces the config's checkpoint.dir
  bool resume = false;   // sets the config's checkpoint.resume
};
// Submits a train job, prints a progress line per log interval and the test accuracy. Relative
// checkpoint.dir / init_from paths are made absolute (the coordinator and workers may run
// elsewhere; they need the same filesystem view).
int Train(const TrainArgs& args);

// Prints the mesh, every worker (rank, address, pid, heartbeat age) and the job state.
int Status(const std::string& coordinator);
// Lists the cluster's sharded arrays: id, dtype, shape, PartitionSpec, bytes per worker.
// Lists the arrays (with their owning client session), or deletes `to_delete` ("all": every
// array) instead.
int Arrays(const std::string& coordinator, const std::vector<std::string>& to_delete = {});
// Prints an array's sharding grid (visualize_array_sharding).
int Show(const std::string& coordinator, const std::string& id);
// grpc.health.v1 Check against `address`: prints the serving status; exit 0 only on SERVING.
int Health(const std::string& address, const std::string& service, double timeout_seconds);
struct PlanArgs {
  std::string config_path;       // a job config (JSON); else a workload:
  std::string workload = "mlp";  // meshrun/workloads.h
  std::string mesh = "data=2,model=4";
  std::string layout;     // a named layout (dp, fsdp, tp, 2d, fsdp_tp, single), or:
  std::string rules;      // logical axis rules, e.g. batch=data,hidden=model
  std::string fsdp_axis;  // with rules: shard parameters over this axis
  int64_t min_weight_size = int64_t{1} << 18;
};
// Abstract evaluation (jax.eval_shape + nn.get_partition_spec): nothing is allocated and no
// cluster is needed. With config_path, plans that job (its mesh, or `mesh` when given). Prints
// every parameter's and optimizer-state array's PartitionSpec and bytes per worker, the batch
// layout, and the collectives of one step with their bytes. Exit 2 with the error (naming the
// parameter and dim) when the job cannot be planned.
int Plan(const PlanArgs& args);

struct WorkloadTrainArgs {
  std::string workload;       // meshrun/workloads.h
  std::string layout = "dp";  // a named layout, or (empty) the rules below
  std::string rules;          // logical axis rules, e.g. batch=data,hidden=model
  std::string fsdp_axis;
  int64_t min_weight_size = int64_t{1} << 18;
  // The embedded cluster's mesh; with `coordinator`, empty means the running cluster's mesh
  // (a given one must equal it).
  std::string mesh = "data=2,model=4";
  int64_t steps = 20;
  int steps_per_call = 1;   // steps per worker call (steps_per_execution): the job's log_every
  std::string coordinator;  // empty: an embedded local cluster
  std::string log_dir;
  std::string ckpt_dir;  // non-empty: save there every `save_every` steps and at the end
  int save_every = 0;
  int keep = 0;  // > 0: keep the newest `keep` checkpoints
  bool async_save = false;
  bool resume = false;            // continue from the newest committed checkpoint in ckpt_dir
  std::string init_from;          // a safetensors file of parameters
  std::string precision = "f32";  // the layers' compute dtype: f32 or bf16 (mixed precision)
};
// Trains a seed workload with a derived train step as a job (the coordinator's JobDriver, on
// the workload's own batch), printing each step's loss (%.9g).
int TrainWorkload(const WorkloadTrainArgs& args);
// Checks a checkpoint against a workload's TrainState under a layout and mesh, allocating
// nothing: missing / extra arrays, shape or dtype mismatches, layouts that cannot be produced,
// and the bytes each worker would read. Exit 0 when restorable.
int CkptValidate(const std::string& path, const WorkloadTrainArgs& workload);
// The same against a job config's TrainState (step, rng, params, opt_state, laid out by its
// sharding) on its mesh (or `mesh` when non-empty).
int CkptValidateJob(const std::string& path, const std::string& config_path,
                    const std::string& mesh);
// Checks a checkpoint by itself (any arrays, e.g. the Python SDK's save_checkpoint): every block's
// size and CRC-32, and, with a `mesh` ("data=4"), that each array can be restored on it in its
// saved layout and the bytes each worker would read. Exit 0 when sound.
int CkptValidateAlone(const std::string& path, const std::string& mesh);
// Writes a checkpoint's parameters, unsharded, to one safetensors file under their names
// (params/dot1/kernel).
int Export(const std::string& path, const std::string& out);

// Stops the workers and the coordinator.
int Shutdown(const std::string& coordinator);

}  // namespace meshrun::cli

#endif  // MESHRUN_CLIENT_CLI_COMMANDS_H_
