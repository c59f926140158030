// JobDriver's elastic recovery: which workers a failure lost, and re-forming the cluster without
// them (server/job_driver.h).
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/port/process.h"
#include "glog/logging.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "net/grpc_util.h"
#include "server/job_driver.h"

namespace meshrun {

std::vector<v1::WorkerLost> JobDriver::FindLostWorkers(const absl::Status& failure, int64_t step,
                                                       uint64_t generation) {
  const auto describe = [&](const v1::PeerInfo& p, const std::string& cause) {
    v1::WorkerLost w;
    w.set_rank(p.rank());
    w.set_pid(p.pid());
    w.set_host(p.hostname());
    w.set_address(p.address());
    w.set_cause(cause);
    w.set_error(std::string(failure.message()));
    w.set_step(step);
    return w;
  };
  std::vector<v1::WorkerLost> lost;
  if (registry_->generation() != generation) {
    // Already re-forming: a new process registered at a lost worker's address (it had exited).
    for (const v1::PeerInfo& p : registry_->last_lost())
      lost.push_back(describe(p, registry_->KilledByOom(p) ? "out of memory" : "killed"));
    return lost;
  }
  const std::vector<v1::PeerInfo> peers = registry_->Peers();
  std::vector<int> silent;
  for (const auto& [rank, why] : registry_->DeadRanks(registry_->heartbeat_timeout()))
    silent.push_back(rank);
  std::vector<grpc::Status> probes(peers.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < peers.size(); ++r) {
    threads.emplace_back([&, r] {
      auto stub = grpc::health::v1::Health::NewStub(CreateChannel(peers[r].address()));
      grpc::ClientContext ctx;
      // As long as the heartbeats may be late: a live worker on a starved CPU answers slowly.
      SetTimeout(ctx, registry_->heartbeat_timeout());
      grpc::health::v1::HealthCheckRequest req;
      req.set_service(kWorkerHealthService);
      grpc::health::v1::HealthCheckResponse resp;
      probes[r] = stub->Check(&ctx, req, &resp);
      if (probes[r].ok() && resp.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
        // A process restarted at the worker's address that has not joined (or does not serve).
        probes[r] = grpc::Status(grpc::StatusCode::UNAVAILABLE, "not joined");
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (size_t r = 0; r < peers.size(); ++r) {
    const bool is_silent = std::find(silent.begin(), silent.end(), r) != silent.end();
    if (probes[r].ok() && !is_silent) continue;
    // Only a process this coordinator sees is known to be gone or alive: one on another host (a
    // container, another machine) that neither answers nor heartbeats may have died or hung.
    std::string cause = "unreachable";
    const ProcessState state = ObserveProcess(peers[r].process_identity());
    if (state == ProcessState::kGone) {
      cause = registry_->KilledByOom(peers[r]) ? "out of memory" : "killed";
    } else if (state == ProcessState::kStopped ||
               (state == ProcessState::kRunning &&
                (probes[r].error_code() == grpc::DEADLINE_EXCEEDED || is_silent))) {
      cause = "hung";
    }
    lost.push_back(describe(peers[r], cause));
  }
  return lost;
}

absl::Status JobDriver::Reform(const v1::JobSpec& job, const std::vector<v1::WorkerLost>& lost,
                               const absl::Status& failure, uint64_t generation,
                               const EventSink& emit) {
  std::vector<int> ranks;
  for (const v1::WorkerLost& w : lost) {
    ranks.push_back(w.rank());
    LOG(WARNING) << "job lost worker rank " << w.rank() << " (" << w.address() << ", pid "
                 << w.pid() << ", " << w.cause() << ") after step " << w.step();
    if (options_.metrics != nullptr) options_.metrics->OnWorkerLost(w.cause());
    const v1::PeerInfo peer = registry_->Peer(w.rank());
    const ProcessState state = ObserveProcess(peer.process_identity());
    if (w.cause() == "hung" && peer.pid() == w.pid() &&
        (state == ProcessState::kRunning || state == ProcessState::kStopped)) {
      // As torchrun's agent does: end it, so that its process manager starts a fresh one (only a
      // process this coordinator sees, so never another that reused the pid).
      LOG(WARNING) << "killing hung worker rank " << w.rank() << " (pid " << w.pid() << ")";
      kill(static_cast<pid_t>(w.pid()), SIGKILL);
    }
    v1::JobEvent e;
    *e.mutable_worker_lost() = w;
    if (!emit(e)) return absl::CancelledError("job cancelled: the client went away");
  }
  if (registry_->generation() == generation)  // else a new process at a lost address began it
    registry_->BeginRecovery(ranks, std::string(failure.message()));
  const absl::Duration timeout = job.recovery().timeout_seconds() > 0
                                     ? absl::Seconds(job.recovery().timeout_seconds())
                                     : absl::Seconds(60);
  absl::Status s = registry_->WaitUntilReady(absl::Now() + timeout);
  if (!s.ok() && job.recovery().min_workers() > 0) {
    absl::Status shrunk = ContinueOnFewer(job.recovery().min_workers(), emit);
    if (shrunk.ok()) return shrunk;
    s = absl::Status(s.code(), absl::StrCat(s.message(), "; ", shrunk.message()));
  }
  if (!s.ok()) {
    return absl::DeadlineExceededError(absl::StrCat(
        "lost ranks [", absl::StrJoin(ranks, ", "), "] and the cluster did not re-form within ",
        absl::FormatDuration(timeout), " (recovery.timeout_seconds): ", s.message(),
        "; the failure was: ", failure.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<Mesh> SmallerDataMesh(const Mesh& mesh, int available, int min_workers) {
  int axis = 0;
  for (int a = 0; a < mesh.num_axes(); ++a) {
    if (mesh.axis_name(a) == "data") axis = a;
  }
  const int d = mesh.axis_size(axis);
  const int others = mesh.size() / d;
  for (int smaller = d - 1; smaller >= 1; --smaller) {
    if (d % smaller != 0 || smaller * others > available) continue;
    if (smaller * others < min_workers) break;
    std::vector<std::pair<std::string, int>> axes;
    for (int a = 0; a < mesh.num_axes(); ++a)
      axes.emplace_back(mesh.axis_name(a), a == axis ? smaller : mesh.axis_size(a));
    return Mesh::Create(axes);
  }
  return absl::FailedPreconditionError(absl::StrCat(
      available, " workers rejoined; no smaller '", mesh.axis_name(axis), "' axis dividing ", d,
      " fits them with at least recovery.min_workers ", min_workers, " devices"));
}

absl::Status JobDriver::ContinueOnFewer(int min_workers, const EventSink& emit) {
  const Mesh before = registry_->mesh();
  absl::StatusOr<Mesh> smaller = SmallerDataMesh(before, registry_->RegisteredCount(), min_workers);
  if (!smaller.ok()) return smaller.status();
  if (absl::Status s = registry_->Shrink(*smaller); !s.ok()) return s;
  if (absl::Status s = registry_->WaitUntilReady(absl::Now() + absl::Seconds(20)); !s.ok())
    return s;
  if (options_.metrics != nullptr) options_.metrics->OnMeshChanged(*smaller);
  v1::JobEvent e;
  e.set_info(absl::StrCat("no replacement came: continuing on ", smaller->ToString(), " (was ",
                          before.ToString(), "), recovery.min_workers ", min_workers));
  if (!emit(e)) return absl::CancelledError("job cancelled: the client went away");
  return absl::OkStatus();
}

}  // namespace meshrun
