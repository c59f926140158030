#include "bench/collective_timer.h"

#include <algorithm>
#include <cstdio>
#include <thread>

#include "absl/strings/str_cat.h"
#include "bench/netns_hosts.h"
#include "meshrun/client.h"
#include "net/grpc_util.h"

namespace meshrun {

std::string HumanBytes(int64_t b) {
  if (b >= (1 << 20)) return absl::StrCat(b >> 20, " MiB");
  if (b >= (1 << 10)) return absl::StrCat(b >> 10, " KiB");
  return absl::StrCat(b, " B");
}

std::unique_ptr<LocalCluster> StartBenchCluster(const std::string& mesh, const std::string& bin_dir,
                                                int compute_threads, bool shm_transport,
                                                bool insecure, const NetnsHosts* hosts,
                                                const std::vector<std::string>& worker_flags) {
  LocalClusterOptions lo;
  if (hosts != nullptr) {
    lo.worker_netns = hosts->namespaces();
    lo.worker_hosts = hosts->addresses();
    lo.coordinator_host = hosts->bridge_address();
  }
  lo.shm_transport = shm_transport;
  lo.insecure = insecure;
  lo.mesh = mesh;
  lo.bin_dir = bin_dir;
  lo.compute_threads = compute_threads;
  lo.worker_flags = worker_flags;
  auto cluster = LocalCluster::Start(lo);
  if (!cluster.ok()) {
    std::fprintf(stderr, "meshrun bench: %s\n", std::string(cluster.status().message()).c_str());
    return nullptr;
  }
  return *std::move(cluster);
}

absl::StatusOr<std::vector<std::unique_ptr<v1::Worker::Stub>>> WorkerStubs(
    const std::string& coordinator) {
  auto client = Client::Connect(coordinator);
  if (!client.ok()) return client.status();
  auto status = (*client)->GetStatus();
  if (!status.ok()) return status.status();
  std::vector<std::unique_ptr<v1::Worker::Stub>> stubs;
  for (const auto& w : status->workers())
    stubs.push_back(v1::Worker::NewStub(CreateChannel(w.peer().address())));
  return stubs;
}

absl::StatusOr<CollectiveTiming> TimeCollective(
    std::vector<std::unique_ptr<v1::Worker::Stub>>& stubs, const std::string& op,
    const std::vector<std::string>& axes, int64_t num_bytes, int iters,
    const std::string& algorithm) {
  const int n = static_cast<int>(stubs.size());
  std::vector<v1::BenchmarkCollectiveResponse> resp(n);
  std::vector<grpc::Status> st(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      grpc::ClientContext ctx;
      SetTimeout(ctx, absl::Seconds(300));
      v1::BenchmarkCollectiveRequest req;
      req.set_op(op);
      for (const auto& a : axes) req.add_axis_names(a);
      req.set_num_bytes(num_bytes);
      req.set_warmup_iters(std::min(iters, 5));
      req.set_iters(iters);
      req.set_algorithm(algorithm);
      st[r] = stubs[r]->BenchmarkCollective(&ctx, req, &resp[r]);
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    if (!st[r].ok()) return FromGrpcStatus(st[r], absl::StrCat("worker ", r));
  }
  std::vector<double> per_iter(iters, 0.0);
  for (int i = 0; i < iters; ++i) {
    for (int r = 0; r < n; ++r) per_iter[i] = std::max(per_iter[i], resp[r].seconds(i));
  }
  std::sort(per_iter.begin(), per_iter.end());
  CollectiveTiming t;
  t.p50_seconds = per_iter[iters / 2];
  t.group_size = resp[0].group_size();
  const double g = t.group_size;
  t.algbw_gbps = num_bytes / t.p50_seconds / 1e9;
  const double factor = op == "psum" ? 2.0 * (g - 1) / g : op == "ppermute" ? 1.0 : (g - 1) / g;
  t.busbw_gbps = t.algbw_gbps * factor;
  return t;
}

absl::Status SettleWorkers(std::vector<std::unique_ptr<v1::Worker::Stub>>& stubs,
                           absl::Duration duration) {
  const absl::Time until = absl::Now() + duration;
  do {
    if (auto t = TimeCollective(stubs, "psum", {}, 4096, 500); !t.ok()) return t.status();
  } while (absl::Now() < until);
  return absl::OkStatus();
}

}  // namespace meshrun
