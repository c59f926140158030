// A worker's sharded input pipeline, as jax.make_array_from_process_local_data and Grain's
// per-host sharding feed a jitted step: for every step each worker materialises only its own
// block of the global batch, laid out by the batch input's PartitionSpec (workers that are
// replicas along a non-batch axis read the same rows), and no batch byte passes through the client
// or the coordinator.
//
// The order is defined on the global example stream (GlobalOrder), so the global batch of step k
// is the same whatever the mesh: 1, 2, 4 or 8 workers see the same examples at step k, each its
// block of them, and a job resumed at step k continues the order exactly.
#ifndef MESHRUN_CORE_DATA_INPUT_PIPELINE_H_
#define MESHRUN_CORE_DATA_INPUT_PIPELINE_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "core/data/dataset.h"
#include "core/sharding/mesh.h"
#include "core/sharding/partition_spec.h"
#include "core/tensor.h"
#include "meshrun/v1/input.pb.h"

namespace meshrun {

// Which example is row r of the global batch of step k. Epoch e's order is a Fisher-Yates
// shuffle of 0..N-1 by std::mt19937_64 seeded with seed * 0x9E3779B97F4A7C15 + e (identity
// without shuffle), computed alike on every worker.
//  - repeat (training): epochs follow each other. With drop_remainder each epoch gives
//    floor(N / B) batches and its last N mod B examples are skipped (tf.data's
//    batch(drop_remainder=True) per epoch); without it the batches are consecutive B-slices of
//    the concatenated epochs, so a batch may span two epochs (tf.data's repeat().batch()).
//  - one pass (evaluation): ceil(N / B) steps (floor with drop_remainder); rows past the last
//    example are padding (ExampleAt returns -1), which the pipeline fills with zeros and marks
//    invalid in the ":valid" field.
// Thread-compatible (the permutation cache is not locked).
class GlobalOrder {
 public:
  struct Options {
    int64_t num_examples = 0;
    int64_t batch_size = 0;
    uint64_t seed = 0;
    bool shuffle = true;
    bool drop_remainder = true;
    bool repeat = true;
  };
  // Errors: InvalidArgument naming the value for a batch size < 1, no examples, or (with
  // drop_remainder) a batch larger than the dataset.
  static absl::StatusOr<GlobalOrder> Create(const Options& options);

  // Steps in one pass over the data (repeat: one epoch; 0 means one batch spans epochs).
  double steps_per_epoch() const;
  // Steps there are: -1 with repeat (unbounded).
  int64_t num_steps() const;
  // REQUIRES: 0 <= row < batch_size, step < num_steps() when bounded.
  int64_t ExampleAt(int64_t step, int64_t row);
  const Options& options() const { return options_; }

 private:
  explicit GlobalOrder(const Options& options) : options_(options) {}
  const std::vector<int32_t>& Permutation(int64_t epoch);
  Options options_;
  std::map<int64_t, std::vector<int32_t>> perms_;  // the two most recent epochs
};

// One batch input fed from a dataset field.
struct InputField {
  std::string field;  // the dataset's field; ":valid" is f32 1 for a real row, 0 for padding
  DType dtype = v1::DTYPE_UNSPECIFIED;  // must be the field's dtype (no conversion here)
  // The global array of one step: [B, ...] or, with num_minibatches k > 1, [k, B / k, ...] (the
  // global batch reshaped as the seeds' accumulate_gradients does: row g is minibatch g / (B/k),
  // row g mod (B/k)). The trailing dims are the field's example dims or their flattening to one
  // dim ([28, 28] may be fed as [784]).
  Dims global_shape;
  PartitionSpec spec;  // over the mesh; any dim may be sharded
};

struct InputPipelineOptions {
  Mesh mesh;
  int rank = 0;  // whose blocks to materialise
  std::vector<InputField> fields;
  int num_minibatches = 1;
  GlobalOrder::Options order;  // num_examples is taken from the dataset
  int prefetch = 2;            // batches prepared ahead on the background thread; 0: none
};

// Thread-safe. The background thread prepares the next batches while the caller's step runs.
class InputPipeline {
 public:
  // Checks every field against the dataset and the layout before anything is read.
  // Errors: InvalidArgument naming the field and value: an unknown field, a dtype or example
  // shape that is not the field's, a global batch dim that is not order.batch_size, a spec
  // that does not fit the shape or mesh (e.g. a batch not divisible by the batch axes); those of
  // GlobalOrder::Create.
  static absl::StatusOr<std::unique_ptr<InputPipeline>> Create(
      std::shared_ptr<const Dataset> dataset, InputPipelineOptions options);
  ~InputPipeline();

  // This rank's block of every field for global step `step` (0-based), in fields' order. The
  // steps are expected in increasing order (the next ones are prefetched); any other step is
  // built on the spot. Errors: OutOfRange past the last step of a one-pass order.
  absl::StatusOr<std::vector<Tensor>> Next(int64_t step);

  // Bytes copied out of the dataset into the blocks Next has handed out (what the worker's
  // meshrun_worker_input_bytes_total counts): exactly those blocks' bytes, not the global
  // batch's, and not those of batches prefetched but not yet taken.
  int64_t bytes_read() const { return bytes_read_.load(std::memory_order_relaxed); }
  // Local block dims of every field.
  const std::vector<Dims>& block_dims() const { return block_dims_; }
  // Bytes of one step's blocks of every field (the prefetched batches hold this many each).
  int64_t step_bytes() const;
  int64_t num_steps() const { return num_steps_; }
  double steps_per_epoch() const { return steps_per_epoch_; }
  int64_t num_examples() const { return dataset_->num_examples(); }

 private:
  InputPipeline() = default;
  struct Batch {
    absl::StatusOr<std::vector<Tensor>> blocks;
    int64_t bytes = 0;  // read from the dataset
  };
  Batch Build(int64_t step);
  absl::StatusOr<std::vector<Tensor>> HandOut(Batch batch);
  void Prefetch();

  std::shared_ptr<const Dataset> dataset_;
  InputPipelineOptions options_;
  std::vector<int> field_index_;  // dataset field per input (-1: ":valid")
  std::vector<Dims> block_dims_;
  std::vector<std::vector<int64_t>> block_offsets_;
  int64_t num_steps_ = -1;
  double steps_per_epoch_ = 0;
  std::atomic<int64_t> bytes_read_{0};

  std::mutex order_mu_;  // GlobalOrder's permutation cache
  std::unique_ptr<GlobalOrder> order_;

  std::mutex mu_;
  std::condition_variable cv_;
  int64_t next_to_build_ = 0;  // the prefetch thread's next step
  int64_t building_ = -1;      // the step it is building now
  std::map<int64_t, Batch> ready_;
  uint64_t generation_ = 0;  // bumped when the caller jumps; discards a stale build
  bool stop_ = false;
  std::thread thread_;
};

// The pipeline options of `spec` (input.proto) for `rank` of `mesh` (InputPipeline::Create checks
// them). Errors: InvalidArgument for a spec with no fields.
absl::StatusOr<InputPipelineOptions> InputOptionsFromProto(const v1::InputSpec& spec,
                                                           const Mesh& mesh, int rank);

}  // namespace meshrun

#endif  // MESHRUN_CORE_DATA_INPUT_PIPELINE_H_
