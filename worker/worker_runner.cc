#include "worker/worker_runner.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/port/process.h"
#include "core/tensor.h"
#include "glog/logging.h"
#include "grpcpp/health_check_service_interface.h"
#include "meshrun/v1/coordinator.grpc.pb.h"
#include "net/credentials.h"
#include "net/grpc_util.h"
#include "net/metrics.h"
#include "worker/shm_arena.h"
#include "worker/shm_transport.h"
#include "worker/worker_service.h"

namespace meshrun {
namespace {

std::atomic<int> g_rank{-1};
std::atomic<bool> g_stop{false};

void OnSignal(int) { g_stop.store(true); }

absl::StatusOr<v1::RegisterResponse> RegisterWithRetry(v1::Coordinator::Stub& stub,
                                                       const v1::RegisterRequest& req,
                                                       const WorkerRunnerOptions& o) {
  const absl::Time start = absl::Now();
  const absl::Time give_up = start + o.join_timeout;
  absl::Duration backoff = absl::Milliseconds(100);
  int attempts = 0;
  grpc::Status last;
  while (!g_stop.load()) {
    ++attempts;
    grpc::ClientContext ctx;
    // Registration returns when every worker has joined; wait up to the join deadline.
    ctx.set_deadline(absl::ToChronoTime(std::min(give_up, absl::Now() + absl::Seconds(10))));
    v1::RegisterResponse resp;
    last = stub.Register(&ctx, req, &resp);
    if (last.ok()) return resp;
    if (last.error_code() != grpc::UNAVAILABLE && last.error_code() != grpc::DEADLINE_EXCEEDED) {
      return FromGrpcStatus(
          last, absl::StrCat("coordinator at ", o.coordinator, " refused registration"));
    }
    if (absl::Now() + backoff >= give_up) break;
    LOG(WARNING) << "coordinator at " << o.coordinator << " not ready (" << last.error_message()
                 << "); retrying in " << backoff;
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Seconds(2));
  }
  return absl::Status(
      last.error_code() == grpc::DEADLINE_EXCEEDED ? absl::StatusCode::kDeadlineExceeded
                                                   : absl::StatusCode::kUnavailable,
      absl::StrCat("could not join the cluster at coordinator ", o.coordinator, " after ", attempts,
                   " attempts over ",
                   absl::FormatDuration(absl::Trunc(absl::Now() - start, absl::Milliseconds(100))),
                   ": ", last.error_message()));
}

// Joins a restarted coordinator as the same rank of the same cluster (its heartbeat answered
// NotFound: it does not know this worker). Errors: the registration's, or FailedPrecondition when
// the coordinator's mesh, rank or peers differ from `m` (this worker's transports are built for
// those; it exits and its process manager starts a fresh one).
absl::Status Rejoin(v1::Coordinator::Stub& stub, v1::RegisterRequest req, Membership* membership,
                    const WorkerRunnerOptions& o) {
  const Membership& m = *membership;
  req.set_requested_rank(m.rank);
  req.set_cluster_id(m.cluster_id);
  absl::StatusOr<v1::RegisterResponse> reg = RegisterWithRetry(stub, req, o);
  if (!reg.ok()) return reg.status();
  bool same = reg->rank() == m.rank && reg->cluster_id() == m.cluster_id &&
              reg->peers_size() == static_cast<int>(m.addresses.size());
  for (int r = 0; same && r < reg->peers_size(); ++r)
    same = reg->peers(r).address() == m.addresses[r];
  absl::StatusOr<Mesh> mesh = Mesh::FromProto(reg->mesh());
  if (!same || !mesh.ok() || !(*mesh == m.mesh)) {
    return absl::FailedPreconditionError(
        absl::StrCat("the coordinator at ", o.coordinator, " restarted with another cluster (rank ",
                     reg->rank(), " of cluster '", reg->cluster_id(), "'); this worker was rank ",
                     m.rank, " of '", m.cluster_id, "'"));
  }
  LOG(INFO) << "rejoined the restarted coordinator at " << o.coordinator << " as rank " << m.rank;
  membership->generation = reg->generation();
  return absl::OkStatus();
}

// Starts this program afresh (execv of /proc/self/exe with the same arguments, from
// /proc/self/cmdline), asking for `rank` through kRejoinRankEnv. Returns only on failure.
absl::Status RestartProcess(int rank) {
  std::string cmdline;
  {
    std::ifstream in("/proc/self/cmdline", std::ios::binary);  // closed before the exec
    cmdline.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  std::vector<std::string> args = absl::StrSplit(cmdline, '\0', absl::SkipEmpty());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  setenv(kRejoinRankEnv, std::to_string(rank).c_str(), 1);
  google::FlushLogFiles(google::GLOG_INFO);
  execv("/proc/self/exe", argv.data());
  return absl::InternalError(
      absl::StrCat("cannot restart: execv(/proc/self/exe): ", std::strerror(errno)));
}

}  // namespace

int CurrentWorkerRank() { return g_rank.load(); }

// Arrays from this size on go to the shared arena: what CollectiveOptions::direct_min_bytes
// all-reduces single-copy.
constexpr size_t kSharedTensorMinBytes = 256 * 1024;

namespace {

// The collectives' and the gRPC transport's settings from the flags, and the peers' state copies
// this process held before an exec (a restart as the cluster re-formed).
void ConfigureWorker(WorkerService& worker, const WorkerRunnerOptions& o) {
  CollectiveOptions collectives;
  collectives.chunk_bytes = static_cast<size_t>(o.ring_chunk_bytes);
  collectives.small_message_bytes = static_cast<size_t>(o.recursive_doubling_max_bytes);
  collectives.one_shot_max_bytes = static_cast<size_t>(o.one_shot_max_bytes);
  collectives.receive_spin = o.receive_spin;
  worker.set_collective_defaults(collectives);
  GrpcStripeOptions stripes;
  stripes.max_stripes = o.grpc_stripes;
  stripes.stripe_bytes = static_cast<size_t>(o.grpc_stripe_bytes);
  worker.set_grpc_stripes(stripes);
  if (absl::Status s = worker.peer_state().ImportAfterExec(); !s.ok()) {
    LOG(WARNING) << "the peers' state copies were not kept over the restart: " << s;
  } else if (worker.peer_state().bytes() > 0) {
    LOG(INFO) << "kept " << worker.peer_state().bytes()
              << " bytes of peers' state copies over the restart";
  }
}

// The worker's gRPC server (WorkerService and RingService, node credentials required) on
// o.host:o.port; `*port` is the port it got. Unavailable when it cannot listen there.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartServer(const WorkerRunnerOptions& o,
                                                          WorkerService& worker, RingService& ring,
                                                          MetricsServer* metrics_server,
                                                          int* port) {
  grpc::ServerBuilder builder;
  ConfigureServerBuilder(builder);
  if (metrics_server != nullptr) metrics_server->InstallGrpcMetrics(builder);
  builder.AddListeningPort(
      absl::StrCat(o.host, ":", o.port),
      NodeServerCredentials(ProcessCredentials(), /*require_node_certificate=*/true), port);
  builder.RegisterService(&worker);
  builder.RegisterService(&ring);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || *port == 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on ", o.host, ":", o.port,
        ": the port is held by another process (a live worker?) or the address is not local"));
  }
  return server;
}

// This process's registration: where it serves, who it is (pid, host, a fresh incarnation),
// the rank it asks for, and its shared-memory host and metrics address where it has them.
v1::RegisterRequest MakeRegisterRequest(const WorkerRunnerOptions& o, const std::string& address,
                                        const std::string& metrics_address) {
  v1::RegisterRequest req;
  req.set_address(address);
  req.set_pid(getpid());
  char hostname[256] = {};
  gethostname(hostname, sizeof(hostname) - 1);
  req.set_hostname(hostname);
  req.set_requested_rank(o.requested_rank);
  req.set_process_identity(ProcessIdentity(getpid()));
  req.set_incarnation((uint64_t{std::random_device()()} << 32) | std::random_device()());
  if (o.shm_transport) req.set_shm_host_id(ShmHostId());
  if (!metrics_address.empty()) req.set_metrics_address(metrics_address);
  return req;
}

// The cluster this worker joined, from the coordinator's answer; an error for a bad mesh.
absl::StatusOr<Membership> MembershipOf(const v1::RegisterResponse& reg) {
  Membership m;
  m.rank = reg.rank();
  absl::StatusOr<Mesh> mesh = Mesh::FromProto(reg.mesh());
  if (!mesh.ok()) return mesh.status();
  m.mesh = *mesh;
  for (const auto& p : reg.peers()) {
    m.addresses.push_back(p.address());
    m.shm_peers.push_back(ShmPeer{p.shm_host_id(), p.pid()});
  }
  m.cluster_id = reg.cluster_id();
  m.generation = reg.generation();
  return m;
}

// Heartbeats until a signal, the coordinator's shutdown, or a restart (the cluster re-forming:
// this process execs itself, so this returns only if that failed). Rejoins a restarted
// coordinator; Unavailable once the coordinator was unreachable for o.orphan_timeout.
absl::Status Heartbeat(v1::Coordinator::Stub& stub, const v1::RegisterRequest& req, Membership& m,
                       WorkerService& worker, grpc::Server& server, const WorkerRunnerOptions& o) {
  absl::Time last_ok = absl::Now();
  for (; !g_stop.load(); absl::SleepFor(o.heartbeat_interval)) {
    grpc::ClientContext ctx;
    SetTimeout(ctx, absl::Seconds(2));
    v1::HeartbeatRequest hb;
    hb.set_rank(m.rank);
    hb.set_cluster_id(m.cluster_id);
    hb.set_generation(m.generation);
    hb.set_incarnation(req.incarnation());
    v1::HeartbeatResponse hr;
    grpc::Status s = stub.Heartbeat(&ctx, hb, &hr);
    if (s.ok()) {
      last_ok = absl::Now();
      if (hr.shutdown()) {
        LOG(INFO) << "coordinator asked this worker to stop";
        return absl::OkStatus();
      }
      if (hr.restart()) {
        LOG(WARNING) << "the cluster is re-forming after a lost worker: restarting as rank "
                     << m.rank;
        worker.AbortRuns("the cluster is re-forming after a lost worker");
        // The peers' ring streams into this worker never end by themselves and the re-formed
        // cluster waits for it: no graceful teardown (closing links to dead peers waits out
        // their deadlines); the kernel closes every descriptor (all close-on-exec) and memory.
        server.Shutdown(absl::ToChronoTime(absl::Now() + absl::Milliseconds(50)));
        if (absl::Status s = worker.peer_state().ExportForExec(); !s.ok())
          LOG(WARNING) << "the peers' state copies are lost with this restart: " << s;
        return RestartProcess(m.rank);  // returns only if exec failed
      }
    } else if (s.error_code() == grpc::NOT_FOUND) {
      // A restarted coordinator: it does not know this worker yet.
      LOG(WARNING) << "coordinator at " << o.coordinator << " does not know rank " << m.rank << " ("
                   << s.error_message() << "); registering again";
      // A run the old coordinator started never finishes: free this worker for the new one.
      worker.AbortRuns(absl::StrCat("the coordinator at ", o.coordinator, " restarted"));
      if (absl::Status r = Rejoin(stub, req, &m, o); !r.ok()) return r;
      last_ok = absl::Now();
    } else if (absl::Now() - last_ok > o.orphan_timeout) {
      return absl::UnavailableError(
          absl::StrCat("coordinator at ", o.coordinator, " unreachable for ",
                       absl::FormatDuration(o.orphan_timeout), ": ", s.error_message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RunWorker(const WorkerRunnerOptions& o) {
  if (o.shm_transport) UnlinkOwnShmSegments();  // an earlier image of this process left them
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  const std::string advertise = o.advertise_host.empty() ? o.host : o.advertise_host;
  std::unique_ptr<MetricsServer> metrics_server;
  std::unique_ptr<WorkerMetrics> metrics;
  if (o.metrics_port >= 0) {
    absl::StatusOr<std::unique_ptr<MetricsServer>> m =
        MetricsServer::Start(o.host, o.metrics_port, "worker");
    if (!m.ok()) return m.status();
    metrics_server = *std::move(m);
    metrics = std::make_unique<WorkerMetrics>(metrics_server->registry(), o.kernel_shape_labels);
  }
  grpc::EnableDefaultHealthCheckService(true);
  // With shared memory, large arrays live where co-located peers can map them (shm_arena.h), so
  // big all-reduces among them are single-copy. Set before any thread makes Tensors; never freed.
  ShmArena* arena = nullptr;
  if (o.shm_transport) {
    arena = new ShmArena(ShmArena::Options());
    SetLargeTensorAllocator(kSharedTensorMinBytes,
                            [arena](size_t bytes) { return arena->Allocate(bytes); });
  }
  WorkerService worker(o.compute_threads, metrics.get(), arena, o.memory_budget_bytes,
                       o.checkpoint_root);
  ConfigureWorker(worker, o);
  RingService ring;
  int port = 0;
  absl::StatusOr<std::unique_ptr<grpc::Server>> server =
      StartServer(o, worker, ring, metrics_server.get(), &port);
  if (!server.ok()) return server.status();
  const std::string address = absl::StrCat(advertise, ":", port);
  LOG(INFO) << "worker serving on " << address << ", joining coordinator " << o.coordinator;

  auto stub = v1::Coordinator::NewStub(CreateChannel(o.coordinator));
  const v1::RegisterRequest req = MakeRegisterRequest(
      o, address,
      metrics_server == nullptr ? "" : absl::StrCat(advertise, ":", metrics_server->port()));
  absl::StatusOr<v1::RegisterResponse> reg = RegisterWithRetry(*stub, req, o);
  if (!reg.ok()) {
    (*server)->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
    return g_stop.load() ? absl::OkStatus() : reg.status();
  }
  absl::StatusOr<Membership> m = MembershipOf(*reg);
  if (!m.ok()) return m.status();
  g_rank.store(m->rank);
  worker.Join(*m, &ring);
  (*server)->GetHealthCheckService()->SetServingStatus(kWorkerHealthService, true);
  LOG(INFO) << "joined " << m->mesh.ToString() << " as rank " << m->rank << "; ring prev "
            << reg->ring_prev() << ", next " << reg->ring_next();
  absl::Status result = Heartbeat(*stub, req, *m, worker, **server, o);
  // The peers' ring streams into this server end only when the peers, stopping too, close their
  // transports, which they do after their own servers stop: waiting longer for them would only
  // delay every worker's exit. Calls still in flight are cancelled after this grace.
  (*server)->Shutdown(absl::ToChronoTime(absl::Now() + absl::Milliseconds(250)));
  return result;
}

}  // namespace meshrun
