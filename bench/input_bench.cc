#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "bench/bench.h"
#include "core/data/input_pipeline.h"

namespace meshrun {

int RunInputBench(const InputBenchOptions& o) {
  absl::StatusOr<std::unique_ptr<Dataset>> opened = Dataset::Open("idx", o.data_dir, "train");
  if (!opened.ok()) {
    std::fprintf(stderr, "meshrun bench: %s\n", std::string(opened.status().message()).c_str());
    return 1;
  }
  std::shared_ptr<const Dataset> ds(*std::move(opened));
  std::printf(
      "# the main job's input pipeline alone (Fashion-MNIST IDX, global batch 128 in 4 "
      "minibatches, PartitionSpec(None, 'data')), rank 0's blocks, %d steps after %d warm-up\n",
      o.steps, o.warmup);
  std::printf("%8s %9s %14s %14s %16s\n", "workers", "prefetch", "steps/s", "samples/s",
              "bytes/step/rank");
  for (int n : o.workers) {
    for (int prefetch : {0, 2}) {
      InputPipelineOptions p;
      p.mesh = *Mesh::Parse(absl::StrCat("data=", n));
      p.num_minibatches = 4;
      p.fields = {{"image", v1::DTYPE_U8, {4, 32, 784}, PartitionSpec::Of({"", "data"})},
                  {"label", v1::DTYPE_U8, {4, 32}, PartitionSpec::Of({"", "data"})}};
      p.order.batch_size = 128;
      p.order.seed = 42;
      p.prefetch = prefetch;
      absl::StatusOr<std::unique_ptr<InputPipeline>> pipeline = InputPipeline::Create(ds, p);
      if (!pipeline.ok()) {
        std::fprintf(stderr, "meshrun bench: %s\n",
                     std::string(pipeline.status().message()).c_str());
        return 1;
      }
      for (int s = 0; s < o.warmup; ++s) (void)(*pipeline)->Next(s);
      const int64_t before = (*pipeline)->bytes_read();
      const absl::Time start = absl::Now();
      for (int s = o.warmup; s < o.warmup + o.steps; ++s) {
        absl::StatusOr<std::vector<Tensor>> b = (*pipeline)->Next(s);
        if (!b.ok()) return 1;
      }
      const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
      std::printf("%8d %9d %14.0f %14.0f %16lld\n", n, prefetch, o.steps / seconds,
                  o.steps * 128.0 / seconds,
                  static_cast<long long>(((*pipeline)->bytes_read() - before) / o.steps));
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace meshrun
