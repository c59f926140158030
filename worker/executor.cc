#include "worker/executor.h"

#include <algorithm>
#include <cstring>
#include <memory>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/optim/adamw.h"
#include "worker/combine_reductions.h"
#include "worker/kernels/kernel.h"

namespace meshrun {
namespace {

// Wraps a kernel as a compiled op.
Executor::CompiledOp FromKernel(std::unique_ptr<Kernel> kernel) {
  std::shared_ptr<Kernel> k = std::move(kernel);
  return [k](const RunContext&) { return k->Run(); };
}

}  // namespace

Executor::Executor(const v1::StepProgram& program, const Options& options)
    : program_(program), options_(options) {}

absl::StatusOr<int64_t> Executor::BufferBytes(const v1::StepProgram& program) {
  int64_t total = 0;
  for (const v1::BufferDecl& decl : program.buffers()) {
    absl::StatusOr<int64_t> bytes =
        CheckedByteSize(decl.dtype(), Dims(decl.shape().dims().begin(), decl.shape().dims().end()));
    if (!bytes.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("buffer '", decl.name(), "': ", bytes.status().message()));
    }
    total += *bytes;  // each at most 2^46, so no overflow below 2^17 buffers
    if (total > kMaxArrayBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("the program's buffers take more than ", kMaxArrayBytes, " bytes"));
    }
  }
  return total;
}

absl::StatusOr<std::unique_ptr<Executor>> Executor::Create(const v1::StepProgram& program,
                                                           const Options& options) {
  if (absl::StatusOr<int64_t> bytes = BufferBytes(program); !bytes.ok()) return bytes.status();
  std::unique_ptr<Executor> ex(new Executor(program, options));
  // Reductions nothing needs in between run as one bucket (worker/combine_reductions.h).
  CombineReductions(&ex->program_, options.collectives.combine_max_bytes,
                    options.collectives.direct_min_bytes);
  for (const v1::BufferDecl& decl : ex->program_.buffers()) {
    if (DTypeSize(decl.dtype()) == 0) {
      return absl::InvalidArgumentError(absl::StrCat("buffer '", decl.name(), "' has no dtype"));
    }
    if (ex->buffers_.count(decl.name())) {
      return absl::InvalidArgumentError(
          absl::StrCat("buffer '", decl.name(), "' is declared twice"));
    }
    Dims dims(decl.shape().dims().begin(), decl.shape().dims().end());
    // Zeroed below unless it never uses its own memory before it is written whole (untouched,
    // that memory is never resident).
    ex->buffers_.emplace(decl.name(), Tensor::Uninitialized(decl.dtype(), dims));
    ex->roles_[decl.name()] = decl.role();
  }
  ex->AnalyzeBuffers();
  for (const v1::Function& f : ex->program_.functions()) {
    CompiledFunction cf{&f, {}, {}, {}};
    for (int i = 0; i < f.ops_size(); ++i) {
      absl::StatusOr<CompiledOp> op = ex->Compile(f.ops(i));
      if (!op.ok()) {
        return absl::Status(op.status().code(), absl::StrCat("function '", f.name(), "' op ", i,
                                                             " (", v1::OpKind_Name(f.ops(i).kind()),
                                                             "): ", op.status().message()));
      }
      cf.ops.push_back(*std::move(op));
      if (ex->options_.observer != nullptr) cf.recorders.push_back(ex->RecorderFor(f.ops(i)));
      cf.collectives.emplace_back(CollectiveName(f.ops(i)),
                                  absl::StrJoin(f.ops(i).axis_names(), ","));
    }
    if (absl::Status s = ex->JoinAdamUpdates(f, cf.ops); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("function '", f.name(), "': ", s.message()));
    }
    ex->functions_[f.name()] = std::move(cf);
  }
  // Views and placed parts use another buffer's memory, never their own.
  std::set<std::string> left_untouched = ex->views_;
  for (const Placement& p : ex->placements_) left_untouched.insert(p.part);
  for (const std::string& name : ex->written_) {
    if (!left_untouched.count(name)) ex->written_buffers_.push_back(&ex->buffers_.at(name));
  }
  // Every buffer starts zeroed but those that never use their own memory before an op writes it
  // whole: those, and the results that may go over a donated input (their one writer, an Adam
  // update or a fused element-wise op, writes every element).
  for (const auto& [output, inputs] : ex->over_donated_) left_untouched.insert(output);
  // Inputs no op writes are zeroed only if used before BindInput gives them memory or values.
  for (auto& [name, tensor] : ex->buffers_) {
    if (left_untouched.count(name)) continue;
    if (ex->written_.count(name)) {
      tensor.ZeroFill();
    } else {
      ex->unzeroed_.insert(name);
    }
  }
  return ex;
}

absl::Status Executor::BindInput(const std::string& name, const Tensor& value, bool donated) {
  auto it = buffers_.find(name);
  if (it == buffers_.end())
    return absl::InvalidArgumentError(absl::StrCat("no input buffer '", name, "'"));
  Tensor* b = &it->second;
  if (b->dims() != value.dims() || b->dtype() != value.dtype()) {
    return absl::InvalidArgumentError(
        absl::StrCat("input '", name, "' is ", DTypeName(value.dtype()), DimsToString(value.dims()),
                     " but the program expects ", DTypeName(b->dtype()), DimsToString(b->dims())));
  }
  donated_.erase(name);
  unzeroed_.erase(name);  // shared or copied whole below
  if (!written_.count(name)) {
    *b = value.Alias();  // only read: kernels re-point at it when they run
    if (donated) donated_.insert(name);
    return absl::OkStatus();
  }
  if (b->aliased()) b->ReplaceStorage();
  std::memcpy(b->raw(), value.raw(), b->size_bytes());
  b->set_bf16_copy(nullptr);  // an op writes it: the copy would go stale
  return absl::OkStatus();
}

absl::StatusOr<Tensor> Executor::TakeOutput(const std::string& name) {
  Tensor* b = buffer(name);
  if (b == nullptr)
    return absl::InvalidArgumentError(absl::StrCat("no output buffer '", name, "'"));
  Tensor result = b->Alias();
  if (const Bf16Copy* copy = Bf16CopyOf(name); copy != nullptr && copy->written)
    result.set_bf16_copy(std::make_shared<const Tensor>(copy->values.Alias()));
  return result;
}

Tensor* Executor::buffer(const std::string& name) {
  auto it = buffers_.find(name);
  if (it == buffers_.end()) return nullptr;
  if (unzeroed_.erase(name) > 0) it->second.ZeroFill();
  return &it->second;
}

int64_t Executor::ResidentBytes(v1::BufferRole role) const {
  int64_t total = 0;
  for (const auto& [name, t] : buffers_) {
    if (role == v1::BUFFER_ROLE_UNSPECIFIED || roles_.at(name) == role) total += t.size_bytes();
  }
  return total;
}

absl::StatusOr<Tensor*> Executor::Buffer(const v1::Op& op, const std::string& name) {
  Tensor* t = buffer(name);
  if (t == nullptr) return absl::InvalidArgumentError(absl::StrCat("unknown buffer '", name, "'"));
  return t;
}

absl::StatusOr<Communicator*> Executor::CommunicatorFor(const std::string& axis_name) {
  return CommunicatorFor(std::vector<std::string>{axis_name});
}

absl::StatusOr<Communicator*> Executor::CommunicatorFor(
    const std::vector<std::string>& axis_names) {
  const std::string key = absl::StrJoin(axis_names, ",");
  auto it = communicators_.find(key);
  if (it != communicators_.end()) return it->second.get();
  if (options_.mesh == nullptr) return absl::FailedPreconditionError("no mesh for a collective");
  if (axis_names.empty())
    return absl::InvalidArgumentError("a collective needs at least one mesh axis");
  absl::StatusOr<std::vector<int>> axes = options_.mesh->AxisIndices(axis_names);
  if (!axes.ok()) return axes.status();
  if (options_.transport == nullptr)
    return absl::FailedPreconditionError("no transport for a collective");
  auto comm = std::make_unique<Communicator>(
      options_.transport, options_.mesh->AxesGroup(options_.rank, *axes), options_.collectives);
  Communicator* raw = comm.get();
  communicators_[key] = std::move(comm);
  return raw;
}

absl::Status Executor::Run(const std::string& name, const RunContext& ctx) {
  auto it = functions_.find(name);
  if (it == functions_.end())
    return absl::NotFoundError(absl::StrCat("program has no function '", name, "'"));
  const CompiledFunction& cf = it->second;
  for (const std::string& input : unzeroed_) buffers_.at(input).ZeroFill();  // never bound
  unzeroed_.clear();
  // Results written over donated inputs; then memory handed out by TakeOutput (or shared with
  // a bound input) is never written again.
  std::set<const Tensor*> over_donated;
  std::set<std::string> taken;
  for (const auto& [y, xs] : over_donated_) {
    for (const std::string& x : xs) {
      if (!donated_.count(x) || !taken.insert(x).second) continue;
      Tensor* out = &buffers_.at(y);
      out->ShareMemory(buffers_.at(x), 0);
      over_donated.insert(out);
      break;
    }
  }
  donated_.clear();
  for (Tensor* b : written_buffers_) {
    if (b->aliased() && !over_donated.count(b)) b->ReplaceStorage();
  }
  for (const Placement& p : placements_)
    buffers_.at(p.part).ShareMemory(buffers_.at(p.whole), p.byte_offset);
  for (auto& [name, copy] : bf16_copies_) {
    copy.written = false;
    // (A copy handed out stays as it is.)
    if (copy.values.aliased()) copy.values = Tensor::Shareable(v1::DTYPE_BF16, copy.values.dims());
  }
  // An input that a result is written over loses its copy with the run: it would be stale.
  absl::Cleanup forget_copies = [&] {
    for (const std::string& x : taken) buffers_.at(x).set_bf16_copy(nullptr);
  };
  const bool record = !cf.recorders.empty();
  int collective_index = 0;
  for (size_t i = 0; i < cf.ops.size(); ++i) {
    const bool collective = !cf.collectives[i].first.empty();
    const absl::Time start = record || collective ? absl::Now() : absl::InfinitePast();
    if (collective && arrivals_.size() < kMaxArrivals) {
      arrivals_.push_back(
          {collective_index, &cf.collectives[i].first, &cf.collectives[i].second, start});
    }
    collective_index += collective;
    absl::Status s = cf.ops[i](ctx);
    if (record) cf.recorders[i](absl::Now() - start);
    if (!s.ok()) {
      return absl::Status(
          s.code(), absl::StrCat("function '", name, "' op ", i, " (",
                                 v1::OpKind_Name(cf.function->ops(i).kind()), "): ", s.message()));
    }
  }
  return absl::OkStatus();
}

std::string Executor::CollectiveName(const v1::Op& op) {
  static const std::map<v1::OpKind, std::string> kCollectives = {
      {v1::OP_PSUM, "psum"},
      {v1::OP_PMEAN, "pmean"},
      {v1::OP_PMAX, "pmax"},
      {v1::OP_ALL_GATHER, "all_gather"},
      {v1::OP_PSUM_SCATTER, "psum_scatter"},
      {v1::OP_PPERMUTE, "ppermute"},
      {v1::OP_ALL_TO_ALL, "all_to_all"}};
  auto it = kCollectives.find(op.kind());
  if (it != kCollectives.end()) return it->second;
  if ((op.kind() == v1::OP_ADAM_UPDATE || op.kind() == v1::OP_FUSED_ELEMENTWISE) &&
      op.axis_names_size() > 0)
    return absl::StartsWith(op.fn(), "mean") ? "pmean" : "psum";
  return "";
}

MatmulOptions MatmulOptionsOf(const v1::Op& op) {
  MatmulOptions mo;
  mo.transpose_a = op.transpose_a();
  mo.transpose_b = op.transpose_b();
  mo.alpha = op.alpha() == 0.0f ? 1.0f : op.alpha();
  mo.accumulate = op.accumulate();
  mo.activation = op.fn();
  return mo;
}

std::string MatmulShapeLabel(const v1::Op& op, const Dims& a, const Dims& b, DType operands,
                             DType result) {
  auto dims = [](const Dims& d) { return absl::StrCat("[", absl::StrJoin(d, ","), "]"); };
  return absl::StrCat(dims(a), "x", dims(b), " ", DTypeName(operands), "->", DTypeName(result),
                      op.transpose_a() ? " ta" : "", op.transpose_b() ? " tb" : "",
                      op.inputs_size() == 3 ? " +bias" : "",
                      op.fn().empty() ? "" : absl::StrCat(" ", op.fn()),
                      op.accumulate() ? " acc" : "");
}

OpObserver::Recorder Executor::RecorderFor(const v1::Op& op) {
  const std::string collective = CollectiveName(op);
  if (collective.empty()) {
    std::string shape;
    if (op.kind() == v1::OP_MATMUL && op.inputs_size() >= 2 && op.outputs_size() == 1) {
      const Tensor *a = buffer(op.inputs(0)), *b = buffer(op.inputs(1)), *c = buffer(op.outputs(0));
      if (a != nullptr && b != nullptr && c != nullptr)
        shape = MatmulShapeLabel(op, a->dims(), b->dims(), a->dtype(), c->dtype());
    }
    return options_.observer->ForKernel(absl::AsciiStrToLower(v1::OpKind_Name(op.kind()).substr(3)),
                                        shape);  // matmul
  }
  int64_t bytes = 0;
  if (op.kind() == v1::OP_ADAM_UPDATE) {
    // The gradient's all-reduce fused with the update: counted as the collective it replaces
    // (its time includes the update), its bytes the gradient's and its joined reductions'.
    for (int i = 1; i < op.inputs_size(); i += i == 1 ? 4 : 1) {
      if (const Tensor* t = buffer(op.inputs(i))) bytes += static_cast<int64_t>(t->size_bytes());
    }
  } else if (op.kind() == v1::OP_FUSED_ELEMENTWISE) {  // input 0's all-reduce, and any riders'
    const size_t colon = op.fn().find(':');
    const int riders =
        colon == std::string::npos ? 0 : static_cast<int>(op.fn().size() - colon - 1);
    std::vector<int> counted;
    if (op.inputs_size() > 0) counted.push_back(0);
    for (int i = std::max(1, op.inputs_size() - riders); i < op.inputs_size(); ++i)
      counted.push_back(i);
    for (int i : counted) {
      if (const Tensor* t = buffer(op.inputs(i))) bytes += static_cast<int64_t>(t->size_bytes());
    }
  } else {
    for (const auto& name : op.inputs()) {
      if (const Tensor* t = buffer(name)) bytes += static_cast<int64_t>(t->size_bytes());
    }
  }
  return options_.observer->ForCollective(collective, absl::StrJoin(op.axis_names(), ","), bytes);
}

absl::StatusOr<Executor::CompiledOp> Executor::Compile(const v1::Op& op) {
  std::vector<Tensor*> in, out;
  for (const auto& n : op.inputs()) {
    absl::StatusOr<Tensor*> t = Buffer(op, n);
    if (!t.ok()) return t.status();
    in.push_back(*t);
  }
  for (const auto& n : op.outputs()) {
    absl::StatusOr<Tensor*> t = Buffer(op, n);
    if (!t.ok()) return t.status();
    out.push_back(*t);
  }
  auto wrap = [](absl::StatusOr<std::unique_ptr<Kernel>> k) -> absl::StatusOr<CompiledOp> {
    if (!k.ok()) return k.status();
    return FromKernel(*std::move(k));
  };
  switch (op.kind()) {
    case v1::OP_MATMUL: {
      if (op.inputs_size() < 2 || op.inputs_size() > 3 || op.outputs_size() != 1) {
        return absl::InvalidArgumentError("OP_MATMUL takes a, b[, bias] and one output");
      }
      return wrap(CreateMatmul(*in[0], *in[1], op.inputs_size() == 3 ? in[2] : nullptr, *out[0],
                               MatmulOptionsOf(op)));
    }
    case v1::OP_SOFTMAX_CROSS_ENTROPY_GRAD:  // numbered below the general ops
    case v1::OP_FUSED_ELEMENTWISE:
    case v1::OP_SELECT:
    case v1::OP_BITCAST_CONVERT:
    case v1::OP_DYNAMIC_SLICE_ND:
    case v1::OP_DYNAMIC_UPDATE_SLICE:
    case v1::OP_CUMULATIVE:
    case v1::OP_REVERSE:
    case v1::OP_SORT:
      return CompileGeneral(op, in, out);
    case v1::OP_THREEFRY2X32:
      return CompileRandom(op, in, out);
    default:
      if (op.kind() >= v1::OP_PSUM) return CompileCollective(op, in, out);
      if (op.kind() >= v1::OP_UNARY) return CompileGeneral(op, in, out);
      return absl::InvalidArgumentError(absl::StrCat("unsupported op kind ", op.kind()));
  }
}

}  // namespace meshrun
