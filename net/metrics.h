// Prometheus metrics for meshrun's servers: a pull exposer (prometheus-cpp) and a gRPC server
// interceptor recording the grpc_server_* metrics community dashboards use
// (go-grpc-prometheus names: grpc_server_started_total, grpc_server_handled_total,
// grpc_server_handling_seconds, with grpc_type, grpc_service, grpc_method, grpc_code labels).
#ifndef MESHRUN_NET_METRICS_H_
#define MESHRUN_NET_METRICS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/server_interceptor.h"
#include "prometheus/exposer.h"
#include "prometheus/registry.h"

namespace meshrun {

// Serves GET /metrics over HTTP. Thread-safe (prometheus-cpp's registry is).
class MetricsServer {
 public:
  // Listens on host:port (0: any free port) and registers meshrun_build_info{component,
  // version} and the standard process_cpu_seconds_total, process_resident_memory_bytes and
  // process_start_time_seconds. Errors: Unavailable naming the address if it cannot listen.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& host, int port,
                                                              const std::string& component);

  // Stops serving. civetweb checks for a stop only between polls of its listening socket, each
  // up to 2 s; the destructor connects to that socket meanwhile so that the stop takes
  // milliseconds, not up to 2 s (a process's exit waits for it).
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  prometheus::Registry& registry() { return *registry_; }
  int port() const { return port_; }

  // Installs the grpc_server_* interceptor on `builder` (the ring transport's data streams are
  // not intercepted). The families live in this server's registry; it must outlive the gRPC server.
  void InstallGrpcMetrics(grpc::ServerBuilder& builder);

 private:
  MetricsServer() = default;
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<prometheus::Collectable> process_;  // process_cpu_seconds_total, ...
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::string host_;  // as listened on
  int port_ = 0;
};

// Buckets for durations from 100 us to 100 s.
const std::vector<double>& LatencyBuckets();

}  // namespace meshrun

#endif  // MESHRUN_NET_METRICS_H_
