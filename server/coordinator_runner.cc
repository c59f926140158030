#include "server/coordinator_runner.h"

#include <unistd.h>

#include <atomic>
#include <csignal>
#include <fstream>
#include <random>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "grpcpp/health_check_service_interface.h"
#include "net/credentials.h"
#include "net/grpc_util.h"
#include "net/metrics.h"
#include "server/coordinator_service.h"

namespace meshrun {
namespace {

std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop.store(true); }

}  // namespace

absl::Status RunCoordinator(const CoordinatorOptions& o) {
  absl::StatusOr<Mesh> mesh = Mesh::Parse(o.mesh);
  if (!mesh.ok()) return mesh.status();
  std::string cluster_id = o.cluster_id;
  if (cluster_id.empty()) cluster_id = absl::StrCat(std::random_device()() % 1000000000u);
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);

  std::unique_ptr<MetricsServer> metrics_server;
  std::unique_ptr<CoordinatorMetrics> metrics;
  std::string metrics_address;
  if (o.metrics_port >= 0) {
    absl::StatusOr<std::unique_ptr<MetricsServer>> m =
        MetricsServer::Start(o.host, o.metrics_port, "coordinator");
    if (!m.ok()) return m.status();
    metrics_server = *std::move(m);
    metrics = std::make_unique<CoordinatorMetrics>(metrics_server->registry(), *mesh);
    metrics_address = absl::StrCat(o.host, ":", metrics_server->port());
    LOG(INFO) << "metrics on http://" << metrics_address << "/metrics";
  }
  // An id the operator did not choose is adopted from workers rejoining after a restart.
  WorkerRegistry registry(*mesh, cluster_id, /*adopt_cluster_id=*/o.cluster_id.empty(),
                          o.heartbeat_timeout);
  registry.set_process_checks(o.process_checks);
  ArrayRegistry arrays(&registry, absl::Seconds(60), o.heartbeat_timeout, metrics.get(),
                       o.checkpoint_root);
  arrays.set_put_gather_min_bytes(o.put_gather_min_bytes);
  JobDriver::Options jo;
  jo.metrics = metrics.get();
  jo.state_file = o.state_file;
  JobDriver driver(&registry, &arrays, jo);
  ClientLeases leases(o.client_lease);
  CoordinatorService service(&registry, &driver, &arrays, &leases, o.heartbeat_timeout,
                             metrics.get(), metrics_address);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  ConfigureServerBuilder(builder);
  if (metrics_server != nullptr) metrics_server->InstallGrpcMetrics(builder);
  int port = 0;
  builder.AddListeningPort(
      absl::StrCat(o.host, ":", o.port),
      NodeServerCredentials(ProcessCredentials(), /*require_node_certificate=*/false), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0)
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on ", o.host, ":", o.port,
        ": the port is held by another process (another cluster's coordinator? port 0 picks a "
        "free one) or the address is not local"));
  LOG(INFO) << "coordinator for " << mesh->ToString() << " serving on " << o.host << ":" << port
            << " (cluster " << cluster_id << ")";
  if (!o.port_file.empty()) {
    const std::string tmp = o.port_file + ".tmp";
    std::ofstream(tmp) << port << "\n";
    std::rename(tmp.c_str(), o.port_file.c_str());
  }
  while (!g_stop.load() &&
         !service.shutdown().WaitForNotificationWithTimeout(absl::Milliseconds(200))) {
    for (const ClientLeases::Expired& e : leases.Expire(absl::Now())) {
      // One call for all of them: every known array is freed even when some are gone.
      const absl::Status freed = e.arrays.empty() ? absl::OkStatus() : arrays.Delete(e.arrays);
      LOG(WARNING) << "client session " << e.session << " was silent for the lease ("
                   << absl::FormatDuration(o.client_lease) << "): freed its " << e.arrays.size()
                   << " arrays" << (freed.ok() ? "" : absl::StrCat(" but: ", freed.ToString()));
    }
  }
  // Let workers see shutdown=true in a heartbeat before the server goes away (each asks every
  // 500 ms; a dead one never does).
  registry.RequestShutdown();
  if (service.shutdown().HasBeenNotified())
    registry.AwaitShutdownTold(absl::Now() + absl::Seconds(1));
  // What is still in flight after the workers left (a client's call) has half a second.
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Milliseconds(500)));
  LOG(INFO) << "coordinator stopped";
  return absl::OkStatus();
}

}  // namespace meshrun
