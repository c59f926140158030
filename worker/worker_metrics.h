// The worker's Prometheus metrics, fed by its executors.
#ifndef MESHRUN_WORKER_WORKER_METRICS_H_
#define MESHRUN_WORKER_WORKER_METRICS_H_

#include "prometheus/counter.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "worker/executor.h"

namespace meshrun {

// Thread-safe. Families:
//   meshrun_kernel_duration_seconds{kernel}              histogram (with `shape_labels`, a
//                                                        matmul's also by shape: {kernel, shape},
//                                                        MatmulShapeLabel; one series per GEMM
//                                                        signature of the programs run, for
//                                                        `meshrun bench kernels`)
//   meshrun_collective_duration_seconds{op, axis}        histogram (waiting for peers included)
//   meshrun_collective_bytes_total{op, axis}             counter (input bytes)
//   meshrun_worker_steps_total                           counter
//   meshrun_worker_input_bytes_total                     counter (dataset bytes read into this
//                                                        worker's batch blocks)
class WorkerMetrics : public OpObserver {
 public:
  explicit WorkerMetrics(prometheus::Registry& registry, bool shape_labels = false);

  Recorder ForKernel(const std::string& kernel, const std::string& shape) override;
  Recorder ForCollective(const std::string& op, const std::string& axes, int64_t bytes) override;
  void OnStep();
  void OnInputBytes(int64_t bytes);

 private:
  prometheus::Family<prometheus::Histogram>& kernel_seconds_;
  prometheus::Family<prometheus::Histogram>& collective_seconds_;
  prometheus::Family<prometheus::Counter>& collective_bytes_;
  prometheus::Counter& steps_;
  prometheus::Counter& input_bytes_;
  const bool shape_labels_;
};

}  // namespace meshrun

#endif  // MESHRUN_WORKER_WORKER_METRICS_H_
