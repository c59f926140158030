#include "server/coordinator_service.h"

#include <thread>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "net/grpc_util.h"
#include "net/tensor_wire.h"

namespace meshrun {

grpc::Status CoordinatorService::Register(grpc::ServerContext* ctx, const v1::RegisterRequest* req,
                                          v1::RegisterResponse* resp) {
  if (req->address().empty())
    return grpc::Status(grpc::INVALID_ARGUMENT, "register: empty worker address");
  const absl::Time deadline =
      std::min(absl::FromChrono(ctx->deadline()), absl::Now() + absl::Seconds(120));
  VLOG(1) << "worker " << req->address() << " (pid " << req->pid() << ") registers";
  absl::StatusOr<v1::RegisterResponse> r =
      registry_->Register(*req, deadline, [ctx] { return ctx->IsCancelled(); });
  if (!r.ok()) return ToGrpcStatus(r.status());
  LOG(INFO) << "worker " << req->address() << " (pid " << req->pid() << ", " << req->hostname()
            << ") is rank " << r->rank();
  if (metrics_ != nullptr) metrics_->OnRegistered(registry_->expected());
  *resp = *std::move(r);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* req,
                                           v1::HeartbeatResponse* resp) {
  absl::StatusOr<bool> restart =
      registry_->Heartbeat(req->rank(), req->cluster_id(), req->generation(), req->incarnation());
  if (!restart.ok()) return ToGrpcStatus(restart.status());
  resp->set_shutdown(registry_->TellShutdown(req->rank()));
  resp->set_restart(*restart);
  if (metrics_ != nullptr && !*restart) metrics_->OnHeartbeat(req->rank(), absl::Now());
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::SubmitJob(grpc::ServerContext* ctx,
                                           const v1::SubmitJobRequest* req,
                                           grpc::ServerWriter<v1::JobEvent>* writer) {
  const std::string session = SessionOf(*ctx);
  int ahead = 0;
  const uint64_t ticket = jobs_.Join(&ahead);
  if (ahead > 0) {
    std::string state, error;
    int64_t step = 0;
    driver_->Status(&state, &step, &error);
    const std::string running =
        absl::StrCat("a job is already running on this cluster (", state, ", at step ", step, ")");
    if (req->job().schedule().when_busy() == "refuse") {
      jobs_.Leave(ticket);
      return grpc::Status(
          grpc::FAILED_PRECONDITION,
          absl::StrCat(running, "; try again when it ends (train.when_busy: refuse)"));
    }
    v1::JobEvent queued;
    queued.set_info(absl::StrCat("queued: ", running,
                                 ahead > 1 ? absl::StrCat(" and ", ahead - 1, " more wait") : "",
                                 "; this job starts when ", ahead > 1 ? "they end" : "it ends"));
    writer->Write(queued);
  }
  // A client that goes away (or whose deadline passes) while waiting gives up its place.
  while (!jobs_.WaitTurn(ticket, absl::Milliseconds(100))) {
    leases_->Touch(session);
    if (ctx->IsCancelled()) {
      jobs_.Leave(ticket);
      return grpc::Status(grpc::CANCELLED, "the client left the job queue");
    }
  }
  // A client that goes away cancels its job at once, not at the job's next report; while its call
  // is open, its session is alive.
  absl::Notification finished;
  std::thread watcher([&] {
    do {
      leases_->Touch(session);
    } while (!finished.WaitForNotificationWithTimeout(absl::Milliseconds(100)) &&
             !ctx->IsCancelled());
    if (!finished.HasBeenNotified()) driver_->Cancel();
  });

  absl::Status s = driver_->Run(req->job(), [&](const v1::JobEvent& e) {
    if (ctx->IsCancelled()) return false;
    return writer->Write(e);
  });
  finished.Notify();
  watcher.join();
  jobs_.Done(ticket);
  return ToGrpcStatus(s);
}

grpc::Status CoordinatorService::GetStatus(grpc::ServerContext*, const v1::GetStatusRequest*,
                                           v1::GetStatusResponse* resp) {
  const Mesh& mesh = registry_->mesh();
  *resp->mutable_mesh() = mesh.ToProto();
  for (const auto& axes : mesh.AxisSubsets()) {
    for (const auto& ranks : mesh.GroupsOver(axes)) {
      v1::CommunicatorGroup* g = resp->add_groups();
      for (int a : axes) g->add_axis_names(mesh.axis_name(a));
      for (int r : ranks) g->add_ranks(r);
    }
  }
  resp->set_expected_workers(registry_->expected());
  for (auto& w : registry_->Snapshot(heartbeat_timeout_)) *resp->add_workers() = std::move(w);
  std::string state, error;
  int64_t step = 0;
  driver_->Status(&state, &step, &error);
  resp->set_job_state(state);
  resp->set_job_step(step);
  resp->set_last_error(error);
  resp->set_metrics_address(metrics_address_);
  return grpc::Status::OK;
}

grpc::ServerUnaryReactor* CoordinatorService::PutArray(grpc::CallbackServerContext* ctx,
                                                       const grpc::ByteBuffer* request,
                                                       grpc::ByteBuffer* response) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  std::string session = SessionOf(*ctx);
  leases_->Touch(session);
  work_threads_.Start([this, reactor, request, response, session = std::move(session)] {
    absl::StatusOr<v1::PutArrayResponse> put = PutArrayBytes(*request, session);
    if (put.ok()) {
      const grpc::Slice bytes(put->SerializeAsString());
      *response = grpc::ByteBuffer(&bytes, 1);
    }
    reactor->Finish(put.ok() ? grpc::Status::OK : ToGrpcStatus(put.status()));
  });
  return reactor;
}

absl::StatusOr<v1::PutArrayResponse> CoordinatorService::PutArrayBytes(
    const grpc::ByteBuffer& request, const std::string& session) {
  v1::PutArrayRequest rest;
  Tensor array;
  if (absl::Status s = ParseWithTensor(request, /*PutArrayRequest.array*/ 1, &rest, &array);
      !s.ok())
    return s;
  absl::StatusOr<v1::ArrayInfo> info =
      arrays_->Put(array, PartitionSpec::FromProto(rest.spec()), rest.id());
  if (!info.ok()) return info.status();
  leases_->Own(session, info->id());
  v1::PutArrayResponse response;
  *response.mutable_info() = *std::move(info);
  return response;
}

grpc::ServerUnaryReactor* CoordinatorService::GetArray(grpc::CallbackServerContext* ctx,
                                                       const grpc::ByteBuffer* request,
                                                       grpc::ByteBuffer* response) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  leases_->Touch(SessionOf(*ctx));
  v1::GetArrayRequest req;
  if (absl::Status s = ParseMessage(*request, &req); !s.ok()) {
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }
  work_threads_.Start([this, reactor, response, id = req.id()] {
    absl::StatusOr<grpc::ByteBuffer> got = arrays_->GetArrayBytes(id);
    if (got.ok()) *response = *std::move(got);
    reactor->Finish(got.ok() ? grpc::Status::OK : ToGrpcStatus(got.status()));
  });
  return reactor;
}

grpc::Status CoordinatorService::DeleteArray(grpc::ServerContext* ctx,
                                             const v1::DeleteArrayRequest* req,
                                             v1::DeleteArrayResponse*) {
  leases_->Touch(SessionOf(*ctx));
  if (req->ids().empty()) {
    return ToGrpcStatus(absl::InvalidArgumentError("DeleteArray: no ids; expected at least one"));
  }
  const std::vector<std::string> ids(req->ids().begin(), req->ids().end());
  absl::Status s = arrays_->Delete(ids);
  for (const std::string& id : ids) leases_->Disown(id);  // a no-op for an unknown id
  return ToGrpcStatus(s);
}

grpc::Status CoordinatorService::ShardMap(grpc::ServerContext* ctx, const v1::ShardMapRequest* req,
                                          v1::ShardMapResponse* resp) {
  const std::string session = SessionOf(*ctx);
  leases_->Touch(session);
  absl::StatusOr<v1::ShardMapResponse> result = arrays_->ShardMap(*req);
  if (!result.ok()) return ToGrpcStatus(result.status());
  for (const v1::ArrayInfo& out : result->outputs()) leases_->Own(session, out.id());
  *resp = *std::move(result);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::Jit(grpc::ServerContext* ctx, const v1::JitRequest* req,
                                     v1::JitResponse* resp) {
  const std::string session = SessionOf(*ctx);
  leases_->Touch(session);
  bool cache_hit = false;
  absl::StatusOr<std::shared_ptr<const Partitioner::Partitioned>> partitioned =
      partitioner_.Partition(req->program(), &cache_hit);
  if (!partitioned.ok()) return ToGrpcStatus(partitioned.status());
  v1::ShardMapRequest call;  // its program is the partitioned one, passed as is below
  *call.mutable_input_ids() = req->input_ids();
  *call.mutable_output_ids() = req->output_ids();
  call.set_collective_timeout_seconds(req->collective_timeout_seconds());
  *call.mutable_donate_argnums() = req->donate_argnums();
  *call.mutable_fetch_outputs() = req->fetch_outputs();
  *call.mutable_more_runs() = req->more_runs();
  *call.mutable_feed() = req->feed();
  absl::StatusOr<v1::ShardMapResponse> result =
      arrays_->ShardMap((*partitioned)->program, (*partitioned)->serialized, call);
  if (!result.ok()) return ToGrpcStatus(result.status());
  for (const v1::ArrayInfo& out : result->outputs()) leases_->Own(session, out.id());
  *resp->mutable_outputs() = std::move(*result->mutable_outputs());
  *resp->mutable_fetched() = std::move(*result->mutable_fetched());
  for (const std::string& c : (*partitioned)->collectives) resp->add_collectives(c);
  resp->set_cache_hit(cache_hit);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::OpenInput(grpc::ServerContext*, const v1::OpenInputRequest* req,
                                           v1::OpenInputResponse* resp) {
  absl::StatusOr<v1::InputInfo> info = arrays_->OpenInput(req->spec(), req->id());
  if (!info.ok()) return ToGrpcStatus(info.status());
  *resp->mutable_info() = *std::move(info);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::CloseInput(grpc::ServerContext*, const v1::CloseInputRequest* req,
                                            v1::CloseInputResponse*) {
  return ToGrpcStatus(arrays_->CloseInput(req->id()));
}

grpc::Status CoordinatorService::SaveCheckpoint(grpc::ServerContext*,
                                                const v1::SaveCheckpointRequest* req,
                                                v1::SaveCheckpointResponse* resp) {
  absl::StatusOr<v1::SaveCheckpointResponse> r = arrays_->SaveCheckpoint(*req);
  if (!r.ok()) return ToGrpcStatus(r.status());
  *resp = *std::move(r);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::RestoreCheckpoint(grpc::ServerContext* ctx,
                                                   const v1::RestoreCheckpointRequest* req,
                                                   v1::RestoreCheckpointResponse* resp) {
  const std::string session = SessionOf(*ctx);
  leases_->Touch(session);
  absl::StatusOr<v1::RestoreCheckpointResponse> r = arrays_->RestoreCheckpoint(*req);
  if (!r.ok()) return ToGrpcStatus(r.status());
  for (const v1::ArrayInfo& out : r->arrays()) leases_->Own(session, out.id());
  *resp = *std::move(r);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::ListArrays(grpc::ServerContext* ctx, const v1::ListArraysRequest*,
                                            v1::ListArraysResponse* resp) {
  leases_->Touch(SessionOf(*ctx));
  for (auto& info : arrays_->List()) {
    info.set_owner(leases_->Owner(info.id()));
    *resp->add_arrays() = std::move(info);
  }
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::KeepAlive(grpc::ServerContext* ctx, const v1::KeepAliveRequest*,
                                           v1::KeepAliveResponse* resp) {
  const std::string session = SessionOf(*ctx);
  leases_->Touch(session);
  resp->set_lease_seconds(absl::ToDoubleSeconds(leases_->lease()));
  resp->set_owned_arrays(leases_->OwnedCount(session));
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::Shutdown(grpc::ServerContext*, const v1::ShutdownRequest*,
                                          v1::ShutdownResponse*) {
  registry_->RequestShutdown();
  if (!shutdown_.HasBeenNotified()) shutdown_.Notify();
  return grpc::Status::OK;
}

}  // namespace meshrun
