// The `meshrun` subcommands; each returns a process exit code and prints errors to stderr.
#ifndef MESHRUN_CLIENT_CLI_COMMANDS_H_
#define MESHRUN_CLIENT_CLI_COMMANDS_H_

#include <cstdint>
#include <string>

namespace meshrun::cli {

struct UpArgs {
  std::string mesh = "data=8";
  int port = 50051;
  std::string log_dir;
};
// Starts a local cluster and keeps it up until SIGINT / SIGTERM, then stops it cleanly.
int Up(const UpArgs& args);

struct TrainArgs {
  std::string config_path;
  std::string coordinator;  // empty: an embedded local cluster for the run
  std::string mesh;         // for the embedded cluster; empty: the config's mesh, else data=8
  std::string log_dir;
};
// Submits a train job, prints a progress line per log interval and the test accuracy.
int Train(const TrainArgs& args);

// Prints the mesh, every worker (rank, address, pid, heartbeat age) and the job state.
int Status(const std::string& coordinator);
// Lists the cluster's sharded arrays: id, dtype, shape, PartitionSpec, bytes per worker.
int Arrays(const std::string& coordinator);
// Prints an array's sharding grid (visualize_array_sharding).
int Show(const std::string& coordinator, const std::string& id);
// grpc.health.v1 Check against `address`: prints the serving status; exit 0 only on SERVING.
int Health(const std::string& address, const std::string& service, double timeout_seconds);
struct PlanArgs {
  std::string workload = "mlp";  // meshrun/workloads.h
  std::string mesh = "data=2,model=4";
  std::string layout;            // a named layout (dp, fsdp, tp, 2d, fsdp_tp, single), or:
  std::string rules;             // logical axis rules, e.g. batch=data,hidden=model
  std::string fsdp_axis;         // with rules: shard parameters over this axis
  int64_t min_weight_size = int64_t{1} << 18;
};
// Abstract evaluation (jax.eval_shape + nn.get_partition_spec): nothing is allocated and no
// cluster is needed. Prints every parameter's and optimizer-state array's PartitionSpec and bytes
// per worker, the batch layout, and the collectives of one step with their bytes. Exit 2 with
// the error (naming the parameter and dim) when the job cannot be planned.
int Plan(const PlanArgs& args);

// Stops the workers and the coordinator.
int Shutdown(const std::string& coordinator);

}  // namespace meshrun::cli

#endif  // MESHRUN_CLIENT_CLI_COMMANDS_H_
