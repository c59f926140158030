// The coordinator's Prometheus metrics (base units, bounded labels).
#ifndef MESHRUN_SERVER_COORDINATOR_METRICS_H_
#define MESHRUN_SERVER_COORDINATOR_METRICS_H_

#include <vector>

#include "absl/time/time.h"
#include "core/sharding/mesh.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace meshrun {

// Thread-safe (prometheus-cpp metrics are atomic). Families:
//   meshrun_registered_workers, meshrun_mesh_devices                          gauges
//   meshrun_mesh_axis_size{axis}                                               gauge (for busbw
//   factors) meshrun_worker_last_heartbeat_timestamp_seconds{rank}                      gauge
//   meshrun_train_steps_total, meshrun_train_samples_total                     counters
//   meshrun_train_loss, meshrun_train_accuracy                                 gauges (last
//   interval) meshrun_step_duration_seconds                                              histogram
//   (per worker-step) meshrun_step_collective_seconds histogram (its all-reduce part)
//   meshrun_jobs_total{state="done"|"failed"}                                  counter
class CoordinatorMetrics {
 public:
  CoordinatorMetrics(prometheus::Registry& registry, const Mesh& mesh);

  void OnRegistered(int registered_workers);
  void OnHeartbeat(int rank, absl::Time when);
  // One report interval: `steps` global steps of `batch` examples; per worker-step durations.
  void OnSteps(int64_t steps, int64_t batch, double loss, double accuracy,
               const std::vector<double>& step_seconds,
               const std::vector<double>& collective_seconds);
  void OnJobEnded(bool ok);

 private:
  prometheus::Gauge& registered_;
  prometheus::Family<prometheus::Gauge>& heartbeat_;
  prometheus::Counter& steps_;
  prometheus::Counter& samples_;
  prometheus::Gauge& loss_;
  prometheus::Gauge& accuracy_;
  prometheus::Histogram& step_seconds_;
  prometheus::Histogram& collective_seconds_;
  prometheus::Family<prometheus::Counter>& jobs_;
};

}  // namespace meshrun

#endif  // MESHRUN_SERVER_COORDINATOR_METRICS_H_
