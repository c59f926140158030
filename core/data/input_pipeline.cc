#include "core/data/input_pipeline.h"

#include <cstring>
#include <limits>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"
#include "core/sharding/named_sharding.h"

namespace meshrun {
namespace {

constexpr char kValidField[] = ":valid";

// Strides (in elements) of a row-major array of `dims`.
std::vector<int64_t> RowMajorStrides(const Dims& dims) {
  std::vector<int64_t> s(dims.size(), 1);
  for (int d = static_cast<int>(dims.size()) - 2; d >= 0; --d) s[d] = s[d + 1] * dims[d + 1];
  return s;
}

}  // namespace

absl::StatusOr<GlobalOrder> GlobalOrder::Create(const Options& options) {
  if (options.batch_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("global batch size ", options.batch_size, ": expected >= 1"));
  }
  if (options.num_examples < 1) {
    return absl::InvalidArgumentError("the dataset has no examples");
  }
  if (options.num_examples > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("the dataset has ", options.num_examples,
                                                   " examples; at most 2^31 - 1 are supported"));
  }
  if (options.drop_remainder && options.batch_size > options.num_examples) {
    return absl::InvalidArgumentError(absl::StrCat(
        "global batch size ", options.batch_size, " is larger than the dataset (",
        options.num_examples, " examples) and drop_remainder is set: no batch would be left"));
  }
  return GlobalOrder(options);
}

double GlobalOrder::steps_per_epoch() const {
  const Options& o = options_;
  if (o.drop_remainder) return static_cast<double>(o.num_examples / o.batch_size);
  if (!o.repeat) return static_cast<double>((o.num_examples + o.batch_size - 1) / o.batch_size);
  return static_cast<double>(o.num_examples) / static_cast<double>(o.batch_size);
}

int64_t GlobalOrder::num_steps() const {
  if (options_.repeat) return -1;
  return static_cast<int64_t>(steps_per_epoch());
}

const std::vector<int32_t>& GlobalOrder::Permutation(int64_t epoch) {
  auto it = perms_.find(epoch);
  if (it != perms_.end()) return it->second;
  while (perms_.size() >= 2) perms_.erase(perms_.begin());
  std::vector<int32_t>& perm = perms_[epoch];
  perm.resize(static_cast<size_t>(options_.num_examples));
  std::iota(perm.begin(), perm.end(), 0);
  if (options_.shuffle) {
    std::mt19937_64 rng(options_.seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(epoch));
    for (int64_t i = static_cast<int64_t>(perm.size()) - 1; i > 0; --i) {
      const int64_t j = static_cast<int64_t>(rng() % static_cast<uint64_t>(i + 1));
      std::swap(perm[i], perm[j]);
    }
  }
  return perm;
}

int64_t GlobalOrder::ExampleAt(int64_t step, int64_t row) {
  const Options& o = options_;
  int64_t epoch = 0, position = 0;
  if (o.drop_remainder) {
    const int64_t per_epoch = o.num_examples / o.batch_size;
    epoch = step / per_epoch;
    position = (step % per_epoch) * o.batch_size + row;
  } else {
    const int64_t p = step * o.batch_size + row;
    epoch = p / o.num_examples;
    position = p % o.num_examples;
    if (!o.repeat && epoch > 0) return -1;  // padding of the last batch
  }
  return Permutation(epoch)[position];
}

absl::StatusOr<std::unique_ptr<InputPipeline>> InputPipeline::Create(
    std::shared_ptr<const Dataset> dataset, InputPipelineOptions options) {
  auto p = std::unique_ptr<InputPipeline>(new InputPipeline);
  options.order.num_examples = dataset->num_examples();
  absl::StatusOr<GlobalOrder> order = GlobalOrder::Create(options.order);
  if (!order.ok()) return order.status();
  const int64_t batch = options.order.batch_size;
  const int k = options.num_minibatches;
  if (k < 1 || batch % k != 0) {
    return absl::InvalidArgumentError(absl::StrCat("num_minibatches ", k,
                                                   ": expected >= 1 and dividing the global "
                                                   "batch size ",
                                                   batch));
  }
  const int batch_rank = k > 1 ? 2 : 1;
  for (const InputField& f : options.fields) {
    const std::string what = absl::StrCat("batch input fed from field '", f.field, "'");
    if (absl::StatusOr<int64_t> bytes = CheckedByteSize(f.dtype, f.global_shape); !bytes.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": ", bytes.status().message()));
    }
    int index = -1;
    DatasetField want{kValidField, v1::DTYPE_F32, {}};
    if (f.field != kValidField) {
      absl::StatusOr<int> i = dataset->FieldIndex(f.field);
      if (!i.ok())
        return absl::InvalidArgumentError(absl::StrCat(what, ": ", i.status().message()));
      index = *i;
      want = dataset->fields()[index];
    }
    if (f.dtype != want.dtype) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": the program takes ",
                                                     DTypeName(f.dtype), " but the dataset holds ",
                                                     DTypeName(want.dtype)));
    }
    const Dims& g = f.global_shape;
    const Dims batch_dims = k > 1 ? Dims{k, batch / k} : Dims{batch};
    const bool batch_ok = static_cast<int>(g.size()) >= batch_rank &&
                          Dims(g.begin(), g.begin() + batch_rank) == batch_dims;
    const Dims example(g.begin() + std::min<size_t>(g.size(), batch_rank), g.end());
    const bool example_ok = example == want.example_dims ||
                            (example.size() == 1 && example[0] == NumElements(want.example_dims));
    if (batch_ok && !example_ok) {  // the data's examples, not the batch, differ
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": the dataset's examples have shape ", DimsToString(want.example_dims),
          " but the program takes ", DimsToString(example), " per example (its input is ",
          DimsToString(g), ", a global batch of ", batch,
          "); the field's examples must have the model's input shape, or its flattening"));
    }
    if (!batch_ok || !example_ok) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": the program's input has shape ", DimsToString(g), "; expected ",
          DimsToString(batch_dims), " (global batch ", batch,
          k > 1 ? absl::StrCat(" in ", k, " minibatches") : "", ") followed by the field's ",
          "example shape ", DimsToString(want.example_dims), " or its flattening"));
    }
    NamedSharding sharding(options.mesh, f.spec);
    if (absl::Status s = sharding.Validate(g); !s.ok())
      return absl::InvalidArgumentError(absl::StrCat(what, ": ", s.message()));
    p->field_index_.push_back(index);
    p->block_dims_.push_back(sharding.ShardDims(g));
    p->block_offsets_.push_back(sharding.ShardOffsets(g, options.rank));
  }
  p->order_ = std::make_unique<GlobalOrder>(*std::move(order));
  p->num_steps_ = p->order_->num_steps();
  p->steps_per_epoch_ = p->order_->steps_per_epoch();
  p->dataset_ = std::move(dataset);
  p->options_ = std::move(options);
  if (p->options_.prefetch > 0) p->thread_ = std::thread([q = p.get()] { q->Prefetch(); });
  return p;
}

int64_t InputPipeline::step_bytes() const {
  int64_t total = 0;
  for (size_t f = 0; f < block_dims_.size(); ++f)
    total +=
        NumElements(block_dims_[f]) * static_cast<int64_t>(DTypeSize(options_.fields[f].dtype));
  return total;
}

InputPipeline::~InputPipeline() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

InputPipeline::Batch InputPipeline::Build(int64_t step) {
  const int k = options_.num_minibatches;
  const int64_t minibatch = options_.order.batch_size / k;
  const int batch_rank = k > 1 ? 2 : 1;
  std::vector<Tensor> out;
  int64_t read = 0;
  for (size_t f = 0; f < options_.fields.size(); ++f) {
    const InputField& in = options_.fields[f];
    const Dims& local = block_dims_[f];
    const std::vector<int64_t>& off = block_offsets_[f];
    // The rows of the global batch in this block, and their examples.
    std::vector<int64_t> rows;
    const int64_t m_begin = k > 1 ? off[0] : 0, m_end = k > 1 ? off[0] + local[0] : 1;
    for (int64_t m = m_begin; m < m_end; ++m) {
      for (int64_t i = 0; i < local[batch_rank - 1]; ++i)
        rows.push_back(m * minibatch + off[batch_rank - 1] + i);
    }
    std::vector<int64_t> examples(rows.size());
    {
      std::lock_guard<std::mutex> l(order_mu_);
      for (size_t r = 0; r < rows.size(); ++r) examples[r] = order_->ExampleAt(step, rows[r]);
    }
    Tensor t = Tensor::Uninitialized(in.dtype, local);
    auto* dst = static_cast<char*>(t.raw());
    const size_t esize = DTypeSize(in.dtype);
    if (field_index_[f] < 0) {  // ":valid"
      for (size_t r = 0; r < rows.size(); ++r)
        reinterpret_cast<float*>(dst)[r] = examples[r] >= 0 ? 1.0f : 0.0f;
      out.push_back(std::move(t));
      continue;
    }
    const Dims global_ex(in.global_shape.begin() + batch_rank, in.global_shape.end());
    const Dims local_ex(local.begin() + batch_rank, local.end());
    const std::vector<int64_t> off_ex(off.begin() + batch_rank, off.end());
    const int64_t row_elems = NumElements(local_ex);
    const bool whole = local_ex == global_ex;
    const std::vector<int64_t> strides = RowMajorStrides(global_ex);
    const int64_t run = local_ex.empty() ? 1 : local_ex.back();
    for (size_t r = 0; r < rows.size(); ++r, dst += row_elems * esize) {
      if (examples[r] < 0) {
        std::memset(dst, 0, static_cast<size_t>(row_elems) * esize);
        continue;
      }
      if (whole) {
        dataset_->CopyElements(field_index_[f], examples[r], 0, row_elems, dst);
        continue;
      }
      // A block of the example's dims: one contiguous run of the last dim per index of the others.
      std::vector<int64_t> idx(local_ex.size(), 0);
      for (int64_t done = 0; done < row_elems; done += run) {
        int64_t begin = 0;
        for (size_t d = 0; d < idx.size(); ++d) begin += (off_ex[d] + idx[d]) * strides[d];
        dataset_->CopyElements(field_index_[f], examples[r], begin, run,
                               dst + static_cast<size_t>(done) * esize);
        for (int d = static_cast<int>(idx.size()) - 2; d >= 0; --d) {
          if (++idx[d] < local_ex[d]) break;
          idx[d] = 0;
        }
      }
    }
    for (int64_t e : examples) read += e >= 0 ? row_elems * static_cast<int64_t>(esize) : 0;
    out.push_back(std::move(t));
  }
  return Batch{std::move(out), read};
}

absl::StatusOr<std::vector<Tensor>> InputPipeline::HandOut(Batch batch) {
  bytes_read_.fetch_add(batch.bytes, std::memory_order_relaxed);
  return std::move(batch.blocks);
}

void InputPipeline::Prefetch() {
  std::unique_lock<std::mutex> l(mu_);
  while (true) {
    cv_.wait(l, [&] {
      return stop_ || (static_cast<int>(ready_.size()) < options_.prefetch &&
                       (num_steps_ < 0 || next_to_build_ < num_steps_));
    });
    if (stop_) return;
    const int64_t step = next_to_build_++;
    const uint64_t generation = generation_;
    building_ = step;
    l.unlock();
    Batch batch = Build(step);
    l.lock();
    building_ = -1;
    if (generation == generation_) ready_.emplace(step, std::move(batch));
    cv_.notify_all();
  }
}

absl::StatusOr<std::vector<Tensor>> InputPipeline::Next(int64_t step) {
  if (step < 0 || (num_steps_ >= 0 && step >= num_steps_)) {
    return absl::OutOfRangeError(absl::StrCat("input step ", step, " is past the last (",
                                              num_steps_, " steps in one pass)"));
  }
  if (options_.prefetch <= 0) return HandOut(Build(step));
  std::unique_lock<std::mutex> l(mu_);
  while (true) {
    auto it = ready_.find(step);
    if (it != ready_.end()) {
      Batch batch = std::move(it->second);
      ready_.erase(ready_.begin(), std::next(it));
      cv_.notify_all();
      return HandOut(std::move(batch));
    }
    if (building_ == step) {
      cv_.wait(l);
      continue;
    }
    // Not the step the thread is heading for (a resume, a jump back): build it here and
    // prefetch from the one after.
    ++generation_;
    ready_.clear();
    next_to_build_ = step + 1;
    cv_.notify_all();
    l.unlock();
    return HandOut(Build(step));
  }
}

absl::StatusOr<InputPipelineOptions> InputOptionsFromProto(const v1::InputSpec& spec,
                                                           const Mesh& mesh, int rank) {
  if (spec.fields().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("input spec for ", spec.format(), " dataset ", spec.path(), " has no fields"));
  }
  InputPipelineOptions o;
  o.mesh = mesh;
  o.rank = rank;
  o.num_minibatches = std::max(1, spec.num_minibatches());
  for (const v1::InputFieldSpec& f : spec.fields()) {
    InputField in;
    in.field = f.field();
    in.dtype = f.dtype();
    in.global_shape.assign(f.global_shape().dims().begin(), f.global_shape().dims().end());
    in.spec = PartitionSpec::FromProto(f.spec());
    o.fields.push_back(std::move(in));
  }
  o.order.batch_size = spec.global_batch_size();
  o.order.seed = spec.seed();
  o.order.shuffle = spec.shuffle();
  o.order.drop_remainder = spec.drop_remainder();
  o.order.repeat = !spec.one_pass();
  return o;
}

}  // namespace meshrun
