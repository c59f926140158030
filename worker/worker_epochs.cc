// WorkerService's collective epochs (core/collectives/transport.h): entering the epoch of each
// request that runs collectives, aborting one, and leaving a failed run's epoch aborted.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "worker/worker_service.h"

namespace meshrun {

absl::Status WorkerService::EnterEpoch(uint64_t epoch) {
  absl::MutexLock lock(&epoch_mu_);
  const uint64_t current = transport_->epoch();
  if (epoch == 0 || epoch == current) return absl::OkStatus();
  if (epoch < current) {
    return absl::FailedPreconditionError(absl::StrCat("request of collective epoch ", epoch,
                                                      "; this worker is already in epoch ", current,
                                                      " (a later run has started): refused"));
  }
  transport_->Reset(epoch);
  if (epoch <= aborted_epoch_) transport_->Abort(abort_reason_);
  return absl::OkStatus();
}

void WorkerService::EndEarlierEpochs(uint64_t epoch) {
  absl::MutexLock lock(&epoch_mu_);
  const uint64_t current = transport_->epoch();
  if (epoch <= current) return;
  transport_->Abort(absl::AbortedError(
      absl::StrCat("collective epoch ", current,
                   " was given up by the coordinator: a run of epoch ", epoch, " has arrived")));
}

void WorkerService::AbortEpoch(const absl::Status& cause) {
  absl::MutexLock lock(&epoch_mu_);
  transport_->Abort(absl::AbortedError(absl::StrCat(
      "an earlier run of collective epoch ", transport_->epoch(), " failed on this rank (",
      cause.message(), "); waiting for the coordinator to start a new epoch")));
}

grpc::Status WorkerService::Abort(grpc::ServerContext*, const v1::AbortRequest* req,
                                  v1::AbortResponse*) {
  {
    absl::MutexLock lock(&join_mu_);
    if (!joined_) return grpc::Status::OK;
  }
  absl::MutexLock lock(&epoch_mu_);
  const uint64_t current = transport_->epoch();
  if (req->epoch() != 0 && req->epoch() < current) {
    LOG(INFO) << "ignoring an abort of collective epoch " << req->epoch() << " (this worker is in "
              << current << "): " << req->reason();
    return grpc::Status::OK;
  }
  LOG(WARNING) << "aborting collective epoch " << std::max(req->epoch(), current) << ": "
               << req->reason();
  aborted_epoch_ = std::max(aborted_epoch_, std::max(req->epoch(), current));
  abort_reason_ = absl::AbortedError(req->reason());
  // An abort of a later epoch than this worker's also fails what it runs now: it belongs to a run
  // the coordinator has given up.
  transport_->Abort(abort_reason_);
  return grpc::Status::OK;
}

void WorkerService::AbortRuns(const std::string& reason) {
  v1::AbortRequest req;  // epoch 0: this worker's current one
  req.set_reason(reason);
  v1::AbortResponse resp;
  Abort(nullptr, &req, &resp);
}

}  // namespace meshrun
