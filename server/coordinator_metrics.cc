#include "server/coordinator_metrics.h"

#include "absl/strings/str_cat.h"
#include "net/metrics.h"

namespace meshrun {

CoordinatorMetrics::CoordinatorMetrics(prometheus::Registry& r, const Mesh& mesh)
    : registered_(prometheus::BuildGauge()
                      .Name("meshrun_registered_workers")
                      .Help("Workers registered with the coordinator.")
                      .Register(r)
                      .Add({})),
      heartbeat_(prometheus::BuildGauge()
                     .Name("meshrun_worker_last_heartbeat_timestamp_seconds")
                     .Help("Unix time of each worker's last heartbeat.")
                     .Register(r)),
      steps_(prometheus::BuildCounter()
                 .Name("meshrun_train_steps_total")
                 .Help("Global train steps run.")
                 .Register(r)
                 .Add({})),
      samples_(prometheus::BuildCounter()
                   .Name("meshrun_train_samples_total")
                   .Help("Training examples processed, over all workers.")
                   .Register(r)
                   .Add({})),
      loss_(prometheus::BuildGauge()
                .Name("meshrun_train_loss")
                .Help("Mean train loss over the last report interval.")
                .Register(r)
                .Add({})),
      accuracy_(prometheus::BuildGauge()
                    .Name("meshrun_train_accuracy")
                    .Help("Train accuracy over the last report interval (0..1).")
                    .Register(r)
                    .Add({})),
      step_seconds_(prometheus::BuildHistogram()
                        .Name("meshrun_step_duration_seconds")
                        .Help("Wall time of one train step on one worker.")
                        .Register(r)
                        .Add({}, LatencyBuckets())),
      collective_seconds_(prometheus::BuildHistogram()
                              .Name("meshrun_step_collective_seconds")
                              .Help("Time of one train step spent in collectives on one worker.")
                              .Register(r)
                              .Add({}, LatencyBuckets())),
      jobs_(prometheus::BuildCounter()
                .Name("meshrun_jobs_total")
                .Help("Train jobs ended, by state.")
                .Register(r)),
      workers_lost_(prometheus::BuildCounter()
                        .Name("meshrun_workers_lost_total")
                        .Help("Workers a job lost (and recovered from, with a recovery policy).")
                        .Register(r)),
      recovery_seconds_(prometheus::BuildHistogram()
                            .Name("meshrun_recovery_seconds")
                            .Help("From a job's failure on a lost worker to its restored state.")
                            .Register(r)
                            .Add({}, prometheus::Histogram::BucketBoundaries{0.5, 1, 2, 3, 5, 10,
                                                                             20, 30, 60, 120})),
      skew_seconds_(
          prometheus::BuildHistogram()
              .Name("meshrun_collective_arrival_skew_seconds")
              .Help("Per collective and group: the last rank's arrival minus the first's.")
              .Register(r)),
      late_rank_(prometheus::BuildGauge()
                     .Name("meshrun_collective_last_late_rank")
                     .Help("The rank that arrived last at the latest collective over the axis.")
                     .Register(r)),
      devices_(prometheus::BuildGauge()
                   .Name("meshrun_mesh_devices")
                   .Help("Devices (workers) in the coordinator's mesh.")
                   .Register(r)
                   .Add({})),
      axis_size_(prometheus::BuildGauge()
                     .Name("meshrun_mesh_axis_size")
                     .Help("Size of each mesh axis: the group size of a collective over it.")
                     .Register(r)) {
  OnMeshChanged(mesh);
  jobs_.Add({{"state", "done"}});
  jobs_.Add({{"state", "failed"}});
  for (const char* cause : {"killed", "out of memory", "hung", "unreachable"})
    workers_lost_.Add({{"cause", cause}});
}

void CoordinatorMetrics::OnWorkerLost(const std::string& cause) {
  workers_lost_.Add({{"cause", cause}}).Increment();
}

void CoordinatorMetrics::OnMeshChanged(const Mesh& mesh) {
  devices_.Set(mesh.size());
  for (int a = 0; a < mesh.num_axes(); ++a)
    axis_size_.Add({{"axis", mesh.axis_name(a)}}).Set(mesh.axis_size(a));
}

void CoordinatorMetrics::OnRecovered(double seconds) { recovery_seconds_.Observe(seconds); }

void CoordinatorMetrics::OnCollectiveSkew(const std::string& op, const std::string& axes,
                                          double seconds, int late_rank) {
  skew_seconds_.Add({{"op", op}, {"axis", axes}}, LatencyBuckets()).Observe(seconds);
  late_rank_.Add({{"axis", axes}}).Set(late_rank);
}

void CoordinatorMetrics::OnRegistered(int registered_workers) {
  registered_.Set(registered_workers);
}

void CoordinatorMetrics::OnHeartbeat(int rank, absl::Time when) {
  heartbeat_.Add({{"rank", absl::StrCat(rank)}})
      .Set(absl::ToDoubleSeconds(when - absl::UnixEpoch()));
}

void CoordinatorMetrics::OnSteps(int64_t steps, int64_t batch, double loss, double accuracy,
                                 const std::vector<double>& step_seconds,
                                 const std::vector<double>& collective_seconds) {
  steps_.Increment(static_cast<double>(steps));
  samples_.Increment(static_cast<double>(steps * batch));
  loss_.Set(loss);
  accuracy_.Set(accuracy);
  for (double s : step_seconds) step_seconds_.Observe(s);
  for (double s : collective_seconds) collective_seconds_.Observe(s);
}

void CoordinatorMetrics::OnJobEnded(bool ok) {
  jobs_.Add({{"state", ok ? "done" : "failed"}}).Increment();
}

}  // namespace meshrun
