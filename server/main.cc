// meshrun-coordinator: flags, logging, then RunCoordinator().
#include <cstdio>
#include <limits>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/synchronization/mutex.h"
#include "core/config/flag_checks.h"
#include "glog/logging.h"
#include "net/credentials.h"
#include "net/grpc_util.h"
#include "server/coordinator_runner.h"

ABSL_FLAG(std::string, mesh, "data=8", "mesh axes and sizes, e.g. data=2,model=4");
ABSL_FLAG(std::string, host, "127.0.0.1", "address to bind");
ABSL_FLAG(int, port, 50051, "port to bind (0: any free port)");
ABSL_FLAG(std::string, port_file, "", "write the bound port to this file once serving");
ABSL_FLAG(std::string, cluster_id, "", "cluster id (default: random)");
ABSL_FLAG(int, metrics_port, 0, "Prometheus /metrics port (0: any free port, -1: off)");
ABSL_FLAG(std::string, tls_dir, "",
          "the cluster's credentials (meshrun certs init DIR); default: $MESHRUN_TLS_DIR");
ABSL_FLAG(bool, insecure, false,
          "no TLS and no authentication: any process that reaches the port controls the cluster");
ABSL_FLAG(absl::Duration, heartbeat_timeout, absl::Seconds(3), "a worker silent this long is dead");
ABSL_FLAG(std::string, state_file, "",
          "keep the job's state here (JSON), so a restarted coordinator reports an interrupted "
          "job and its last checkpoint");
ABSL_FLAG(bool, process_checks, true,
          "a worker whose process this coordinator sees (same host and pid namespace) fails the "
          "run at once when it exits or is stopped (SIGSTOP); false: heartbeats only");
ABSL_FLAG(std::string, checkpoint_root, "/",
          "checkpoints are saved and restored under this directory only (compose: "
          "/var/lib/meshrun)");
ABSL_FLAG(int64_t, put_gather_min_bytes, int64_t{1} << 20,
          "a put whose block several workers hold sends each of them 1/k of it and has them "
          "all-gather it when the block has at least this many bytes (-1: never)");
ABSL_FLAG(absl::Duration, client_lease, absl::Seconds(60),
          "a client silent this long (it sends KeepAlive every third of it) loses its arrays");

int main(int argc, char** argv) {
  meshrun::GrpcLifetime grpc_lifetime;  // first: destroyed after everything that uses gRPC
  absl::SetProgramUsageMessage("meshrun coordinator: mesh topology, sharding plans, job driver");
  absl::ParseCommandLine(argc, argv);
  // Debian's Abseil checks every Mutex acquisition for lock-order cycles (a debugging aid); off,
  // as in release builds.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);
  meshrun::CoordinatorOptions o;
  o.mesh = absl::GetFlag(FLAGS_mesh);
  o.host = absl::GetFlag(FLAGS_host);
  o.port = absl::GetFlag(FLAGS_port);
  o.port_file = absl::GetFlag(FLAGS_port_file);
  o.cluster_id = absl::GetFlag(FLAGS_cluster_id);
  o.heartbeat_timeout = absl::GetFlag(FLAGS_heartbeat_timeout);
  o.client_lease = absl::GetFlag(FLAGS_client_lease);
  o.process_checks = absl::GetFlag(FLAGS_process_checks);
  o.state_file = absl::GetFlag(FLAGS_state_file);
  o.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  o.checkpoint_root = absl::GetFlag(FLAGS_checkpoint_root);
  o.put_gather_min_bytes = absl::GetFlag(FLAGS_put_gather_min_bytes);
  const absl::Status flags =
      meshrun::FirstFailed({meshrun::CheckFlagRange("port", o.port, 0, 65535),
                            meshrun::CheckFlagRange("metrics_port", o.metrics_port, -1, 65535),
                            meshrun::CheckFlagRange("put_gather_min_bytes", o.put_gather_min_bytes,
                                                    -1, std::numeric_limits<int64_t>::max()),
                            meshrun::CheckFlagPositive("heartbeat_timeout", o.heartbeat_timeout),
                            meshrun::CheckFlagPositive("client_lease", o.client_lease)});
  absl::StatusOr<meshrun::Credentials> creds =
      flags.ok()
          ? meshrun::NodeCredentials(absl::GetFlag(FLAGS_tls_dir), absl::GetFlag(FLAGS_insecure))
          : absl::StatusOr<meshrun::Credentials>(flags);
  if (!creds.ok()) {
    std::fprintf(stderr, "meshrun-coordinator: %s\n",
                 std::string(creds.status().message()).c_str());
    return 2;
  }
  if (creds->insecure)
    LOG(WARNING) << "--insecure: no TLS, no authentication; anyone who reaches this port can "
                    "run programs, read arrays and shut the cluster down";
  meshrun::SetProcessCredentials(*std::move(creds));
  absl::Status s = meshrun::RunCoordinator(o);
  if (!s.ok()) {
    std::fprintf(stderr, "meshrun-coordinator: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}
