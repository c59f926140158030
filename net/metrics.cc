#include "net/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "prometheus/client_metric.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/metric_family.h"

namespace meshrun {
namespace {

// grpc-go's code names, as go-grpc-prometheus writes them.
const char* CodeName(grpc::StatusCode code) {
  static const char* kNames[] = {
      "OK",       "Canceled",       "Unknown",          "InvalidArgument",   "DeadlineExceeded",
      "NotFound", "AlreadyExists",  "PermissionDenied", "ResourceExhausted", "FailedPrecondition",
      "Aborted",  "OutOfRange",     "Unimplemented",    "Internal",          "Unavailable",
      "DataLoss", "Unauthenticated"};
  const int c = static_cast<int>(code);
  return c >= 0 && c < 17 ? kNames[c] : "Unknown";
}

const char* TypeName(grpc::experimental::ServerRpcInfo::Type type) {
  switch (type) {
    case grpc::experimental::ServerRpcInfo::Type::UNARY:
      return "unary";
    case grpc::experimental::ServerRpcInfo::Type::CLIENT_STREAMING:
      return "client_stream";
    case grpc::experimental::ServerRpcInfo::Type::SERVER_STREAMING:
      return "server_stream";
    default:
      return "bidi_stream";
  }
}

struct GrpcFamilies {
  prometheus::Family<prometheus::Counter>* started;
  prometheus::Family<prometheus::Counter>* handled;
  prometheus::Family<prometheus::Histogram>* seconds;
};

class Interceptor : public grpc::experimental::Interceptor {
 public:
  Interceptor(grpc::experimental::ServerRpcInfo* info, const GrpcFamilies& f) : families_(f) {
    std::vector<std::string> parts = absl::StrSplit(info->method(), '/', absl::SkipEmpty());
    labels_ = {{"grpc_type", TypeName(info->type())},
               {"grpc_service", parts.size() == 2 ? parts[0] : "unknown"},
               {"grpc_method", parts.size() == 2 ? parts[1] : info->method()}};
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      start_ = std::chrono::steady_clock::now();
      families_.started->Add(labels_).Increment();
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      auto labels = labels_;
      labels["grpc_code"] = CodeName(methods->GetSendStatus().error_code());
      families_.handled->Add(labels).Increment();
      families_.seconds->Add(labels_, LatencyBuckets())
          .Observe(
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
    }
    methods->Proceed();
  }

 private:
  const GrpcFamilies& families_;
  std::map<std::string, std::string> labels_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

class InterceptorFactory : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit InterceptorFactory(prometheus::Registry& r)
      : families_{&prometheus::BuildCounter()
                       .Name("grpc_server_started_total")
                       .Help("RPCs started on the server.")
                       .Register(r),
                  &prometheus::BuildCounter()
                       .Name("grpc_server_handled_total")
                       .Help("RPCs completed on the server, by status code.")
                       .Register(r),
                  &prometheus::BuildHistogram()
                       .Name("grpc_server_handling_seconds")
                       .Help("Time from receiving an RPC to sending its status.")
                       .Register(r)} {}

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    // The ring's long-lived data streams are not requests: counting them as handled RPCs says
    // nothing, and intercepting every chunk would cost time on the collectives' hot path.
    if (absl::StartsWith(info->method(), "/meshrun.v1.Ring/")) return nullptr;
    return new Interceptor(info, families_);
  }

 private:
  GrpcFamilies families_;
};

// The standard process_* metrics of Prometheus client libraries, read from /proc/self.
class ProcessCollector : public prometheus::Collectable {
 public:
  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> out;
    long ticks = sysconf(_SC_CLK_TCK), page = sysconf(_SC_PAGESIZE);
    std::ifstream stat("/proc/self/stat");
    std::string line;
    std::getline(stat, line);
    // Fields after the command name (which may hold spaces) start at ") ".
    const size_t close = line.rfind(") ");
    if (close == std::string::npos) return out;
    std::vector<std::string> f = absl::StrSplit(line.substr(close + 2), ' ');
    if (f.size() < 22) return out;
    const double cpu = (std::stod(f[11]) + std::stod(f[12])) / static_cast<double>(ticks);
    const double rss = std::stod(f[21]) * static_cast<double>(page);
    std::ifstream uptime_file("/proc/uptime");
    double uptime = 0;
    uptime_file >> uptime;
    const double now =
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    const double start = now - uptime + std::stod(f[19]) / static_cast<double>(ticks);
    auto family = [&](const char* name, const char* help, prometheus::MetricType type,
                      double value) {
      prometheus::MetricFamily fam;
      fam.name = name;
      fam.help = help;
      fam.type = type;
      prometheus::ClientMetric m;
      if (type == prometheus::MetricType::Counter) {
        m.counter.value = value;
      } else {
        m.gauge.value = value;
      }
      fam.metric.push_back(m);
      out.push_back(fam);
    };
    family("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.",
           prometheus::MetricType::Counter, cpu);
    family("process_resident_memory_bytes", "Resident memory size in bytes.",
           prometheus::MetricType::Gauge, rss);
    family("process_start_time_seconds", "Start time of the process since unix epoch in seconds.",
           prometheus::MetricType::Gauge, start);
    return out;
  }
};

}  // namespace

const std::vector<double>& LatencyBuckets() {
  static const std::vector<double> kBuckets = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                                               0.01,   0.025,   0.05,   0.1,   0.25,   0.5,
                                               1,      2.5,     5,      10,    25,     100};
  return kBuckets;
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& host,
                                                                    int port,
                                                                    const std::string& component) {
  std::unique_ptr<MetricsServer> m(new MetricsServer());
  m->registry_ = std::make_shared<prometheus::Registry>();
  try {
    m->exposer_ = std::make_unique<prometheus::Exposer>(absl::StrCat(host, ":", port));
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("metrics endpoint cannot listen on ", host, ":", port, ": ", e.what()));
  }
  m->exposer_->RegisterCollectable(m->registry_);
  m->process_ = std::make_shared<ProcessCollector>();
  m->exposer_->RegisterCollectable(m->process_);
  const std::vector<int> ports = m->exposer_->GetListeningPorts();
  m->port_ = ports.empty() ? port : ports.front();
  m->host_ = host;
  prometheus::BuildGauge()
      .Name("meshrun_build_info")
      .Help("Always 1; labels carry the component and version.")
      .Register(*m->registry_)
      .Add({{"component", component}, {"version", "0.1.0"}})
      .Set(1);
  return m;
}

namespace {

// Opens and closes one TCP connection to host:port (IPv4 literal; 0.0.0.0 and "" mean loopback).
void Knock(const std::string& host, int port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const std::string to = host.empty() || host == "0.0.0.0" ? "127.0.0.1" : host;
  if (inet_pton(AF_INET, to.c_str(), &addr.sin_addr) != 1) return;  // a name or IPv6: not woken
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  close(fd);
}

}  // namespace

MetricsServer::~MetricsServer() {
  if (exposer_ == nullptr) return;
  std::atomic<bool> stopped{false};
  std::thread knocker([&] {
    while (!stopped.load()) {
      Knock(host_, port_);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  exposer_.reset();
  stopped.store(true);
  knocker.join();
}

void MetricsServer::InstallGrpcMetrics(grpc::ServerBuilder& builder) {
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<InterceptorFactory>(*registry_));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
}

}  // namespace meshrun
