#include <algorithm>
#include <cstdio>

#include "bench/bench.h"
#include "bench/collective_timer.h"
#include "core/sharding/mesh.h"
#include "meshrun/local_cluster.h"

namespace meshrun {

int RunCollectivesBench(const CollectivesBenchOptions& o) {
  auto cluster = StartBenchCluster(o.mesh, o.bin_dir, 1, o.shm_transport);
  if (cluster == nullptr) return 1;
  auto stubs = WorkerStubs(cluster->coordinator_address());
  if (!stubs.ok()) return 1;
  if (absl::Status s = SettleWorkers(*stubs); !s.ok()) {
    std::fprintf(stderr, "meshrun bench: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  auto mesh = Mesh::Parse(o.mesh);
  std::printf("# collectives over each axis of Mesh %s (f32; all groups of an axis run at once)\n",
              o.mesh.c_str());
  std::printf("%-8s %-14s %6s %10s %8s %12s %12s %12s\n", "axis", "op", "group", "size", "iters",
              "p50 time(us)", "algbw(GB/s)", "busbw(GB/s)");
  for (int a = 0; a < mesh->num_axes(); ++a) {
    for (const char* op : {"psum", "all_gather", "psum_scatter", "ppermute"}) {
      for (int64_t size : o.sizes_bytes) {
        const int iters =
            static_cast<int>(std::clamp<int64_t>((int64_t{128} << 20) / size, 5, 100));
        auto t =
            TimeCollective(*stubs, op, std::vector<std::string>{mesh->axis_name(a)}, size, iters);
        if (!t.ok()) {
          std::fprintf(stderr, "meshrun bench: %s\n", std::string(t.status().message()).c_str());
          return 1;
        }
        std::printf("%-8s %-14s %6d %10s %8d %12.1f %12.3f %12.3f\n", mesh->axis_name(a).c_str(),
                    op, t->group_size, HumanBytes(size).c_str(), iters, t->p50_seconds * 1e6,
                    t->algbw_gbps, t->busbw_gbps);
        std::fflush(stdout);
      }
    }
  }
  cluster->Stop().IgnoreError();
  return 0;
}

}  // namespace meshrun
