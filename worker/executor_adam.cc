// Compiling the updates fused with the all-reduce of their partial input (XLA's weight-update
// sharding): OP_ADAM_UPDATE (optax.adamw's update of one parameter) when the op names grad axes,
// with the small reductions that worker/combine_reductions.h joins to that all-reduce (its
// riders); and OP_FUSED_ELEMENTWISE with axis_names (any element-wise update chain, e.g. optax's
// traced by the Python SDK, core/spmd/fusion.h's FuseReductionsIntoUpdates).
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/collectives/direct_collectives.h"
#include "core/optim/adamw.h"
#include "worker/executor.h"
#include "worker/kernels/kernel.h"
#include "worker/reduction_bucket.h"

namespace meshrun {
namespace {

// The op's fn split into the gradient's reduction ("sum", "mean" or "" without grad axes) and
// its riders' letters ('s' sum or 'm' mean, one per rider).
struct AdamReductions {
  std::string grad;
  std::string riders;
};

absl::StatusOr<AdamReductions> ParseReductions(const v1::Op& op, int riders) {
  AdamReductions r;
  const std::string& fn = op.fn();
  const size_t colon = fn.find(':');
  r.grad = fn.substr(0, colon);
  if (colon != std::string::npos) r.riders = fn.substr(colon + 1);
  if (op.axis_names_size() == 0) {
    if (!fn.empty() || riders > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("OP_ADAM_UPDATE without grad axes takes 5 inputs, 3 outputs and no fn; got ",
                       op.inputs_size(), " inputs and fn '", fn, "'"));
    }
    return r;
  }
  if (r.grad != "sum" && r.grad != "mean") {
    return absl::InvalidArgumentError(absl::StrCat(
        "OP_ADAM_UPDATE: the grad reduction (fn) must be sum or mean; got '", fn, "'"));
  }
  if (static_cast<int>(r.riders.size()) != riders ||
      r.riders.find_first_not_of("sm") != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("OP_ADAM_UPDATE with ", riders, " joined reductions: fn '", fn,
                     "' must be the grad's sum or mean, then ':' and one s or m per reduction"));
  }
  return r;
}

// The riders of an Adam update: their inputs side by side in one shareable bucket, summed over
// the group with the gradient (or on their own), then written to their outputs, the means
// divided by the group's size (as pmean does).
struct Riders {
  std::vector<Tensor*> in;  // read only
  std::vector<Tensor*> out;
  std::string kinds;
  std::shared_ptr<Tensor> bucket;  // their inputs, side by side (shareable memory)
  std::shared_ptr<Tensor> sums;    // the bucket's sum over the group
  int64_t total = 0;

  void Pack() { PackBucket(in, bucket->data<float>()); }
  void Unpack(const float* sum, float inv) { UnpackBucket(sum, out, kinds, inv); }
};

}  // namespace

absl::StatusOr<Executor::CompiledOp> Executor::CompileAdamUpdate(const v1::Op& op,
                                                                 const std::vector<Tensor*>& in,
                                                                 const std::vector<Tensor*>& out) {
  const int riders = op.inputs_size() - 5;
  if (riders < 0 || op.outputs_size() != 3 + riders) {
    return absl::InvalidArgumentError(absl::StrCat(
        "OP_ADAM_UPDATE takes param, grad, mu, nu, step (then any joined reductions' operands) "
        "and param, mu, nu (then their results); got ",
        op.inputs_size(), " inputs and ", op.outputs_size(), " outputs"));
  }
  absl::StatusOr<AdamReductions> reductions = ParseReductions(op, riders);
  if (!reductions.ok()) return reductions.status();
  const Tensor *param = in[0], *grad = in[1], *mu = in[2], *nu = in[3], *step = in[4];
  for (const Tensor* t : {param, grad, mu, nu, static_cast<const Tensor*>(out[0]),
                          static_cast<const Tensor*>(out[1]), static_cast<const Tensor*>(out[2])}) {
    if (t->dtype() != v1::DTYPE_F32 || t->dims() != param->dims()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "OP_ADAM_UPDATE: param, grad, mu, nu and the outputs must ", "all be f32",
          DimsToString(param->dims()), "; got ", DTypeName(t->dtype()), DimsToString(t->dims())));
    }
  }
  if (step->dtype() != v1::DTYPE_F32 || step->num_elements() != 1) {
    return absl::InvalidArgumentError(absl::StrCat("OP_ADAM_UPDATE: step must be f32[]; got ",
                                                   DTypeName(step->dtype()),
                                                   DimsToString(step->dims())));
  }
  auto rider = std::make_shared<Riders>();
  rider->kinds = reductions->riders;
  for (int i = 0; i < riders; ++i) {
    Tensor* x = in[5 + i];
    Tensor* y = out[3 + i];
    if (x->dtype() != v1::DTYPE_F32 || y->dtype() != v1::DTYPE_F32 || x->dims() != y->dims()) {
      return absl::InvalidArgumentError(
          absl::StrCat("OP_ADAM_UPDATE: joined reduction ", i, " maps ", DTypeName(x->dtype()),
                       DimsToString(x->dims()), " to ", DTypeName(y->dtype()),
                       DimsToString(y->dims()), "; expected f32 of the same shape"));
    }
    rider->in.push_back(x);
    rider->out.push_back(y);
    rider->total += x->num_elements();
  }
  if (riders > 0) {
    rider->bucket = std::make_shared<Tensor>(Tensor::Shareable(v1::DTYPE_F32, {rider->total}));
    rider->sums = std::make_shared<Tensor>(v1::DTYPE_F32, Dims{rider->total});
  }
  AdamWHyperParams hp;
  hp.learning_rate = op.adamw().learning_rate();
  hp.b1 = op.adamw().b1();
  hp.b2 = op.adamw().b2();
  hp.eps = op.adamw().eps();
  hp.weight_decay = op.adamw().weight_decay();
  Tensor *p_out = out[0], *mu_out = out[1], *nu_out = out[2];
  // Elements [begin, begin + len) of the update, from the gradient `g` (its element 0 is
  // element `begin`).
  auto update = [=](const float* g, int64_t begin, int64_t len) {
    const int64_t count = static_cast<int64_t>(step->data<float>()[0]) + 1;
    AdamWUpdate(hp, count, param->data<float>() + begin, g, mu->data<float>() + begin,
                nu->data<float>() + begin, p_out->data<float>() + begin,
                mu_out->data<float>() + begin, nu_out->data<float>() + begin, len);
  };
  const int64_t n = param->num_elements();
  Communicator* replicas = nullptr;  // the grad axes' group, if the gradient is partial
  const ReduceOp reduce = reductions->grad == "sum" ? ReduceOp::kSum : ReduceOp::kMean;
  if (op.axis_names_size() > 0) {
    absl::StatusOr<Communicator*> c =
        CommunicatorFor(std::vector<std::string>(op.axis_names().begin(), op.axis_names().end()));
    if (!c.ok()) return c.status();
    if ((*c)->size() > 1) replicas = *c;
  }
  if (replicas == nullptr) {  // a group of one: the sums are the operands
    return CompiledOp([=](const RunContext&) {
      for (int i = 0; i < riders; ++i) {
        std::memcpy(rider->out[i]->raw(), rider->in[i]->raw(), rider->in[i]->size_bytes());
      }
      update(grad->data<float>(), 0, n);
      return absl::OkStatus();
    });
  }
  // The partial gradient over the grad axes: members that reach each other's memory reduce
  // and update one segment each and store it into every member's results, summing the riders
  // in the same session (DirectAllReduceUpdate); otherwise the riders are all-reduced as one
  // bucket, the gradient (in its own memory if nothing else reads it, else in a copy allocated
  // on first use), and each member updates all of it. Collective time counts the all-reduces,
  // and on the direct path the 1/P of the update done inside it.
  const bool direct = replicas->options().direct_min_bytes > 0 &&
                      grad->size_bytes() >= replicas->options().direct_min_bytes &&
                      replicas->ReachesAllMembers();
  const bool in_place = reduce_in_place_.count(&op) > 0;
  Tensor* partial = in[1];
  auto reduced = std::make_shared<Tensor>();
  absl::Duration* timer = &collective_time_;
  const float inv = 1.0f / static_cast<float>(replicas->size());
  return CompiledOp([=](const RunContext&) -> absl::Status {
    const absl::Time start = absl::Now();
    if (riders > 0) rider->Pack();
    if (direct) {
      const DirectExtraSum extra{rider->bucket ? rider->bucket->raw() : nullptr, rider->total,
                                 rider->sums ? rider->sums->raw() : nullptr};
      absl::StatusOr<DirectResult> done = DirectAllReduceUpdate(
          *replicas, grad->raw(), n, v1::DTYPE_F32, reduce,
          {p_out->raw(), mu_out->raw(), nu_out->raw()}, sizeof(float),
          [&](int64_t begin, int64_t len, const void* g) {
            update(static_cast<const float*>(g), begin, len);
          },
          riders > 0 ? &extra : nullptr);
      if (!done.ok()) return done.status();
      if (*done == DirectResult::kDone) {
        if (riders > 0) rider->Unpack(rider->sums->data<float>(), inv);
        *timer += absl::Now() - start;
        return absl::OkStatus();
      }
    }
    if (riders > 0) {
      absl::Status s =
          replicas->AllReduce(rider->bucket->raw(), rider->total, v1::DTYPE_F32, ReduceOp::kSum);
      if (!s.ok()) return s;
      rider->Unpack(rider->bucket->data<float>(), inv);
    }
    Tensor* g = partial;
    if (!in_place) {
      if (reduced->num_elements() != n)
        *reduced = Tensor::Uninitialized(v1::DTYPE_F32, grad->dims());
      std::memcpy(reduced->raw(), grad->raw(), grad->size_bytes());
      g = reduced.get();
    }
    if (absl::Status s = replicas->AllReduce(g->raw(), n, v1::DTYPE_F32, reduce); !s.ok()) return s;
    *timer += absl::Now() - start;
    update(g->data<float>(), 0, n);
    return absl::OkStatus();
  });
}

absl::StatusOr<Executor::CompiledOp> Executor::CompileFusedReduceUpdate(
    const v1::Op& op, const std::vector<Tensor*>& in, const std::vector<Tensor*>& out) {
  if (op.fn() != "sum" && op.fn() != "mean") {
    return absl::InvalidArgumentError(absl::StrCat(
        "OP_FUSED_ELEMENTWISE over axes: the reduction of input 0 (fn) must be sum or mean; got '",
        op.fn(), "'"));
  }
  std::vector<FusedInstruction> instrs;
  for (const v1::FusedInstr& f : op.fused())
    instrs.push_back({f.fn(), std::vector<int>(f.args().begin(), f.args().end())});
  absl::StatusOr<std::unique_ptr<RangeKernel>> k = CreateFusedElementwiseRange(
      instrs, std::vector<const Tensor*>(in.begin(), in.end()),
      std::vector<int>(op.fused_outputs().begin(), op.fused_outputs().end()), out);
  if (!k.ok()) return k.status();
  std::shared_ptr<RangeKernel> kernel = *std::move(k);
  absl::StatusOr<Communicator*> c =
      CommunicatorFor(std::vector<std::string>(op.axis_names().begin(), op.axis_names().end()));
  if (!c.ok()) return c.status();
  Communicator* replicas = *c;
  Tensor* partial = in[0];
  const int64_t n = partial->num_elements();
  if (replicas->size() == 1 || n == 0) {  // a group of one: the sum (and mean) is the operand
    return CompiledOp([kernel](const RunContext&) { return kernel->Run(); });
  }
  // As OP_ADAM_UPDATE: single-copy where the members reach each other's memory (each reduces
  // and updates one segment and stores it into every member's outputs), else the all-reduce (in
  // the partial's memory if nothing else reads it, else in a copy) and the whole update.
  const ReduceOp reduce = op.fn() == "sum" ? ReduceOp::kSum : ReduceOp::kMean;
  const bool direct = replicas->options().direct_min_bytes > 0 &&
                      partial->size_bytes() >= replicas->options().direct_min_bytes &&
                      replicas->ReachesAllMembers();
  const bool in_place = reduce_in_place_.count(&op) > 0;
  auto reduced = std::make_shared<Tensor>();
  absl::Duration* timer = &collective_time_;
  // Memory an output shares with the partial (a view of it) would be overwritten while it is
  // still being reduced: such a run reduces a copy, on the ring.
  auto overlaps_partial = [partial, out] {
    const char* pb = static_cast<const char*>(partial->raw());
    const char* pe = pb + partial->size_bytes();
    for (const Tensor* t : out) {
      const char* ob = static_cast<const char*>(t->raw());
      if (ob < pe && pb < ob + t->size_bytes()) return true;
    }
    return false;
  };
  return CompiledOp([=](const RunContext&) -> absl::Status {
    const absl::Time start = absl::Now();
    const bool shared = overlaps_partial();
    if (direct && !shared) {
      std::vector<void*> outputs;
      for (Tensor* t : out) outputs.push_back(t->raw());
      absl::Status failed;
      absl::StatusOr<DirectResult> done = DirectAllReduceUpdate(
          *replicas, partial->raw(), n, v1::DTYPE_F32, reduce, outputs, sizeof(float),
          [&](int64_t begin, int64_t len, const void* g) {
            absl::Status s = kernel->RunRange(begin, len, static_cast<const float*>(g));
            if (!s.ok() && failed.ok()) failed = s;
          });
      if (!done.ok()) return done.status();
      if (!failed.ok()) return failed;
      if (*done == DirectResult::kDone) {
        *timer += absl::Now() - start;
        return absl::OkStatus();
      }
    }
    Tensor* g = partial;
    if (!in_place || shared) {
      if (reduced->num_elements() != n)
        *reduced = Tensor::Uninitialized(v1::DTYPE_F32, partial->dims());
      std::memcpy(reduced->raw(), partial->raw(), partial->size_bytes());
      g = reduced.get();
    }
    if (absl::Status s = replicas->AllReduce(g->raw(), n, v1::DTYPE_F32, reduce); !s.ok()) return s;
    *timer += absl::Now() - start;
    return kernel->RunRange(0, n, g->data<float>());
  });
}

}  // namespace meshrun
