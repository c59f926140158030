// The per-worker train loop of a data-parallel job: which examples this worker reads at each
// step, the minibatch loop (gradient accumulation), the optimizer step and evaluation.
#ifndef MESHRUN_WORKER_TRAINER_H_
#define MESHRUN_WORKER_TRAINER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "core/data/idx_dataset.h"
#include "worker/executor.h"

namespace meshrun {

struct StepResult {
  int64_t step = 0;
  double loss_sum = 0;  // sum of per-example losses over this worker's examples
  double correct = 0;
  int64_t count = 0;    // examples this worker processed
  double step_seconds = 0;
  double collective_seconds = 0;
};

// Thread-compatible (one call at a time). Datasets are shared read-only and may be shared by
// several trainers (threads as ranks in tests).
class Trainer {
 public:
  struct Options {
    uint64_t seed = 42;
    int global_batch_size = 128;
    int compute_threads = 0;  // 0: leave oneDNN's default
  };
  // REQUIRES: executor's program has functions init, zero_grads, microbatch, apply, eval.
  // Runs "init". Errors: FailedPrecondition if the program does not fit the data (batch sizes),
  // errors of init.
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(std::unique_ptr<Executor> executor,
                                                         std::shared_ptr<const ImageDataset> train,
                                                         std::shared_ptr<const ImageDataset> test,
                                                         const Options& options);

  // Runs global step `step` (0-based): this worker's slice of the global batch, num_minibatches
  // forward/backward passes, the gradient all-reduce and the optimizer update.
  absl::StatusOr<StepResult> RunStep(int64_t step);
  // Forward pass over this worker's shard of the test set.
  absl::StatusOr<StepResult> Evaluate();

  // The TrainState, as a checkpoint holds it: copies of every PARAM and OPT_STATE buffer under
  // its name (this worker's block; the main job's are whole, replicated arrays) and "rng", the
  // job's base PRNGKey (u32[2]). The step is not part of it: the caller knows it.
  std::vector<std::pair<std::string, Tensor>> StateSnapshot();
  // Replaces the state named `name` (a StateSnapshot name) with `value`. Errors: NotFound for a
  // name that is not state; InvalidArgument when value's dtype or shape differ from the buffer's.
  absl::Status RestoreState(const std::string& name, const Tensor& value);
  // The StateSnapshot names.
  std::vector<std::string> StateNames();

  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  Executor& executor() { return *executor_; }
  // Position of this worker along the 'data' axis, and that axis' size.
  int data_index() const { return data_index_; }
  int data_size() const { return data_size_; }

 private:
  Trainer() = default;
  const std::vector<int32_t>& Permutation(int64_t epoch);
  absl::Status FeedExamples(const ImageDataset& ds, const int32_t* indices, int64_t n, const v1::Feed& feed,
                            Tensor* out);

  std::unique_ptr<Executor> executor_;
  std::shared_ptr<const ImageDataset> train_, test_;
  Options options_;
  int data_index_ = 0, data_size_ = 1;
  int64_t steps_per_epoch_ = 0;
  int64_t perm_epoch_ = -1;
  std::vector<int32_t> perm_;
  PRNGKey base_key_{0, 0};
};

}  // namespace meshrun

#endif  // MESHRUN_WORKER_TRAINER_H_
