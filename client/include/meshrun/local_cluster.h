// Starts a whole meshrun cluster on this machine: one coordinator and one worker per mesh device,
// each a real child process talking gRPC over loopback.
#ifndef MESHRUN_CLIENT_INCLUDE_MESHRUN_LOCAL_CLUSTER_H_
#define MESHRUN_CLIENT_INCLUDE_MESHRUN_LOCAL_CLUSTER_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace meshrun {

struct LocalClusterOptions {
  std::string mesh = "data=8";  // the coordinator's mesh; one worker per device
  int port = 0;                 // coordinator port; 0: any free port
  std::string
      bin_dir;  // where meshrun-coordinator and meshrun-worker are; empty: beside this program
  std::string log_dir;  // per-process logs; empty: a fresh directory under $TMPDIR
  int compute_threads =
      0;  // per worker; 0: max(1, cores / workers), so workers do not oversubscribe
  absl::Duration start_timeout = absl::Seconds(60);
  absl::Duration heartbeat_timeout = absl::Seconds(3);
  // The coordinator's --process_checks: a worker that exits or is stopped fails the run at once
  // (false: only when it misses heartbeats for heartbeat_timeout).
  bool process_checks = true;
  // The coordinator's --client_lease: a client silent this long loses its arrays.
  absl::Duration client_lease = absl::Seconds(60);
  // Workers exchange collective data through shared memory (they all run on this host); false:
  // through the gRPC ring transport, as workers on different hosts do.
  bool shm_transport = true;
  // Each worker's --memory_budget_bytes (0: the host's physical memory).
  int64_t worker_memory_budget_bytes = 0;
  // The coordinator's and each worker's --checkpoint_root: checkpoints are read and written
  // under it only.
  std::string checkpoint_root = "/";
  // More flags for every worker, after the ones above (e.g. "--kernel_shape_labels").
  std::vector<std::string> worker_flags;
  // Credentials (net/credentials.h): the directory the processes use; empty: one made with new
  // certificates the first time this process starts a cluster, under $TMPDIR, and shared by
  // every cluster it starts. Start() makes them this process's credentials, so its clients reach
  // the cluster, and sets MESHRUN_TLS_DIR (or, insecure, MESHRUN_INSECURE=1) in its environment
  // for the programs it starts. `insecure`: no TLS and no authentication (the processes run with
  // --insecure).
  std::string tls_dir;
  bool insecure = false;
  // As a process manager does (compose's `restart: on-failure`, systemd's Restart=on-failure): a
  // worker that dies (killed, or exits with an error) before Stop is started again with the same
  // flags, at most once per 500 ms per worker; it then joins in place of the lost one
  // (WorkerRegistry). Its output is appended to the same log.
  bool respawn_workers = false;
  // Hosts of their own, as on a network: when set, worker r runs in the network namespace
  // `worker_netns[r]` (a name under /run/netns, as `ip netns add` makes; one per worker) and
  // listens on `worker_hosts[r]`, an address of that namespace; the coordinator listens on
  // `coordinator_host`, which every namespace must reach (a bridge's address). Joining a
  // namespace needs CAP_SYS_ADMIN (root). Empty: every process on this host's loopback.
  std::vector<std::string> worker_netns;
  std::vector<std::string> worker_hosts;
  std::string coordinator_host = "127.0.0.1";
};

// Owns the child processes. Children get PR_SET_PDEATHSIG, so they die with this process even
// if it is killed; Stop() (also run by the destructor) shuts them down and reaps them, so no
// orphans or zombies remain. Not thread-safe, except worker_pids() and respawns(), which may be
// called while the respawn thread runs.
class LocalCluster {
 public:
  // Spawns the processes and waits until every worker has joined. Errors: NotFound for a missing
  // binary; InvalidArgument for a bad mesh; DeadlineExceeded (with the log directory) if the
  // cluster does not come up within start_timeout.
  static absl::StatusOr<std::unique_ptr<LocalCluster>> Start(const LocalClusterOptions& options);
  ~LocalCluster();

  const std::string& coordinator_address() const { return address_; }
  pid_t coordinator_pid() const { return coordinator_pid_; }
  // By spawn order (not rank); a respawned worker's new pid replaces the old one.
  std::vector<pid_t> worker_pids() const;
  // Workers respawned so far (respawn_workers).
  int respawns() const;
  const std::string& log_dir() const { return log_dir_; }
  // The credentials directory the processes use (empty when insecure).
  const std::string& tls_dir() const { return tls_dir_; }

  // Kills the coordinator (SIGKILL) and starts a new one on the same address, as a process
  // manager would; the workers rejoin it (worker/worker_runner.cc). Returns once it serves.
  // Errors: Unavailable when it does not start within 30 s.
  absl::Status RestartCoordinator();

  // Asks the coordinator to shut everything down, waits up to `grace`, then SIGTERM and SIGKILL.
  // Returns OK once every child has been reaped.
  absl::Status Stop(absl::Duration grace = absl::Seconds(5));

 private:
  LocalCluster() = default;
  // The respawn thread's loop: reaps dead workers and starts them again until Stop.
  void Supervise();
  // Start's steps. The coordinator's process, started with `credential_flag`; returns once it
  // wrote the port it bound (DeadlineExceeded after `deadline`, Unavailable if it exited).
  absl::Status StartCoordinator(const LocalClusterOptions& o, const std::string& credential_flag,
                                absl::Time deadline);
  // One worker process per device of a mesh of `workers`, joining address_.
  absl::Status StartWorkers(const LocalClusterOptions& o, int workers,
                            const std::string& credential_flag);
  // Worker r's network namespace; empty: this process's.
  std::string WorkerNetns(int r) const { return worker_netns_.empty() ? "" : worker_netns_[r]; }
  std::string address_;
  std::string log_dir_;
  std::string tls_dir_;
  pid_t coordinator_pid_ = -1;
  std::string coordinator_binary_;
  std::vector<std::string> coordinator_args_;  // with --port set to the bound port once known
  std::string worker_binary_;
  std::vector<std::vector<std::string>> worker_args_;
  std::vector<std::pair<std::string, std::string>> worker_env_;
  std::vector<std::string> worker_netns_;
  mutable absl::Mutex mu_;
  std::vector<pid_t> worker_pids_ ABSL_GUARDED_BY(mu_);
  int respawns_ ABSL_GUARDED_BY(mu_) = 0;
  bool supervising_ ABSL_GUARDED_BY(mu_) = false;
  std::thread supervisor_;
  bool stopped_ = false;
};

// The directory holding the running executable.
std::string ExecutableDir();

}  // namespace meshrun

#endif  // MESHRUN_CLIENT_INCLUDE_MESHRUN_LOCAL_CLUSTER_H_
