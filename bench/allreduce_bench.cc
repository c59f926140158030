#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "bench/bench.h"
#include "bench/collective_timer.h"
#include "bench/netns_hosts.h"
#include "meshrun/local_cluster.h"

namespace meshrun {

namespace {

// Starts a cluster of `n` workers with `worker_flags`, prints a row per size and algorithm,
// stops it. Returns a process exit code.
int TimeOneCluster(const AllReduceBenchOptions& o, int n, const std::vector<int64_t>& sizes,
                   const std::vector<std::string>& worker_flags) {
  const bool shm = o.shm_transport && !o.netns;
  std::unique_ptr<NetnsHosts> hosts;
  if (o.netns) {
    auto made = NetnsHosts::Create(n, absl::Microseconds(o.netem_delay_us));
    if (!made.ok()) {
      std::fprintf(stderr, "meshrun bench: --netns: %s\n",
                   std::string(made.status().message()).c_str());
      return 1;
    }
    hosts = *std::move(made);
  }
  auto cluster = StartBenchCluster(absl::StrCat("data=", n), o.bin_dir, 1, shm, o.insecure,
                                   hosts.get(), worker_flags);
  if (cluster == nullptr) return 1;
  auto stubs = WorkerStubs(cluster->coordinator_address());
  if (!stubs.ok()) return 1;
  if (absl::Status s = SettleWorkers(*stubs); !s.ok()) {
    std::fprintf(stderr, "meshrun bench: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  for (int64_t size : sizes) {
    const int iters =
        o.iters > 0 ? o.iters
                    : static_cast<int>(std::clamp<int64_t>((int64_t{256} << 20) / size, 5, 200));
    for (const std::string& algorithm : o.algorithms) {
      auto t = TimeCollective(*stubs, "psum", {}, size, iters, algorithm);
      if (!t.ok()) {
        std::fprintf(stderr, "meshrun bench: %s\n", std::string(t.status().message()).c_str());
        return 1;
      }
      std::printf("%8d %10s %18s %8d %12.1f %12.3f %12.3f\n", n, HumanBytes(size).c_str(),
                  algorithm.empty() ? "by size" : algorithm.c_str(), iters, t->p50_seconds * 1e6,
                  t->algbw_gbps, t->busbw_gbps);
      std::fflush(stdout);
    }
  }
  cluster->Stop().IgnoreError();
  return 0;
}

// Each setting of the workers' striping and ring chunk size in turn (one cluster each); {} keeps
// their defaults.
std::vector<std::vector<std::string>> WorkerSettings(const AllReduceBenchOptions& o) {
  std::vector<std::vector<std::string>> stripings;
  for (int stripes : o.grpc_stripes) {
    stripings.push_back({absl::StrCat("--grpc_stripes=", stripes)});
    if (o.grpc_stripe_bytes > 0) {
      stripings.back().push_back(absl::StrCat("--grpc_stripe_bytes=", o.grpc_stripe_bytes));
    }
  }
  if (stripings.empty()) stripings.push_back({});
  if (o.ring_chunk_bytes.empty()) return stripings;
  std::vector<std::vector<std::string>> settings;
  for (const std::vector<std::string>& striping : stripings) {
    for (int64_t chunk : o.ring_chunk_bytes) {
      settings.push_back(striping);
      settings.back().push_back(absl::StrCat("--ring_chunk_bytes=", chunk));
    }
  }
  return settings;
}

}  // namespace

int RunAllReduceBench(const AllReduceBenchOptions& o) {
  std::vector<int64_t> sizes = o.sizes_bytes;
  if (sizes.empty()) {
    for (int64_t s = 4 << 10; s <= (int64_t{64} << 20); s *= 4) sizes.push_back(s);
  }
  const bool shm = o.shm_transport && !o.netns;
  const std::string over =
      o.netns ? absl::StrCat("gRPC between network namespaces on a bridge, netem delay ",
                             o.netem_delay_us, " us")
              : (shm ? "shared memory" : "gRPC on loopback");
  std::printf("# all-reduce (f32 psum) over %s; %s; one worker process per rank\n", over.c_str(),
              o.insecure ? "no TLS" : "mutual TLS");
  std::printf("%8s %10s %18s %8s %12s %12s %12s\n", "workers", "size", "algorithm", "iters",
              "p50 time(us)", "algbw(GB/s)", "busbw(GB/s)");
  for (int n : o.workers) {
    for (const std::vector<std::string>& flags : WorkerSettings(o)) {
      if (!flags.empty()) std::printf("# workers %s\n", absl::StrJoin(flags, " ").c_str());
      if (int rc = TimeOneCluster(o, n, sizes, flags); rc != 0) return rc;
    }
  }
  return 0;
}

}  // namespace meshrun
