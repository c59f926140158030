// meshrun-worker: one per device. Flags, logging, then RunWorker().
#include <malloc.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/synchronization/mutex.h"
#include "core/config/flag_checks.h"
#include "core/port/denormal.h"
#include "glog/logging.h"
#include "net/credentials.h"
#include "net/grpc_util.h"
#include "worker/ring_frame.h"
#include "worker/worker_runner.h"

ABSL_FLAG(std::string, coordinator, "127.0.0.1:50051", "coordinator address host:port");
ABSL_FLAG(std::string, host, "127.0.0.1", "address to bind");
ABSL_FLAG(int, port, 0, "port to bind (0: any free port)");
ABSL_FLAG(std::string, advertise_host, "", "address peers reach this worker at (default: --host)");
ABSL_FLAG(int, rank, -1, "rank to ask for (-1: any)");
ABSL_FLAG(int, compute_threads, 0, "oneDNN compute threads (0: library default)");
ABSL_FLAG(int, metrics_port, 0, "Prometheus /metrics port (0: any free port, -1: off)");
ABSL_FLAG(absl::Duration, join_timeout, absl::Seconds(60), "how long to try to join the cluster");
ABSL_FLAG(bool, shm_transport, true,
          "collectives with workers on this host go through shared memory (false: gRPC)");
ABSL_FLAG(
    int64_t, memory_budget_bytes, 0,
    "bytes this worker's shards and program buffers may take (0: the host's physical memory)");
ABSL_FLAG(int64_t, ring_chunk_bytes, static_cast<int64_t>(meshrun::CollectiveOptions().chunk_bytes),
          "the most bytes of one message: a ring step sends its segment in chunks of this size, "
          "pipelined (README, Collectives)");
ABSL_FLAG(int64_t, recursive_doubling_max_bytes, 256 << 10,
          "all-reduces up to this many bytes (and one --ring_chunk_bytes message) run as "
          "recursive doubling, larger ones as the ring; 0: always the ring (thresholds: README, "
          "Collectives)");
ABSL_FLAG(int64_t, one_shot_max_bytes, 0,
          "all-reduces up to this many bytes are one-shot (one latency, P-1 sends; pays where "
          "latency dwarfs a send's cost); 0: never, as measured on 2 cores (README, Collectives)");
ABSL_FLAG(int, grpc_stripes, meshrun::GrpcStripeOptions().max_stripes,
          "the most gRPC streams (TCP connections) one message to a peer is striped over, 1..16 "
          "(1: never striped; README, Collectives)");
ABSL_FLAG(int64_t, grpc_stripe_bytes,
          static_cast<int64_t>(meshrun::GrpcStripeOptions().stripe_bytes),
          "a message over gRPC goes over one stream per this many bytes, up to --grpc_stripes");
ABSL_FLAG(absl::Duration, shm_receive_spin, absl::Microseconds(50),
          "a receive over shared memory polls this long before it sleeps (0: sleep at once; "
          "README, Collectives)");
ABSL_FLAG(std::string, tls_dir, "",
          "the cluster's credentials (meshrun certs init DIR); default: $MESHRUN_TLS_DIR");
ABSL_FLAG(bool, kernel_shape_labels, false,
          "label each matmul's meshrun_kernel_duration_seconds by its shape too (one series per "
          "GEMM signature; what meshrun bench kernels reads)");
ABSL_FLAG(bool, insecure, false,
          "no TLS and no authentication: any process that reaches the port controls this worker");
ABSL_FLAG(std::string, checkpoint_root, "/",
          "checkpoints are read and written under this directory only (compose: /var/lib/meshrun)");
ABSL_FLAG(absl::Duration, orphan_timeout, absl::Seconds(10),
          "exit when the coordinator is gone this long");

namespace {
void RankPrefix(std::ostream& s, const google::LogMessageInfo& l, void*) {
  char clock[32];
  std::snprintf(clock, sizeof(clock), "%d:%02d:%02d.%03ld", l.time.hour(), l.time.min(),
                l.time.sec(), static_cast<long>(l.time.usec() / 1000));
  s << l.severity[0] << ' ' << clock << " worker rank " << meshrun::CurrentWorkerRank() << " "
    << l.filename << ':' << l.line_number << "]";
}
}  // namespace

// Step buffers and shards are megabytes each and are freed and allocated again every step. By
// default glibc hands such blocks back to the kernel (mmap/munmap, heap trimming) and the next
// step faults them in again, zero-filled: a third of a worker's time on the seeds' MLP. Keep
// freed memory in one arena for reuse instead (peak RSS is unchanged: it is the peak).
void KeepFreedMemory() {
  mallopt(M_ARENA_MAX, 1);
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's maximum; larger blocks are still mmap'ed
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

// Debian's Abseil checks every Mutex acquisition for lock-order cycles (a debugging aid that
// builds a graph of all locks: 1-2% of a worker's time in a train step). Off, as in release builds.
void NoMutexCycleChecks() { absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore); }

// oneDNN's threads are libgomp's, which reads OMP_WAIT_POLICY once, as it loads, before main.
// Its default lets a team's idle threads spin between parallel regions, taking a core from the
// worker's own threads (gRPC, the input pipeline) and from the processes beside it: on a 2-core
// host the main job's one-worker step took 1.6-1.8 ms in about half the runs, against 0.92-0.95
// ms with PASSIVE. Unless the operator chose a policy, the worker starts itself again with
// PASSIVE (the same process: execv keeps the pid); if that fails it runs on with the default.
void SleepingOpenMpThreads(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
  execv("/proc/self/exe", argv);
}

int main(int argc, char** argv) {
  SleepingOpenMpThreads(argv);
  meshrun::FlushDenormalsToZero();  // first: every thread (gRPC, oneDNN's) inherits it
  KeepFreedMemory();
  NoMutexCycleChecks();
  // Before any object that uses gRPC (destroyed after them), after the settings its threads
  // inherit.
  meshrun::GrpcLifetime grpc_lifetime;
  absl::SetProgramUsageMessage(
      "meshrun worker: hosts array shards, runs step programs and collectives");
  absl::ParseCommandLine(argc, argv);
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0], &RankPrefix, nullptr);
  meshrun::WorkerRunnerOptions o;
  o.coordinator = absl::GetFlag(FLAGS_coordinator);
  o.host = absl::GetFlag(FLAGS_host);
  o.port = absl::GetFlag(FLAGS_port);
  o.advertise_host = absl::GetFlag(FLAGS_advertise_host);
  o.requested_rank = absl::GetFlag(FLAGS_rank);
  if (const char* rejoin = std::getenv(meshrun::kRejoinRankEnv); rejoin != nullptr) {
    if (o.requested_rank < 0) o.requested_rank = std::atoi(rejoin);  // restarted (below)
    unsetenv(meshrun::kRejoinRankEnv);
  }
  o.compute_threads = absl::GetFlag(FLAGS_compute_threads);
  o.join_timeout = absl::GetFlag(FLAGS_join_timeout);
  o.orphan_timeout = absl::GetFlag(FLAGS_orphan_timeout);
  o.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  o.shm_transport = absl::GetFlag(FLAGS_shm_transport);
  o.memory_budget_bytes = absl::GetFlag(FLAGS_memory_budget_bytes);
  o.checkpoint_root = absl::GetFlag(FLAGS_checkpoint_root);
  o.ring_chunk_bytes = absl::GetFlag(FLAGS_ring_chunk_bytes);
  o.recursive_doubling_max_bytes = absl::GetFlag(FLAGS_recursive_doubling_max_bytes);
  o.receive_spin = absl::GetFlag(FLAGS_shm_receive_spin);
  o.kernel_shape_labels = absl::GetFlag(FLAGS_kernel_shape_labels);
  o.one_shot_max_bytes = absl::GetFlag(FLAGS_one_shot_max_bytes);
  o.grpc_stripes = absl::GetFlag(FLAGS_grpc_stripes);
  o.grpc_stripe_bytes = absl::GetFlag(FLAGS_grpc_stripe_bytes);
  const absl::Status flags = meshrun::FirstFailed(
      {meshrun::CheckFlagRange("port", o.port, 0, 65535),
       meshrun::CheckFlagRange("rank", o.requested_rank, -1, 1 << 20),
       meshrun::CheckFlagRange("compute_threads", o.compute_threads, 0, 4096),
       meshrun::CheckFlagRange("metrics_port", o.metrics_port, -1, 65535),
       meshrun::CheckFlagRange("memory_budget_bytes", o.memory_budget_bytes, 0, int64_t{1} << 50),
       meshrun::CheckFlagRange("ring_chunk_bytes", o.ring_chunk_bytes, 8, int64_t{1} << 30),
       meshrun::CheckFlagRange("recursive_doubling_max_bytes", o.recursive_doubling_max_bytes, 0,
                               int64_t{1} << 40),
       meshrun::CheckFlagRange("one_shot_max_bytes", o.one_shot_max_bytes, 0, int64_t{1} << 40),
       meshrun::CheckFlagRange("grpc_stripes", o.grpc_stripes, 1, meshrun::kMaxLanes),
       meshrun::CheckFlagRange("grpc_stripe_bytes", o.grpc_stripe_bytes, 8, int64_t{1} << 40),
       meshrun::CheckFlagRange("shm_receive_spin", o.receive_spin, absl::ZeroDuration(),
                               absl::Seconds(1)),
       meshrun::CheckFlagPositive("join_timeout", o.join_timeout),
       meshrun::CheckFlagPositive("orphan_timeout", o.orphan_timeout)});
  absl::StatusOr<meshrun::Credentials> creds =
      flags.ok()
          ? meshrun::NodeCredentials(absl::GetFlag(FLAGS_tls_dir), absl::GetFlag(FLAGS_insecure))
          : absl::StatusOr<meshrun::Credentials>(flags);
  if (!creds.ok()) {
    std::fprintf(stderr, "meshrun-worker: %s\n", std::string(creds.status().message()).c_str());
    return 2;
  }
  if (creds->insecure) LOG(WARNING) << "--insecure: no TLS, no authentication";
  meshrun::SetProcessCredentials(*std::move(creds));
  absl::Status s = meshrun::RunWorker(o);
  if (!s.ok()) {
    LOG(ERROR) << s;
    std::fprintf(stderr, "meshrun-worker: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}
