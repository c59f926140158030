// The coordinator's Prometheus metrics (base units, bounded labels).
#ifndef MESHRUN_SERVER_COORDINATOR_METRICS_H_
#define MESHRUN_SERVER_COORDINATOR_METRICS_H_

#include <string>
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
//   meshrun_workers_lost_total{cause="killed"|"out of memory"|"hung"|"unreachable"} counter
//   meshrun_recovery_seconds (failure to restored state, per recovery)         histogram
//   meshrun_collective_arrival_skew_seconds{op, axis}: per collective and group, the last
//   rank's arrival minus the first's (the straggler ledger)                    histogram
//   meshrun_collective_last_late_rank{axis}: the rank that arrived last at the latest
//   collective over the axis                                                   gauge
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
  void OnWorkerLost(const std::string& cause);
  void OnRecovered(double seconds);
  // The mesh shrank (recovery.min_workers): the device and axis-size gauges follow it.
  void OnMeshChanged(const Mesh& mesh);
  void OnCollectiveSkew(const std::string& op, const std::string& axes, double seconds,
                        int late_rank);

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
  prometheus::Family<prometheus::Counter>& workers_lost_;
  prometheus::Histogram& recovery_seconds_;
  prometheus::Family<prometheus::Histogram>& skew_seconds_;
  prometheus::Family<prometheus::Gauge>& late_rank_;
  prometheus::Gauge& devices_;
  prometheus::Family<prometheus::Gauge>& axis_size_;
};

}  // namespace meshrun

#endif  // MESHRUN_SERVER_COORDINATOR_METRICS_H_
