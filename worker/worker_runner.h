// A worker process's lifecycle: serve, register with the coordinator, heartbeat, shut down.
#ifndef MESHRUN_WORKER_WORKER_RUNNER_H_
#define MESHRUN_WORKER_WORKER_RUNNER_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "core/collectives/communicator.h"
#include "worker/grpc_transport.h"

namespace meshrun {

struct WorkerRunnerOptions {
  std::string coordinator;         // host:port
  std::string host = "127.0.0.1";  // address to bind
  int port = 0;                    // 0: any free port
  std::string advertise_host;      // address peers use; empty: `host`
  int requested_rank = -1;
  int compute_threads = 0;
  absl::Duration join_timeout = absl::Seconds(60);  // reach the coordinator and wait for peers
  absl::Duration heartbeat_interval = absl::Milliseconds(500);
  absl::Duration orphan_timeout = absl::Seconds(10);  // exit if the coordinator is gone this long
  int metrics_port = 0;  // Prometheus /metrics; 0: any free port; -1: off
  // Collectives with peers on this host go through shared memory (worker/shm_transport.h);
  // false: every peer over gRPC.
  bool shm_transport = true;
  // Bytes its shards and a program's buffers may take (WorkerService); 0: physical memory.
  int64_t memory_budget_bytes = 0;
  // SaveShards / LoadShards touch files under this directory only.
  std::string checkpoint_root = "/";
  // The most bytes of one message; ring steps are pipelined in chunks of this size
  // (CollectiveOptions::chunk_bytes).
  int64_t ring_chunk_bytes = static_cast<int64_t>(CollectiveOptions().chunk_bytes);
  // All-reduces up to this many bytes run as recursive doubling, larger ones as the ring
  // (CollectiveOptions::small_message_bytes).
  int64_t recursive_doubling_max_bytes = CollectiveOptions().small_message_bytes;
  int64_t one_shot_max_bytes = CollectiveOptions().one_shot_max_bytes;
  absl::Duration receive_spin = CollectiveOptions().receive_spin;
  // Striping over several gRPC streams per peer (GrpcStripeOptions).
  int grpc_stripes = GrpcStripeOptions().max_stripes;
  int64_t grpc_stripe_bytes = static_cast<int64_t>(GrpcStripeOptions().stripe_bytes);
  // Label each matmul's kernel histogram by its shape too (WorkerMetrics' shape_labels).
  bool kernel_shape_labels = false;
};

// Runs until the coordinator asks the worker to stop (returns OK), the process gets SIGINT or
// SIGTERM (OK), or the coordinator cannot be reached: Unavailable / DeadlineExceeded naming the
// coordinator address, the number of attempts and the time spent. When the cluster re-forms
// after a lost worker (HeartbeatResponse.restart), the process starts afresh: it re-executes
// itself with the same arguments and asks for its rank again (kRejoinRankEnv), as torchrun's
// agent restarts the surviving workers; Internal if that exec fails.
absl::Status RunWorker(const WorkerRunnerOptions& options);

// The environment variable a re-executed worker finds its old rank in (when --rank is not set).
inline constexpr char kRejoinRankEnv[] = "MESHRUN_REJOIN_RANK";

// The rank this process got, for log prefixes (-1 before registration).
int CurrentWorkerRank();

}  // namespace meshrun

#endif  // MESHRUN_WORKER_WORKER_RUNNER_H_
