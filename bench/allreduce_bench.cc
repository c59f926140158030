#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "bench/bench.h"
#include "bench/collective_timer.h"
#include "bench/netns_hosts.h"
#include "meshrun/local_cluster.h"

namespace meshrun {

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
    auto cluster =
        StartBenchCluster(absl::StrCat("data=", n), o.bin_dir, 1, shm, o.insecure, hosts.get());
    if (cluster == nullptr) return 1;
    auto stubs = WorkerStubs(cluster->coordinator_address());
    if (!stubs.ok()) return 1;
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
  }
  return 0;
}

}  // namespace meshrun
