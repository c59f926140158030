#include "meshrun/client.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <random>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "meshrun/job.h"
#include "meshrun/workloads.h"
#include "net/credentials.h"
#include "net/grpc_util.h"

namespace meshrun {

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& address,
                                                        absl::Duration timeout) {
  // A numeric port past 65535 can never answer: say so rather than "no coordinator answers".
  const std::string port = address.substr(address.rfind(':') + 1);
  int64_t p = 0;
  if (address.find(':') != std::string::npos && absl::SimpleAtoi(port, &p) && (p < 1 || p > 65535))
    return absl::InvalidArgumentError(absl::StrCat("coordinator address '", address, "': port ",
                                                   port, " is out of range; expected 1..65535"));
  auto channel = CreateChannel(address);
  if (!channel->WaitForConnected(absl::ToChronoTime(absl::Now() + timeout))) {
    const Credentials& creds = ProcessCredentials();
    return absl::UnavailableError(absl::StrCat(
        "no coordinator answers at ", address, " (waited ", absl::FormatDuration(timeout), "; ",
        creds.insecure
            ? absl::StrCat("connecting without TLS: a cluster with TLS on needs its credentials, ",
                           kTlsDirEnv, "=DIR")
            : absl::StrCat("TLS with the credentials in ", creds.dir,
                           ": a cluster with other credentials, or without TLS, refuses them"),
        ")"));
  }
  return std::unique_ptr<Client>(new Client(address, std::move(channel)));
}

namespace {
std::string NewSessionId() {
  std::random_device rd;
  return absl::StrFormat("%08x%08x%08x%08x", rd(), rd(), rd(), rd());
}
}  // namespace

Client::Client(std::string address, std::shared_ptr<grpc::Channel> channel)
    : address_(std::move(address)),
      channel_(std::move(channel)),
      stub_(v1::Coordinator::NewStub(channel_)),
      session_(NewSessionId()) {
  keepalive_ = std::thread([this] { KeepAliveLoop(); });
}

Client::~Client() {
  {
    absl::MutexLock lock(&mu_);
    closing_ = true;
  }
  keepalive_.join();
}

void Client::Prepare(grpc::ClientContext& ctx, absl::Duration timeout) const {
  SetTimeout(ctx, timeout);
  ctx.AddMetadata(kSessionMetadataKey, session_);
}

void Client::KeepAliveLoop() {
  absl::Duration every = absl::ZeroDuration();  // the first at once: it tells the lease
  absl::MutexLock lock(&mu_);
  while (!mu_.AwaitWithTimeout(absl::Condition(&closing_), every)) {
    every = absl::Seconds(5);  // until the coordinator says its lease
    mu_.Unlock();
    grpc::ClientContext ctx;
    Prepare(ctx, absl::Seconds(5));
    v1::KeepAliveResponse resp;
    const grpc::Status s = stub_->KeepAlive(&ctx, v1::KeepAliveRequest(), &resp);
    mu_.Lock();
    if (s.ok() && resp.lease_seconds() > 0)
      every = std::max(absl::Milliseconds(100), absl::Seconds(resp.lease_seconds()) / 3);
  }
}

absl::StatusOr<v1::GetStatusResponse> Client::GetStatus(absl::Duration timeout) {
  grpc::ClientContext ctx;
  Prepare(ctx, timeout);
  v1::GetStatusResponse resp;
  grpc::Status s = stub_->GetStatus(&ctx, v1::GetStatusRequest(), &resp);
  if (!s.ok()) return FromGrpcStatus(s, absl::StrCat("coordinator at ", address_));
  return resp;
}

absl::Status Client::WaitForWorkers(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  int registered = 0, expected = 0;
  while (absl::Now() < deadline) {
    absl::StatusOr<v1::GetStatusResponse> st = GetStatus();
    if (st.ok()) {
      expected = st->expected_workers();
      registered = 0;
      for (const auto& w : st->workers()) registered += w.alive();
      if (registered == expected && expected > 0) return absl::OkStatus();
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  return absl::DeadlineExceededError(absl::StrCat("only ", registered, " of ", expected,
                                                  " workers joined ", address_, " within ",
                                                  absl::FormatDuration(timeout)));
}

absl::StatusOr<TrainResult> Client::Train(const JobConfig& config,
                                          const std::function<void(const v1::JobEvent&)>& on_event,
                                          absl::Duration timeout) {
  absl::StatusOr<v1::GetStatusResponse> status = GetStatus();
  if (!status.ok()) return status.status();
  absl::StatusOr<Mesh> mesh = Mesh::FromProto(status->mesh());
  if (!mesh.ok()) return mesh.status();
  if (!config.mesh.empty()) {
    absl::StatusOr<Mesh> want = Mesh::Create(config.mesh);
    if (!want.ok()) return want.status();
    if (*want != *mesh) {
      return absl::InvalidArgumentError(absl::StrCat(
          "job mesh ", want->ToString(), " does not match the cluster's ", mesh->ToString()));
    }
  }
  absl::StatusOr<PlannedJob> job = PlanJob(config, *mesh);
  if (!job.ok()) return job.status();
  return Train(*std::move(job), on_event, timeout);
}

absl::StatusOr<TrainResult> Client::Train(PlannedJob job,
                                          const std::function<void(const v1::JobEvent&)>& on_event,
                                          absl::Duration timeout) {
  // A seed workload's own batch goes onto the cluster once, for every step.
  absl::Status put_batch;
  if (job.own_batch.has_value()) {
    absl::StatusOr<std::vector<Tensor>> batch = SeedWorkloadBatch(*job.own_batch);
    put_batch = batch.status();
    static std::atomic<int> next_batch{0};
    const std::string prefix = absl::StrCat("job-batch/", getpid(), "-", next_batch++, "/");
    for (size_t i = 0; put_batch.ok() && i < batch->size(); ++i) {
      absl::StatusOr<v1::ArrayInfo> put =
          Put((*batch)[i], job.step.batch[i].spec, prefix + job.step.batch[i].name);
      put_batch = put.status();
      if (put.ok()) job.spec.add_batch_ids(put->id());
    }
  }
  absl::StatusOr<TrainResult> result =
      put_batch.ok() ? Train(job.spec, on_event, timeout) : put_batch;
  for (const std::string& id : job.spec.batch_ids()) Delete(id).IgnoreError();
  return result;
}

absl::StatusOr<TrainResult> Client::Train(const v1::JobSpec& job,
                                          const std::function<void(const v1::JobEvent&)>& on_event,
                                          absl::Duration timeout) {
  grpc::ClientContext ctx;
  Prepare(ctx, timeout);
  v1::SubmitJobRequest req;
  *req.mutable_job() = job;
  auto reader = stub_->SubmitJob(&ctx, req);
  TrainResult result;
  v1::JobEvent e;
  while (reader->Read(&e)) {
    if (e.has_step()) result.reports.push_back(e.step());
    if (e.has_worker_lost()) result.lost.push_back(e.worker_lost());
    if (e.has_recovered()) result.recoveries.push_back(e.recovered());
    if (e.has_eval()) {
      result.evaluated = true;
      result.test_loss = e.eval().loss();
      result.test_accuracy = e.eval().accuracy();
      result.test_examples = e.eval().num_examples();
    }
    if (on_event) on_event(e);
  }
  grpc::Status s = reader->Finish();
  if (s.error_code() == grpc::UNAVAILABLE) {
    // The coordinator went away mid-job (killed or restarted): say where the job was.
    const std::string when =
        result.reports.empty()
            ? std::string("before the first step")
            : absl::StrCat("during step ", result.reports.back().step() + 1, " (step ",
                           result.reports.back().step(), " was the last reported)");
    return FromGrpcStatus(s,
                          absl::StrCat("coordinator ", address_, " closed the connection ", when));
  }
  if (!s.ok()) return FromGrpcStatus(s);
  return result;
}

absl::StatusOr<v1::SaveCheckpointResponse> Client::SaveCheckpoint(
    const v1::SaveCheckpointRequest& request, absl::Duration timeout) {
  grpc::ClientContext ctx;
  Prepare(ctx, timeout);
  v1::SaveCheckpointResponse resp;
  if (grpc::Status s = stub_->SaveCheckpoint(&ctx, request, &resp); !s.ok())
    return FromGrpcStatus(s);
  return resp;
}

absl::StatusOr<v1::RestoreCheckpointResponse> Client::RestoreCheckpoint(
    const v1::RestoreCheckpointRequest& request, absl::Duration timeout) {
  grpc::ClientContext ctx;
  Prepare(ctx, timeout);
  v1::RestoreCheckpointResponse resp;
  if (grpc::Status s = stub_->RestoreCheckpoint(&ctx, request, &resp); !s.ok())
    return FromGrpcStatus(s);
  return resp;
}

absl::Status Client::Shutdown() {
  grpc::ClientContext ctx;
  Prepare(ctx, absl::Seconds(5));
  v1::ShutdownResponse resp;
  return FromGrpcStatus(stub_->Shutdown(&ctx, v1::ShutdownRequest(), &resp),
                        absl::StrCat("coordinator at ", address_));
}

std::string FormatRecoveryEvent(const v1::JobEvent& e) {
  if (e.has_worker_lost()) {
    const v1::WorkerLost& w = e.worker_lost();
    return absl::StrCat("worker rank ", w.rank(), " (", w.address(), ", pid ", w.pid(), " on ",
                        w.host(), ") lost after step ", w.step(), ": ", w.cause(), "; ", w.error());
  }
  if (e.has_recovered()) {
    const v1::Recovered& r = e.recovered();
    return absl::StrFormat(
        "recovered at step %d from %s in %.2f s (re-forming the cluster %.2f s), restart %d",
        r.step(),
        r.source() == "peers"    ? std::string("the peers' memory")
        : r.checkpoint().empty() ? std::string("the initial state")
                                 : r.checkpoint(),
        r.seconds(), r.reform_seconds(), r.restarts());
  }
  return "";
}

std::string FormatProgress(const v1::StepReport& r) {
  const int64_t eta = static_cast<int64_t>(r.eta_seconds());
  const std::string acc = r.has_accuracy() ? absl::StrFormat(" | acc %.3f", r.accuracy()) : "";
  return absl::StrFormat("step %d/%d | epoch %.2f | %.0f samples/s | loss %.4f%s | ETA %d:%02d",
                         r.step(), r.total_steps(), r.epoch(), r.samples_per_second(), r.loss(),
                         acc, eta / 60, eta % 60);
}

}  // namespace meshrun
