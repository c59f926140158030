#include "worker/worker_metrics.h"

#include "net/metrics.h"

namespace meshrun {

WorkerMetrics::WorkerMetrics(prometheus::Registry& r)
    : kernel_seconds_(prometheus::BuildHistogram()
                          .Name("meshrun_kernel_duration_seconds")
                          .Help("Duration of one step-program op, by kernel.")
                          .Register(r)),
      collective_seconds_(prometheus::BuildHistogram()
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
                 .Add({})) {}

void WorkerMetrics::OnKernel(const std::string& kernel, absl::Duration duration) {
  kernel_seconds_.Add({{"kernel", kernel}}, LatencyBuckets()).Observe(absl::ToDoubleSeconds(duration));
}

void WorkerMetrics::OnCollective(const std::string& op, const std::string& axes, int64_t bytes,
                                 absl::Duration duration) {
  collective_seconds_.Add({{"op", op}, {"axis", axes}}, LatencyBuckets()).Observe(absl::ToDoubleSeconds(duration));
  collective_bytes_.Add({{"op", op}, {"axis", axes}}).Increment(static_cast<double>(bytes));
}

void WorkerMetrics::OnStep() { steps_.Increment(); }

}  // namespace meshrun
