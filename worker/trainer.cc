#include "worker/trainer.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"
#include "core/program/dp_classifier.h"
#include "worker/kernels/kernel.h"

namespace meshrun {

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(std::unique_ptr<Executor> executor,
                                                         std::shared_ptr<const ImageDataset> train,
                                                         std::shared_ptr<const ImageDataset> test,
                                                         const Options& options) {
  std::unique_ptr<Trainer> t(new Trainer());
  t->executor_ = std::move(executor);
  t->train_ = std::move(train);
  t->test_ = std::move(test);
  t->options_ = options;
  const v1::StepProgram& p = t->executor_->program();
  for (const char* f : {"init", "zero_grads", "microbatch", "apply", "eval"}) {
    bool found = false;
    for (const auto& fn : p.functions()) found |= fn.name() == f;
    if (!found) return absl::InvalidArgumentError(absl::StrCat("step program has no '", f, "' function"));
  }
  // The batch is sharded over the mesh axis 'data': this worker reads block data_index of it.
  const Mesh* mesh = t->executor_->options().mesh;
  if (mesh == nullptr) return absl::InvalidArgumentError("trainer needs a mesh");
  absl::StatusOr<int> axis = mesh->AxisIndex("data");
  if (!axis.ok()) return axis.status();
  t->data_size_ = mesh->axis_size(*axis);
  t->data_index_ = mesh->Coords(t->executor_->options().rank)[*axis];
  const int64_t local_batch = int64_t{p.minibatch_size()} * p.num_minibatches();
  if (local_batch * t->data_size_ != options.global_batch_size) {
    return absl::FailedPreconditionError(absl::StrCat("program processes ", local_batch, " examples x ",
                                                      t->data_size_, " workers per step; global batch is ",
                                                      options.global_batch_size));
  }
  t->steps_per_epoch_ = t->train_->num_examples / options.global_batch_size;
  if (t->steps_per_epoch_ == 0) {
    return absl::FailedPreconditionError(absl::StrCat("global batch ", options.global_batch_size,
                                                      " is larger than the train set (", t->train_->num_examples,
                                                      " examples)"));
  }
  t->base_key_ = MakePRNGKey(options.seed);
  SetComputeThreads(options.compute_threads);
  if (absl::Status s = t->executor_->Run("init", RunContext{}); !s.ok()) return s;
  return t;
}

const std::vector<int32_t>& Trainer::Permutation(int64_t epoch) {
  if (epoch != perm_epoch_) {
    // Fisher-Yates with a fixed engine, so every worker computes the same order for an epoch.
    perm_.resize(train_->num_examples);
    std::iota(perm_.begin(), perm_.end(), 0);
    std::mt19937_64 rng(options_.seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(epoch));
    for (int64_t i = static_cast<int64_t>(perm_.size()) - 1; i > 0; --i) {
      int64_t j = static_cast<int64_t>(rng() % static_cast<uint64_t>(i + 1));
      std::swap(perm_[i], perm_[j]);
    }
    perm_epoch_ = epoch;
  }
  return perm_;
}

absl::Status Trainer::FeedExamples(const ImageDataset& ds, const int32_t* indices, int64_t n,
                                   const v1::Feed& feed, Tensor* out) {
  const int64_t rows = out->dims().empty() ? 1 : out->dims()[0];
  if (n > rows) return absl::InternalError(absl::StrCat("feed of ", n, " rows into buffer of ", rows));
  if (feed.source() == v1::FEED_SOURCE_IMAGES) {
    const int64_t size = ds.image_size;
    if (out->num_elements() != rows * size) {
      return absl::InvalidArgumentError(absl::StrCat("feed buffer '", feed.buffer(), "' has shape ",
                                                     DimsToString(out->dims()), "; expected [", rows, ", ", size, "]"));
    }
    float* dst = out->data<float>();
    for (int64_t r = 0; r < rows; ++r) {
      float* row = dst + r * size;
      if (r >= n) {
        std::fill(row, row + size, 0.0f);
        continue;
      }
      const uint8_t* src = ds.images.data() + int64_t{indices[r]} * size;
      for (int64_t i = 0; i < size; ++i) row[i] = src[i] * (1.0f / 255.0f);
    }
  } else if (feed.source() == v1::FEED_SOURCE_LABELS) {
    int32_t* dst = out->data<int32_t>();
    for (int64_t r = 0; r < rows; ++r) dst[r] = r < n ? ds.labels[indices[r]] : -1;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown feed source ", feed.source()));
  }
  return absl::OkStatus();
}

absl::StatusOr<StepResult> Trainer::RunStep(int64_t step) {
  const v1::StepProgram& p = executor_->program();
  const int64_t epoch = step / steps_per_epoch_;
  const int64_t in_epoch = step % steps_per_epoch_;
  const std::vector<int32_t>& perm = Permutation(epoch);
  const int64_t local = int64_t{p.minibatch_size()} * p.num_minibatches();
  const int32_t* slice = perm.data() + in_epoch * options_.global_batch_size + data_index_ * local;

  SetComputeThreads(options_.compute_threads);
  const absl::Time start = absl::Now();
  const absl::Duration collective_before = executor_->collective_time();
  RunContext ctx;
  ctx.step_key = FoldIn(base_key_, static_cast<uint32_t>(step));
  ctx.step_count = step + 1;
  if (absl::Status s = executor_->Run("zero_grads", ctx); !s.ok()) return s;
  for (int mb = 0; mb < p.num_minibatches(); ++mb) {
    const int32_t* idx = slice + int64_t{mb} * p.minibatch_size();
    ctx.minibatch = mb;
    ctx.feed = [&](const v1::Feed& feed, Tensor* out) {
      return FeedExamples(*train_, idx, p.minibatch_size(), feed, out);
    };
    if (absl::Status s = executor_->Run("microbatch", ctx); !s.ok()) return s;
  }
  if (absl::Status s = executor_->Run("apply", ctx); !s.ok()) return s;
  StepResult r;
  r.step = step;
  r.loss_sum = *executor_->buffer("metrics/loss_sum")->data<float>();
  r.correct = *executor_->buffer("metrics/correct")->data<float>();
  r.count = local;
  r.step_seconds = absl::ToDoubleSeconds(absl::Now() - start);
  r.collective_seconds = absl::ToDoubleSeconds(executor_->collective_time() - collective_before);
  return r;
}

std::vector<std::string> Trainer::StateNames() {
  // The same arrays the coordinator checkpoints.
  std::vector<std::string> names;
  for (const checkpoint::WantedArray& a :
       TrainStateArrays(executor_->program(), *executor_->options().mesh)) {
    names.push_back(a.name);
  }
  return names;
}

std::vector<std::pair<std::string, Tensor>> Trainer::StateSnapshot() {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const std::string& name : StateNames()) {
    if (name == "rng") {
      Tensor key(v1::DTYPE_U32, {2});
      key.data<uint32_t>()[0] = base_key_[0];
      key.data<uint32_t>()[1] = base_key_[1];
      out.emplace_back(name, std::move(key));
    } else {
      out.emplace_back(name, *executor_->buffer(name));  // a deep copy
    }
  }
  return out;
}

absl::Status Trainer::RestoreState(const std::string& name, const Tensor& value) {
  const std::vector<std::string> names = StateNames();
  if (std::find(names.begin(), names.end(), name) == names.end()) {
    return absl::NotFoundError(absl::StrCat("'", name, "' is not part of the job's TrainState"));
  }
  Tensor key(v1::DTYPE_U32, {2});
  // In place: the executor's primitives hold the buffers' addresses.
  Tensor* dst = name == "rng" ? &key : executor_->buffer(name);
  if (value.dtype() != dst->dtype() || value.dims() != dst->dims()) {
    return absl::InvalidArgumentError(absl::StrCat("state '", name, "' is ", DTypeName(dst->dtype()),
                                                   DimsToString(dst->dims()), "; the value is ",
                                                   DTypeName(value.dtype()), DimsToString(value.dims())));
  }
  std::memcpy(dst->raw(), value.raw(), value.size_bytes());
  if (name == "rng") base_key_ = {key.data<uint32_t>()[0], key.data<uint32_t>()[1]};
  return absl::OkStatus();
}

absl::StatusOr<StepResult> Trainer::Evaluate() {
  const int64_t n = test_->num_examples;
  const int64_t begin = n * data_index_ / data_size_;
  const int64_t end = n * (data_index_ + 1) / data_size_;
  const int64_t eb = executor_->program().eval_batch_size();
  std::vector<int32_t> indices(end - begin);
  std::iota(indices.begin(), indices.end(), static_cast<int32_t>(begin));
  SetComputeThreads(options_.compute_threads);
  StepResult total;
  for (int64_t off = 0; off < static_cast<int64_t>(indices.size()); off += eb) {
    const int64_t count = std::min<int64_t>(eb, indices.size() - off);
    RunContext ctx;
    ctx.feed = [&](const v1::Feed& feed, Tensor* out) {
      return FeedExamples(*test_, indices.data() + off, count, feed, out);
    };
    if (absl::Status s = executor_->Run("eval", ctx); !s.ok()) return s;
    total.loss_sum += *executor_->buffer("eval/loss_sum")->data<float>();
    total.correct += *executor_->buffer("eval/correct")->data<float>();
    total.count += count;
  }
  return total;
}

}  // namespace meshrun
