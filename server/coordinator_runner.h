// A coordinator process's lifecycle: serve Coordinator + health until Shutdown or a signal.
#ifndef MESHRUN_SERVER_COORDINATOR_RUNNER_H_
#define MESHRUN_SERVER_COORDINATOR_RUNNER_H_

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace meshrun {

struct CoordinatorOptions {
  std::string mesh = "data=8";  // "data=2,model=4"
  std::string host = "127.0.0.1";
  int port = 50051;        // 0: any free port
  std::string port_file;   // if set, the bound port is written here once serving
  std::string cluster_id;  // empty: random
  absl::Duration heartbeat_timeout = absl::Seconds(3);
  // WorkerRegistry::set_process_checks: workers this coordinator sees exit or stop fail runs at
  // once.
  bool process_checks = true;
  // A client session silent this long is expired and its arrays freed (server/client_leases.h).
  absl::Duration client_lease = absl::Seconds(60);
  // The job's state across restarts (JobDriver::Options::state_file); empty: not kept.
  std::string state_file;
  int metrics_port = 0;  // Prometheus /metrics; 0: any free port; -1: off
  // Checkpoints are saved and restored under this directory only (ArrayRegistry's).
  std::string checkpoint_root = "/";
  // ArrayRegistry::set_put_gather_min_bytes (-1: every holder is sent its whole block).
  int64_t put_gather_min_bytes = int64_t{1} << 20;
};

// Errors: InvalidArgument for a bad mesh; Unavailable if the port cannot be bound.
absl::Status RunCoordinator(const CoordinatorOptions& options);

}  // namespace meshrun

#endif  // MESHRUN_SERVER_COORDINATOR_RUNNER_H_
