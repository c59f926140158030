// The Coordinator gRPC service: a thin adapter from protos to WorkerRegistry and JobDriver.
#ifndef MESHRUN_SERVER_COORDINATOR_SERVICE_H_
#define MESHRUN_SERVER_COORDINATOR_SERVICE_H_

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "core/port/work_threads.h"
#include "meshrun/v1/coordinator.grpc.pb.h"
#include "server/array_registry.h"
#include "server/client_leases.h"
#include "server/coordinator_metrics.h"
#include "server/job_driver.h"
#include "server/job_queue.h"
#include "server/partitioner.h"
#include "server/worker_registry.h"

namespace meshrun {

// Thread-safe. One job runs at a time; a second SubmitJob fails with FailedPrecondition. Every
// call carrying a client session keeps it alive; arrays a call creates belong to its session.
// PutArray and GetArray are served raw on gRPC's callback API, so that an array's bytes are read
// into it with one copy and the blocks the workers send go on to the client with none; the other
// RPCs are synchronous.
class CoordinatorService final
    : public v1::Coordinator::WithRawCallbackMethod_PutArray<
          v1::Coordinator::WithRawCallbackMethod_GetArray<v1::Coordinator::Service>> {
 public:
  // `metrics` may be null.
  // `leases` records which client session owns which array (server/client_leases.h).
  CoordinatorService(WorkerRegistry* registry, JobDriver* driver, ArrayRegistry* arrays,
                     ClientLeases* leases, absl::Duration heartbeat_timeout,
                     CoordinatorMetrics* metrics = nullptr, std::string metrics_address = "")
      : registry_(registry),
        driver_(driver),
        arrays_(arrays),
        leases_(leases),
        heartbeat_timeout_(heartbeat_timeout),
        metrics_(metrics),
        metrics_address_(std::move(metrics_address)),
        partitioner_([registry] { return registry->mesh(); }) {}

  grpc::Status Register(grpc::ServerContext*, const v1::RegisterRequest*,
                        v1::RegisterResponse*) override;
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest*,
                         v1::HeartbeatResponse*) override;
  grpc::Status SubmitJob(grpc::ServerContext*, const v1::SubmitJobRequest*,
                         grpc::ServerWriter<v1::JobEvent>*) override;
  grpc::Status GetStatus(grpc::ServerContext*, const v1::GetStatusRequest*,
                         v1::GetStatusResponse*) override;
  // Answers with PutArrayBytes, from a thread of its own (its calls to the workers block).
  grpc::ServerUnaryReactor* PutArray(grpc::CallbackServerContext* ctx,
                                     const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  // Puts the array of `request`, a v1::PutArrayRequest's wire bytes, on the workers
  // (ArrayRegistry::Put), its data copied once from the request's slices (ParseWithTensor), and
  // gives it to `session`. Errors: InvalidArgument for bytes that are not such a request or a
  // bad Tensor; those of ArrayRegistry::Put.
  absl::StatusOr<v1::PutArrayResponse> PutArrayBytes(const grpc::ByteBuffer& request,
                                                     const std::string& session);
  // Parses the request as a v1::GetArrayRequest and answers with ArrayRegistry::GetArrayBytes,
  // from a thread of its own (its calls to the workers block; gRPC's callback threads must not).
  grpc::ServerUnaryReactor* GetArray(grpc::CallbackServerContext* ctx,
                                     const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  grpc::Status DeleteArray(grpc::ServerContext*, const v1::DeleteArrayRequest*,
                           v1::DeleteArrayResponse*) override;
  grpc::Status ShardMap(grpc::ServerContext*, const v1::ShardMapRequest*,
                        v1::ShardMapResponse*) override;
  // Partitions the global program on the cluster's mesh (server/partitioner.h), then runs it as
  // ShardMap does.
  grpc::Status OpenInput(grpc::ServerContext*, const v1::OpenInputRequest*,
                         v1::OpenInputResponse*) override;
  grpc::Status CloseInput(grpc::ServerContext*, const v1::CloseInputRequest*,
                          v1::CloseInputResponse*) override;
  grpc::Status Jit(grpc::ServerContext*, const v1::JitRequest*, v1::JitResponse*) override;
  grpc::Status SaveCheckpoint(grpc::ServerContext*, const v1::SaveCheckpointRequest*,
                              v1::SaveCheckpointResponse*) override;
  grpc::Status RestoreCheckpoint(grpc::ServerContext*, const v1::RestoreCheckpointRequest*,
                                 v1::RestoreCheckpointResponse*) override;
  grpc::Status ListArrays(grpc::ServerContext*, const v1::ListArraysRequest*,
                          v1::ListArraysResponse*) override;
  grpc::Status Shutdown(grpc::ServerContext*, const v1::ShutdownRequest*,
                        v1::ShutdownResponse*) override;
  grpc::Status KeepAlive(grpc::ServerContext*, const v1::KeepAliveRequest*,
                         v1::KeepAliveResponse*) override;

  // Notified when a client asked for Shutdown.
  absl::Notification& shutdown() { return shutdown_; }

 private:
  WorkerRegistry* registry_;
  JobDriver* driver_;
  ArrayRegistry* arrays_;
  ClientLeases* leases_;
  const absl::Duration heartbeat_timeout_;
  CoordinatorMetrics* metrics_;
  const std::string metrics_address_;
  JobQueue jobs_;  // SubmitJob's, one job at a time
  absl::Notification shutdown_;
  Partitioner partitioner_;
  // PutArray's and GetArray's work (declared last: joined before anything it uses is destroyed).
  WorkThreads work_threads_;
};

}  // namespace meshrun

#endif  // MESHRUN_SERVER_COORDINATOR_SERVICE_H_
