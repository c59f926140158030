// JobDriver::Runner (server/job_runner.h): one job's preparation, step loop, reports and
// evaluation; its state (init, restore, checkpoints, peers' copies) is job_runner_state.cc.
#include "server/job_runner.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/config/job_config.h"

namespace meshrun {

absl::Status JobDriver::Runner::Prepare() {
  const Mesh& mesh = d_->registry_->mesh();
  for (const std::string& path : {job_.checkpoint().dir(), job_.checkpoint().init_from()}) {
    if (absl::Status s = path.empty() ? absl::OkStatus() : d_->arrays_->CheckCheckpointPath(path);
        !s.ok())
      return s;
  }
  if (job_.mesh().axes_size() > 0) {
    absl::StatusOr<Mesh> want = Mesh::FromProto(job_.mesh());
    if (!want.ok()) return want.status();
    if (*want != mesh) {
      return absl::InvalidArgumentError(absl::StrCat(
          "job mesh ", want->ToString(), " does not match the cluster's ", mesh.ToString()));
    }
  }
  absl::StatusOr<std::shared_ptr<const Partitioner::Partitioned>> p =
      d_->partitioner_.Partition(job_.train_step());
  if (!p.ok()) return p.status();
  step_program_ = *std::move(p);
  const v1::ShardMapProgram& program = step_program_->program;
  const int state = job_.state_size();
  const int batch = program.inputs_size() - state;
  if (batch < 0 || program.outputs_size() != state + 1 + job_.metrics_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the train step takes ", program.inputs_size(), " arguments and returns ",
        program.outputs_size(), " results; the job's TrainState has ", state, " arrays and ",
        job_.metrics_size(), " metrics (expected results: state, loss, metrics)"));
  }
  if (absl::Status s = d_->registry_->WaitUntilReady(absl::Now() + d_->options_.ready_timeout);
      !s.ok())
    return s;
  if (job_.train_input().fields_size() > 0) {
    absl::StatusOr<v1::InputInfo> in =
        d_->arrays_->OpenInput(job_.train_input(), prefix_ + "train");
    if (!in.ok()) return in.status();
    train_input_ = in->id();
    steps_per_epoch_ = in->steps_per_epoch();
  } else if (job_.batch_ids_size() != batch) {
    return absl::InvalidArgumentError(absl::StrCat("the train step takes ", batch,
                                                   " batch arrays; the job names ",
                                                   job_.batch_ids_size(), " and no train input"));
  }
  const v1::TrainSchedule& s = job_.schedule();
  total_ = s.total_steps() > 0
               ? s.total_steps()
               : static_cast<int64_t>(std::floor(s.epochs() * steps_per_epoch_ + 1e-9));
  if (s.total_steps() <= 0 && s.epochs() > 0 && total_ < 1) {
    return absl::InvalidArgumentError(absl::StrCat("the job has no steps to run (total_steps ",
                                                   s.total_steps(), ", epochs ", s.epochs(), ", ",
                                                   steps_per_epoch_, " steps per epoch)"));
  }
  if (!Info(absl::StrCat(
          "plan: ", mesh.ToString(), "; train step partitioned with ",
          step_program_->collectives.size(), " collectives (",
          absl::StrJoin(step_program_->collectives, ", "), "); ", job_.examples_per_step(),
          " examples per step; ", total_, " steps",
          steps_per_epoch_ > 0 ? absl::StrCat(" (", steps_per_epoch_, " per epoch)") : "")))
    return absl::CancelledError("job cancelled: the client went away");
  return absl::OkStatus();
}

absl::Status JobDriver::Runner::RunSteps(int n, std::vector<std::vector<double>>* values,
                                         std::vector<double>* seconds,
                                         std::vector<double>* collective) {
  const v1::ShardMapProgram& program = step_program_->program;
  const int state = job_.state_size();
  v1::ShardMapRequest req;
  *req.mutable_program() = program;
  for (int i = 0; i < program.inputs_size(); ++i) {
    req.add_input_ids(i < state              ? Id(job_.state(i).name())
                      : train_input_.empty() ? job_.batch_ids(i - state)
                                             : "");
    if (i < state) {
      req.add_donate_argnums(i);
      req.add_output_ids(Id(job_.state(i).name()));
    } else if (!train_input_.empty()) {
      req.mutable_feed()->add_argnums(i);
    }
  }
  for (int i = state; i < program.outputs_size(); ++i) {
    req.add_output_ids("");
    req.add_fetch_outputs(i);
  }
  for (int k = 1; k < n; ++k) *req.add_more_runs()->mutable_input_ids() = req.input_ids();
  if (!train_input_.empty()) {
    req.mutable_feed()->set_input_id(train_input_);
    req.mutable_feed()->set_step(step_);
  }
  req.set_collective_timeout_seconds(job_.schedule().collective_timeout_seconds());
  req.set_train_steps(true);
  absl::StatusOr<v1::ShardMapResponse> r = d_->arrays_->ShardMap(req, &d_->cancel_);
  if (!r.ok()) {
    for (int i = 0; i < state; ++i) {  // consumed by the failed call
      live_ids_.erase(std::remove(live_ids_.begin(), live_ids_.end(), Id(job_.state(i).name())),
                      live_ids_.end());
    }
    return absl::Status(r.status().code(), absl::StrCat("steps ", step_ + 1, "..", step_ + n, ": ",
                                                        r.status().message()));
  }
  const int per_run = program.outputs_size() - state;
  for (int k = 0; k < n; ++k) {
    std::vector<double> v;
    for (int j = 0; j < per_run; ++j) {
      const v1::GetArrayResponse& got = r->fetched(k * per_run + j);
      absl::StatusOr<Tensor> t = got.blocks_size() > 0 ? Tensor::FromProto(got.blocks(0))
                                                       : absl::InternalError("no block");
      if (!t.ok() || t->num_elements() != 1 || t->dtype() != v1::DTYPE_F32)
        return absl::InternalError(
            absl::StrCat("step ", step_ + k + 1, ": result ", state + j, " is not an f32 scalar"));
      v.push_back(t->data<float>()[0]);
    }
    // The non-finite guard, before this state can be saved.
    if (job_.schedule().on_nonfinite() == "stop") {
      if (absl::Status s = CheckLossFinite(step_ + k + 1, v[0]); !s.ok()) return s;
    } else if (!std::isfinite(v[0])) {  // skip_step: the step left the state as it was
      Info(absl::StrCat("step ", step_ + k + 1, ": non-finite loss ", v[0],
                        "; its update was skipped (train.on_nonfinite: skip_step)"));
    }
    values->push_back(std::move(v));
    seconds->push_back(k < r->timings_size() ? r->timings(k).seconds() : 0);
    collective->push_back(k < r->timings_size() ? r->timings(k).collective_seconds() : 0);
  }
  step_ += n;
  return absl::OkStatus();
}

void JobDriver::Runner::Report(int64_t steps_done, const std::vector<std::vector<double>>& values,
                               const std::vector<double>& seconds,
                               const std::vector<double>& collective, absl::Duration interval) {
  const int correct_at = CorrectIndex();
  double loss = 0, correct = 0;
  int finite = 0;  // skipped steps' non-finite losses are left out of the mean
  for (const std::vector<double>& v : values) {
    if (std::isfinite(v[0])) {
      loss += v[0];
      ++finite;
    }
    if (correct_at < job_.metrics_size()) correct += v[1 + correct_at];
  }
  if (finite == 0 && !values.empty()) loss = std::numeric_limits<double>::quiet_NaN();
  const double n = std::max<double>(1, values.size());
  const double accuracy = correct / (n * std::max<int64_t>(1, job_.examples_per_step()));
  if (d_->options_.metrics != nullptr) {
    d_->options_.metrics->OnSteps(steps_done, job_.examples_per_step(), loss / std::max(1, finite),
                                  accuracy, seconds, collective);
  }
  double step_seconds = 0, collective_seconds = 0;
  for (double s : seconds) step_seconds += s;
  for (double c : collective) collective_seconds += c;
  v1::JobEvent e;
  v1::StepReport* rep = e.mutable_step();
  rep->set_step(step_);
  rep->set_total_steps(total_);
  rep->set_epoch(steps_per_epoch_ > 0 ? static_cast<double>(step_) / steps_per_epoch_ : 0);
  rep->set_loss(loss / std::max(1, finite));
  if (correct_at < job_.metrics_size()) rep->set_accuracy(accuracy);
  rep->set_samples_per_second(steps_done * job_.examples_per_step() /
                              std::max(1e-9, absl::ToDoubleSeconds(interval)));
  rep->set_eta_seconds(absl::ToDoubleSeconds(absl::Now() - start_) /
                       std::max<int64_t>(1, step_ - first_step_) * (total_ - step_));
  rep->set_step_seconds(step_seconds / n);
  rep->set_collective_seconds(collective_seconds / n);
  for (const std::vector<double>& v : values) rep->add_losses(static_cast<float>(v[0]));
  d_->SetState("running", step_, "");
  if (!emit_(e)) cancelled_ = true;
}

absl::Status JobDriver::Runner::Loop() {
  const v1::CheckpointPolicy& ck = job_.checkpoint();
  const int log_every = std::max(1, job_.schedule().log_every());
  const bool saving = !ck.dir().empty();
  auto is_save_step = [&](int64_t at) {
    return saving && (at == total_ || (ck.save_every() > 0 && at % ck.save_every() == 0));
  };
  const int64_t keep_every = job_.recovery().peer_state_every();
  start_ = absl::Now();
  absl::Time interval_start = start_;
  int64_t interval_first = step_;
  std::vector<std::vector<double>> values;  // per step since the last report: loss, metrics
  std::vector<double> seconds, collective;
  // Nothing to run (0 steps, or resumed at the last one): a fresh state is still saved.
  if (step_ >= total_ && saving && !resumed_) {
    if (absl::Status s = SaveAt(step_); !s.ok()) return s;
  }
  while (step_ < total_) {
    // Up to the next report, the next save or the end.
    int64_t next = std::min<int64_t>(total_, (step_ / log_every + 1) * log_every);
    if (saving && ck.save_every() > 0)
      next = std::min<int64_t>(next, (step_ / ck.save_every() + 1) * ck.save_every());
    if (keep_every > 0) next = std::min<int64_t>(next, (step_ / keep_every + 1) * keep_every);
    if (absl::Status s = RunSteps(static_cast<int>(next - step_), &values, &seconds, &collective);
        !s.ok())
      return s;
    if (keep_every > 0 && step_ % keep_every == 0) {
      absl::StatusOr<int64_t> kept =
          d_->arrays_->KeepPeerState(d_->run_token_, step_, PeerStateArrays());
      if (!kept.ok()) return kept.status();
    }
    if (is_save_step(step_)) {
      if (absl::Status s = SaveAt(step_); !s.ok()) return s;
    }
    if (step_ % log_every != 0 && step_ != total_) continue;
    const absl::Time now = absl::Now();
    Report(step_ - interval_first, values, seconds, collective, now - interval_start);
    if (cancelled_ || d_->cancel_)
      return absl::CancelledError("job cancelled: the client went away");
    values.clear();
    seconds.clear();
    collective.clear();
    interval_start = now;
    interval_first = step_;
  }
  return FinishSave();
}

absl::Status JobDriver::Runner::Evaluate() {
  if (!job_.schedule().evaluate() || job_.eval_input().fields_size() == 0) return absl::OkStatus();
  absl::StatusOr<std::shared_ptr<const Partitioner::Partitioned>> p =
      d_->partitioner_.Partition(job_.eval_step());
  if (!p.ok()) return p.status();
  absl::StatusOr<v1::InputInfo> in = d_->arrays_->OpenInput(job_.eval_input(), prefix_ + "eval");
  if (!in.ok()) return in.status();
  eval_input_ = in->id();
  const v1::ShardMapProgram& program = (*p)->program;
  std::vector<v1::CheckpointArray> params = StateArrays("", "params/");
  v1::ShardMapRequest req;
  *req.mutable_program() = program;
  for (int i = 0; i < program.inputs_size(); ++i) {
    const bool param = i < static_cast<int>(params.size());
    req.add_input_ids(param ? params[i].id() : "");
    if (!param) req.mutable_feed()->add_argnums(i);
  }
  for (int i = 0; i < program.outputs_size(); ++i) {
    req.add_output_ids("");
    req.add_fetch_outputs(i);
  }
  for (int64_t k = 1; k < in->num_steps(); ++k)
    *req.add_more_runs()->mutable_input_ids() = req.input_ids();
  req.mutable_feed()->set_input_id(eval_input_);
  req.mutable_feed()->set_step(0);
  req.set_collective_timeout_seconds(job_.schedule().collective_timeout_seconds());
  absl::StatusOr<v1::ShardMapResponse> r = d_->arrays_->ShardMap(req, &d_->cancel_);
  if (!r.ok())
    return absl::Status(r.status().code(), absl::StrCat("evaluation: ", r.status().message()));
  const int correct_at = CorrectIndex();
  double loss = 0, correct = 0;
  for (int64_t k = 0; k < in->num_steps(); ++k) {
    for (int j = 0; j < program.outputs_size(); ++j) {
      const v1::GetArrayResponse& got = r->fetched(k * program.outputs_size() + j);
      absl::StatusOr<Tensor> t = Tensor::FromProto(got.blocks(0));
      if (!t.ok()) return t.status();
      if (j == 0) loss += t->data<float>()[0];
      if (j == 1 + correct_at) correct += t->data<float>()[0];
    }
  }
  const int64_t examples = in->num_steps() * job_.eval_input().global_batch_size();
  v1::JobEvent e;
  e.mutable_eval()->set_loss(loss / std::max<int64_t>(1, in->num_steps()));
  if (correct_at < job_.metrics_size())
    e.mutable_eval()->set_accuracy(correct / std::max<int64_t>(1, examples));
  e.mutable_eval()->set_num_examples(examples);
  emit_(e);
  return absl::OkStatus();
}

void JobDriver::Runner::Release() {
  if (save_thread_.joinable()) save_thread_.join();
  if (abandoned_) return;
  // One call for every array: a snapshot never taken is unknown, which frees the rest anyway.
  std::vector<std::string> ids = live_ids_;
  for (const v1::StateArraySpec& a : job_.state()) ids.push_back(Id("snapshot/" + a.name()));
  if (!ids.empty()) d_->arrays_->Delete(ids).IgnoreError();
  for (const std::string& id : {train_input_, eval_input_}) {
    if (!id.empty()) d_->arrays_->CloseInput(id).IgnoreError();
  }
}

}  // namespace meshrun
