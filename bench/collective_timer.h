// Helpers for the whole-cluster benchmarks. TimeCollective times a collective on a cluster's
// workers (each runs it; a call takes as long as its slowest rank) and reports nccl-tests' algbw
// and busbw.
#ifndef MESHRUN_BENCH_COLLECTIVE_TIMER_H_
#define MESHRUN_BENCH_COLLECTIVE_TIMER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "meshrun/local_cluster.h"
#include "meshrun/v1/worker.grpc.pb.h"

namespace meshrun {

class NetnsHosts;  // bench/netns_hosts.h

struct CollectiveTiming {
  double p50_seconds = 0;
  int group_size = 0;
  double algbw_gbps = 0;  // bytes / time
  double busbw_gbps =
      0;  // algbw x 2(n-1)/n for psum, (n-1)/n for all_gather / psum_scatter, 1 for ppermute
};

// A local cluster for a benchmark (compute_threads 0: LocalCluster's default; shm_transport and
// insecure as LocalClusterOptions: TLS on unless `insecure`; `hosts`, when set: worker r in
// namespace r, the coordinator on the bridge); prints the error and returns null if it does not
// start.
std::unique_ptr<LocalCluster> StartBenchCluster(const std::string& mesh, const std::string& bin_dir,
                                                int compute_threads, bool shm_transport = true,
                                                bool insecure = false,
                                                const NetnsHosts* hosts = nullptr,
                                                const std::vector<std::string>& worker_flags = {});

// The stubs of every worker of the cluster (by rank), from its coordinator.
absl::StatusOr<std::vector<std::unique_ptr<v1::Worker::Stub>>> WorkerStubs(
    const std::string& coordinator);

// `algorithm`: BenchmarkCollectiveRequest.algorithm ("": by size). Errors: the first worker's
// error, naming its rank.
absl::StatusOr<CollectiveTiming> TimeCollective(
    std::vector<std::unique_ptr<v1::Worker::Stub>>& stubs, const std::string& op,
    const std::vector<std::string>& axes, int64_t num_bytes, int iters,
    const std::string& algorithm = "");

// Runs untimed 4 KiB psums over every worker for at least `duration`, as OSU's and Intel MPI
// Benchmarks' warm-up iterations do: workers that were idle until now (started, then waiting on
// RPCs) were placed on cores by the kernel as they woke, often two on one core; busy for a while,
// they are spread out, and the first size measured sees the placement the later ones and a long
// training job see. Errors: TimeCollective's.
absl::Status SettleWorkers(std::vector<std::unique_ptr<v1::Worker::Stub>>& stubs,
                           absl::Duration duration = absl::Milliseconds(1000));

std::string HumanBytes(int64_t bytes);

}  // namespace meshrun

#endif  // MESHRUN_BENCH_COLLECTIVE_TIMER_H_
