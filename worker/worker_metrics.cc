#include "worker/worker_metrics.h"

#include "net/metrics.h"

namespace meshrun {

WorkerMetrics::WorkerMetrics(prometheus::Registry& r, bool shape_labels)
    : kernel_seconds_(prometheus::BuildHistogram()
                          .Name("meshrun_kernel_duration_seconds")
                          .Help("Duration of one step-program op, by kernel.")
                          .Register(r)),
      collective_seconds_(
          prometheus::BuildHistogram()
              .Name("meshrun_collective_duration_seconds")
              .Help("Duration of one collective, waiting for peers included, by op and mesh axis.")
              .Register(r)),
      collective_bytes_(prometheus::BuildCounter()
                            .Name("meshrun_collective_bytes_total")
                            .Help("Bytes fed to collectives, by op and mesh axis.")
                            .Register(r)),
      steps_(prometheus::BuildCounter()
                 .Name("meshrun_worker_steps_total")
                 .Help("Train steps this worker ran.")
                 .Register(r)
                 .Add({})),
      input_bytes_(
          prometheus::BuildCounter()
              .Name("meshrun_worker_input_bytes_total")
              .Help("Dataset bytes this worker read into its blocks of the global batches.")
              .Register(r)
              .Add({})),
      shape_labels_(shape_labels) {}

// Label lookups happen here, once per op of a program; the recorders only observe.
OpObserver::Recorder WorkerMetrics::ForKernel(const std::string& kernel, const std::string& shape) {
  prometheus::Histogram* seconds =
      shape_labels_ && !shape.empty()
          ? &kernel_seconds_.Add({{"kernel", kernel}, {"shape", shape}}, LatencyBuckets())
          : &kernel_seconds_.Add({{"kernel", kernel}}, LatencyBuckets());
  return [seconds](absl::Duration d) { seconds->Observe(absl::ToDoubleSeconds(d)); };
}

OpObserver::Recorder WorkerMetrics::ForCollective(const std::string& op, const std::string& axes,
                                                  int64_t bytes) {
  prometheus::Histogram* seconds =
      &collective_seconds_.Add({{"op", op}, {"axis", axes}}, LatencyBuckets());
  prometheus::Counter* total = &collective_bytes_.Add({{"op", op}, {"axis", axes}});
  return [seconds, total, bytes](absl::Duration d) {
    seconds->Observe(absl::ToDoubleSeconds(d));
    total->Increment(static_cast<double>(bytes));
  };
}

void WorkerMetrics::OnStep() { steps_.Increment(); }

void WorkerMetrics::OnInputBytes(int64_t bytes) {
  input_bytes_.Increment(static_cast<double>(bytes));
}

}  // namespace meshrun
