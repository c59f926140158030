// JobDriver's run of one job (server/job_driver.h): its arrays, inputs and programs, the step
// loop with its reports, checkpoints and peers' state copies, and evaluation. Internal to the
// job driver (job_driver.cc, job_runner.cc, job_runner_state.cc, job_recovery.cc).
#ifndef MESHRUN_SERVER_JOB_RUNNER_H_
#define MESHRUN_SERVER_JOB_RUNNER_H_

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "server/job_driver.h"

namespace meshrun {

// One job's run: its arrays, inputs and programs, released by the destructor.
class JobDriver::Runner {
 public:
  Runner(JobDriver* driver, const v1::JobSpec& job, const EventSink& emit, std::string prefix)
      : d_(driver), job_(job), emit_(emit), prefix_(std::move(prefix)) {}
  ~Runner() { Release(); }

  absl::Status Prepare();
  // `recovering`: after a lost worker, the peers' in-memory copy (recovery.peer_state_every) is
  // restored when it is at least as new as the newest checkpoint.
  absl::Status InitState(bool recovering);
  absl::Status Loop();
  absl::Status Evaluate();
  int64_t step() const { return step_; }
  // The checkpoint InitState restored ("" when it initialised the state or took the peers').
  const std::string& restored_from() const { return restored_from_; }
  // Where InitState's state came from: "peers", "checkpoint" or "init".
  const std::string& source() const { return source_; }
  bool cancelled() const { return cancelled_; }
  // Forgets the job's arrays and inputs instead of deleting them: the workers that held them are
  // restarting (the cluster re-forms), and a hung one would hold up every delete to its deadline.
  void Abandon() {
    if (save_thread_.joinable()) save_thread_.join();
    live_ids_.clear();
    train_input_.clear();
    eval_input_.clear();
    abandoned_ = true;
  }

 private:
  bool Info(const std::string& text) {
    v1::JobEvent e;
    e.set_info(text);
    return emit_(e);
  }
  std::string Id(const std::string& name) const { return absl::StrCat(prefix_, "state/", name); }
  // The position of the "correct" metric among the step's metrics (metrics_size() if none): the
  // accuracy is computed from it.
  int CorrectIndex() const {
    return static_cast<int>(std::find(job_.metrics().begin(), job_.metrics().end(), "correct") -
                            job_.metrics().begin());
  }
  // The state arrays as CheckpointArrays read from the ids Id(id_prefix + name).
  std::vector<v1::CheckpointArray> StateArrays(const std::string& id_prefix,
                                               const std::string& only = "") const;
  // Steps [step_, step_ + n) in one call; appends each step's loss and metrics.
  absl::Status RunSteps(int n, std::vector<std::vector<double>>* values,
                        std::vector<double>* seconds, std::vector<double>* collective);
  // The arrays of `wanted` saved at `path` (a checkpoint directory or a safetensors file) have
  // the job's shapes and dtypes. Errors: InvalidArgument naming the file, the array and both.
  absl::Status CheckSaved(const std::string& path,
                          const std::vector<v1::CheckpointArray>& wanted) const;
  absl::Status SaveAt(int64_t at);  // sync or async per the policy
  // After a lost worker: the state from the peers' in-memory copies when one of every rank at
  // least as new as `newest_checkpoint` survived. Returns whether it restored; errors of a
  // restore that started (nothing stays registered then).
  absl::StatusOr<bool> RestoreFromPeers(int64_t newest_checkpoint);
  // The state arrays as the workers keep and restore them.
  std::vector<CheckpointArray> PeerStateArrays() const;
  absl::Status FinishSave();
  void Report(int64_t steps_done, const std::vector<std::vector<double>>& values,
              const std::vector<double>& seconds, const std::vector<double>& collective,
              absl::Duration interval);
  void Release();

  JobDriver* d_;
  const v1::JobSpec& job_;
  const EventSink& emit_;
  const std::string prefix_;
  std::shared_ptr<const Partitioner::Partitioned> step_program_;
  std::string train_input_, eval_input_;
  std::vector<std::string> live_ids_;  // state arrays to delete at the end
  int64_t step_ = 0, first_step_ = 0, total_ = 0;
  bool resumed_ = false;  // the state came from a checkpoint of this job
  double steps_per_epoch_ = 0;
  absl::Time start_;
  std::thread save_thread_;
  absl::StatusOr<v1::SaveCheckpointResponse> save_result_;
  absl::Duration save_time_;
  bool cancelled_ = false;  // the sink stopped listening
  bool abandoned_ = false;
  std::string restored_from_;
  std::string source_ = "init";
};

}  // namespace meshrun

#endif  // MESHRUN_SERVER_JOB_RUNNER_H_
