#include "server/job_driver.h"

#include <cstdio>
#include <fstream>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/checkpoint/checkpoint.h"
#include "glog/logging.h"
#include "nlohmann/json.hpp"
#include "server/job_runner.h"

namespace meshrun {

void JobDriver::SetState(const std::string& state, int64_t step, const std::string& error) {
  absl::MutexLock lock(&mu_);
  state_ = state;
  step_ = step;
  error_ = error;
  WriteStateFileLocked();
}

void JobDriver::NoteCheckpoint(const std::string& path) {
  absl::MutexLock lock(&mu_);
  last_checkpoint_ = path;
  WriteStateFileLocked();
}

void JobDriver::WriteStateFileLocked() {
  if (options_.state_file.empty()) return;
  const nlohmann::json j = {{"job", job_name_},
                            {"state", state_},
                            {"step", step_},
                            {"error", error_},
                            {"checkpoint_dir", checkpoint_dir_},
                            {"last_checkpoint", last_checkpoint_}};
  const std::string tmp = options_.state_file + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << j.dump() << "\n";
    if (!out) {
      LOG(WARNING) << "cannot write the job state file " << tmp;
      return;
    }
  }
  std::rename(tmp.c_str(), options_.state_file.c_str());
}

void JobDriver::LoadStateFile() {
  if (options_.state_file.empty()) return;
  std::ifstream in(options_.state_file);
  if (!in) return;
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || j.value("state", "") != "running") return;
  absl::MutexLock lock(&mu_);
  job_name_ = j.value("job", "");
  checkpoint_dir_ = j.value("checkpoint_dir", "");
  last_checkpoint_ = j.value("last_checkpoint", "");
  step_ = j.value("step", int64_t{0});
  state_ = "interrupted";
  error_ = absl::StrCat(
      "the coordinator restarted while job '", job_name_, "' ran (last reported step ", step_,
      "); ",
      last_checkpoint_.empty()
          ? std::string("it had committed no checkpoint")
          : absl::StrCat("its last checkpoint is ", last_checkpoint_,
                         ": resume it with meshrun train --resume (checkpoint.resume) and ",
                         "checkpoint.dir ", checkpoint_dir_));
  LOG(WARNING) << error_;
  WriteStateFileLocked();
}

void JobDriver::Status(std::string* state, int64_t* step, std::string* error) {
  absl::MutexLock lock(&mu_);
  *state = state_;
  *step = step_;
  *error = error_;
}

void JobDriver::Cancel() { cancel_ = true; }

absl::Status JobDriver::Run(const v1::JobSpec& job, const EventSink& emit) {
  {
    absl::MutexLock lock(&mu_);
    job_name_ = job.name();
    checkpoint_dir_ = job.checkpoint().dir();
    last_checkpoint_.clear();
  }
  SetState("running", 0, "");
  cancel_ = false;
  run_token_ = absl::StrFormat("%s#%016x", job.name(),
                               std::random_device{}() * 4294967296ull ^ std::random_device{}());
  v1::JobSpec attempt = job;
  absl::Status s;
  int64_t step = 0;
  int restarts = 0;
  absl::Time failed_at;
  absl::Duration reform_time;
  while (true) {
    const uint64_t generation = registry_->generation();
    auto run =
        std::make_unique<Runner>(this, attempt, emit, absl::StrCat("job-", ++jobs_started_, "/"));
    s = run->Prepare();
    if (s.ok()) s = run->InitState(restarts > 0);
    if (s.ok() && restarts > 0) {
      v1::JobEvent e;
      v1::Recovered* r = e.mutable_recovered();
      r->set_step(run->step());
      r->set_checkpoint(run->restored_from());
      r->set_source(run->source());
      r->set_seconds(absl::ToDoubleSeconds(absl::Now() - failed_at));
      r->set_reform_seconds(absl::ToDoubleSeconds(reform_time));
      r->set_restarts(restarts);
      *r->mutable_mesh() = registry_->mesh().ToProto();
      LOG(INFO) << "job recovered: " << r->ShortDebugString();
      if (options_.metrics != nullptr) options_.metrics->OnRecovered(r->seconds());
      if (!emit(e)) s = absl::CancelledError("job cancelled: the client went away");
    }
    if (s.ok()) s = run->Loop();
    if (s.ok()) s = run->Evaluate();
    step = run->step();
    if (s.ok() || restarts >= job.recovery().max_restarts() || run->cancelled() ||
        absl::IsCancelled(s))
      break;
    failed_at = absl::Now();
    std::vector<v1::WorkerLost> lost = FindLostWorkers(s, step, generation);
    if (lost.empty()) break;  // not a lost worker: the job's own error
    run->Abandon();           // its arrays went with the old workers
    run.reset();
    ++restarts;
    absl::Status reformed = Reform(job, lost, s, generation, emit);
    reform_time = absl::Now() - failed_at;
    if (!reformed.ok()) {
      s = reformed;
      break;
    }
    if (!attempt.checkpoint().dir().empty()) attempt.mutable_checkpoint()->set_resume(true);
    if (attempt.mesh().axes_size() > 0) *attempt.mutable_mesh() = registry_->mesh().ToProto();
  }
  // The copies in the workers' memory go with the job (after a failure, unless a worker is
  // missing: the call would wait for it).
  if (job.recovery().peer_state_every() > 0 &&
      (s.ok() || registry_->RegisteredCount() == registry_->expected()))
    arrays_->DropPeerState(run_token_);
  if (!s.ok()) {
    SetState("failed", step, std::string(s.message()));
    if (options_.metrics != nullptr) options_.metrics->OnJobEnded(false);
    LOG(ERROR) << "job failed: " << s;
    return s;
  }
  SetState("done", step, "");
  if (options_.metrics != nullptr) options_.metrics->OnJobEnded(true);
  return absl::OkStatus();
}

}  // namespace meshrun
