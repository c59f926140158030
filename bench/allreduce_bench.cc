#include <algorithm>
#include <cstdio>
#include <thread>

#include "absl/strings/str_cat.h"
#include "bench/bench.h"
#include "meshrun/client.h"
#include "meshrun/local_cluster.h"
#include "meshrun/v1/worker.grpc.pb.h"
#include "net/grpc_util.h"

namespace meshrun {
namespace {

std::string HumanBytes(int64_t b) {
  if (b >= (1 << 20)) return absl::StrCat(b >> 20, " MiB");
  if (b >= (1 << 10)) return absl::StrCat(b >> 10, " KiB");
  return absl::StrCat(b, " B");
}

}  // namespace

int RunAllReduceBench(const AllReduceBenchOptions& o) {
  std::vector<int64_t> sizes = o.sizes_bytes;
  if (sizes.empty()) {
    for (int64_t s = 4 << 10; s <= (int64_t{64} << 20); s *= 4) sizes.push_back(s);
  }
  std::printf("# ring all-reduce (f32, pmean) over gRPC on loopback; one worker process per rank\n");
  std::printf("%8s %10s %8s %12s %12s %12s\n", "workers", "size", "iters", "p50 time(us)", "algbw(GB/s)",
              "busbw(GB/s)");
  for (int n : o.workers) {
    LocalClusterOptions lo;
    lo.mesh = absl::StrCat("data=", n);
    lo.bin_dir = o.bin_dir;
    lo.compute_threads = 1;
    auto cluster = LocalCluster::Start(lo);
    if (!cluster.ok()) {
      std::fprintf(stderr, "meshrun bench: %s\n", std::string(cluster.status().message()).c_str());
      return 1;
    }
    auto client = Client::Connect((*cluster)->coordinator_address());
    if (!client.ok()) return 1;
    auto status = (*client)->GetStatus();
    if (!status.ok()) return 1;
    std::vector<std::unique_ptr<v1::Worker::Stub>> stubs;
    for (const auto& w : status->workers()) stubs.push_back(v1::Worker::NewStub(CreateChannel(w.peer().address())));
    for (int64_t size : sizes) {
      const int iters = o.iters > 0 ? o.iters : static_cast<int>(std::clamp<int64_t>((int64_t{256} << 20) / size, 5, 200));
      std::vector<v1::BenchmarkAllReduceResponse> resp(n);
      std::vector<grpc::Status> st(n);
      std::vector<std::thread> threads;
      for (int r = 0; r < n; ++r) {
        threads.emplace_back([&, r] {
          grpc::ClientContext ctx;
          SetTimeout(ctx, absl::Seconds(300));
          v1::BenchmarkAllReduceRequest req;
          req.set_num_bytes(size);
          req.set_warmup_iters(std::min(iters, 5));
          req.set_iters(iters);
          st[r] = stubs[r]->BenchmarkAllReduce(&ctx, req, &resp[r]);
        });
      }
      for (auto& t : threads) t.join();
      for (int r = 0; r < n; ++r) {
        if (!st[r].ok()) {
          std::fprintf(stderr, "meshrun bench: worker %d: %s\n", r, st[r].error_message().c_str());
          return 1;
        }
      }
      // A call takes as long as its slowest rank.
      std::vector<double> per_iter(iters, 0.0);
      for (int i = 0; i < iters; ++i) {
        for (int r = 0; r < n; ++r) per_iter[i] = std::max(per_iter[i], resp[r].seconds(i));
      }
      std::sort(per_iter.begin(), per_iter.end());
      const double t = per_iter[iters / 2];
      const double algbw = size / t / 1e9;
      const double busbw = algbw * 2.0 * (n - 1) / n;
      std::printf("%8d %10s %8d %12.1f %12.3f %12.3f\n", n, HumanBytes(size).c_str(), iters, t * 1e6, algbw, busbw);
      std::fflush(stdout);
    }
    (*cluster)->Stop().IgnoreError();
  }
  return 0;
}

}  // namespace meshrun
