// A train job from a job config (core/config/job_config.h): the model's train step derived and
// traced here (client/include/meshrun/train_step.h), sent as a typed JobSpec (coordinator.proto)
// for the coordinator to partition and loop (server/job_driver.h). The config is validated once,
// here, with ParseJobConfig's errors; the coordinator checks what depends on the cluster.
#ifndef MESHRUN_CLIENT_INCLUDE_MESHRUN_JOB_H_
#define MESHRUN_CLIENT_INCLUDE_MESHRUN_JOB_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/config/job_config.h"
#include "core/sharding/mesh.h"
#include "meshrun/train_step.h"
#include "meshrun/v1/coordinator.pb.h"
#include "meshrun/workloads.h"

namespace meshrun {

struct PlannedJob {
  TrainStep step;
  v1::JobSpec spec;
  // data.dataset "synthetic": the step runs on this workload's own batch (SeedWorkloadBatch), made
  // and put on the cluster (under spec.batch_ids) when the job is submitted, not when it is
  // planned (planning reads no data).
  std::optional<Workload> own_batch;
};

// The job of `config` on `mesh`. Errors: InvalidArgument naming the config key (a layout or rule
// that does not fit the mesh, a batch the batch axes do not divide, an unknown layout), those of
// BuildTrainStep and of loading a seed workload's batch.
absl::StatusOr<PlannedJob> PlanJob(const JobConfig& config, const Mesh& mesh);

// The sharding of a layout name, or of logical axis rules with FSDP over `fsdp_axis`.
absl::StatusOr<nn::ShardingConfig> WorkloadSharding(const std::string& layout,
                                                    const std::string& rules,
                                                    const std::string& fsdp_axis,
                                                    int64_t min_weight_size);

}  // namespace meshrun

#endif  // MESHRUN_CLIENT_INCLUDE_MESHRUN_JOB_H_
