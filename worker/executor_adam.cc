// Compiling the updates fused with the all-reduce of their partial input (XLA's weight-update
// sharding): OP_ADAM_UPDATE (optax.adamw's update of one parameter) when the op names grad axes,
// with the small reductions that worker/combine_reductions.h joins to that all-reduce (its
// riders); and OP_FUSED_ELEMENTWISE with axis_names (any element-wise update chain, e.g. optax's
// traced by the Python SDK, core/spmd/fusion.h's FuseReductionsIntoUpdates).
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/collectives/direct_collectives.h"
#include "core/collectives/reduce_kernels.h"
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

// The riders of `what`: operands in[first_in...], results out[first_out...], one letter of
// `kinds` each. Errors name a rider that is not f32 or whose result's shape differs.
absl::StatusOr<std::shared_ptr<Riders>> MakeRiders(const char* what, const std::string& kinds,
                                                   const std::vector<Tensor*>& in, size_t first_in,
                                                   const std::vector<Tensor*>& out,
                                                   size_t first_out) {
  auto rider = std::make_shared<Riders>();
  rider->kinds = kinds;
  for (size_t i = 0; i < kinds.size(); ++i) {
    Tensor* x = in[first_in + i];
    Tensor* y = out[first_out + i];
    if (x->dtype() != v1::DTYPE_F32 || y->dtype() != v1::DTYPE_F32 || x->dims() != y->dims()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": joined reduction ", i, " maps ", DTypeName(x->dtype()),
                       DimsToString(x->dims()), " to ", DTypeName(y->dtype()),
                       DimsToString(y->dims()), "; expected f32 of the same shape"));
    }
    rider->in.push_back(x);
    rider->out.push_back(y);
    rider->total += x->num_elements();
  }
  if (!kinds.empty()) {
    rider->bucket = std::make_shared<Tensor>(Tensor::Shareable(v1::DTYPE_F32, {rider->total}));
    rider->sums = std::make_shared<Tensor>(v1::DTYPE_F32, Dims{rider->total});
  }
  return rider;
}

// An update fused with the all-reduce of its partial operand (either kind), as compiled.
struct FusedReduction {
  Communicator* replicas;
  Tensor* partial;
  ReduceOp reduce;
  DType wire;     // the dtype reduced in: f32, or bf16 (the partial rounded first, FSDP2's
                  // reduce_dtype)
  bool direct;    // single-copy: the members reach each other's memory, the operand is large
  bool in_place;  // nothing else reads the partial: the ring may reduce it in its own memory
  std::shared_ptr<Riders> rider;
  std::shared_ptr<Tensor> reduced;  // the ring's copy of the partial, allocated on first use
  std::shared_ptr<Tensor> narrow;   // wire bf16: the partial rounded (shareable when direct)
  absl::Duration* timer;            // collective time: the all-reduces (and direct updates)
};

// Single-copy (direct) when the members reach each other's memory and the partial is at least
// the group's direct_min_bytes (never when that is 0; as CombineReductions decides, whatever
// the wire dtype).
FusedReduction NewFusedReduction(Communicator* replicas, Tensor* partial, ReduceOp reduce,
                                 DType wire, bool in_place, std::shared_ptr<Riders> rider,
                                 absl::Duration* timer) {
  FusedReduction f;
  f.replicas = replicas;
  f.partial = partial;
  f.reduce = reduce;
  f.wire = wire;
  f.direct = replicas->options().direct_min_bytes > 0 &&
             partial->size_bytes() >= replicas->options().direct_min_bytes &&
             replicas->ReachesAllMembers();
  f.in_place = in_place;
  f.rider = std::move(rider);
  f.reduced = std::make_shared<Tensor>();
  f.narrow = std::make_shared<Tensor>();
  if (wire == v1::DTYPE_BF16) {
    *f.narrow = f.direct ? Tensor::Shareable(v1::DTYPE_BF16, partial->dims())
                         : Tensor::Uninitialized(v1::DTYPE_BF16, partial->dims());
  }
  f.timer = timer;
  return f;
}

// The ring's all-reduce of the partial, into memory of its own unless it may reduce the
// partial in place: the reduced f32 values.
absl::StatusOr<const float*> RingAllReduce(const FusedReduction& f, bool shared) {
  const int64_t n = f.partial->num_elements();
  auto reduced = [&] {  // the copy, allocated on first use
    if (f.reduced->num_elements() != n)
      *f.reduced = Tensor::Uninitialized(v1::DTYPE_F32, f.partial->dims());
    return f.reduced->data<float>();
  };
  if (f.wire == v1::DTYPE_BF16) {  // (the narrowed copy is ours to reduce in place)
    if (n > 0) {
      absl::Status s = f.replicas->AllReduce(f.narrow->raw(), n, v1::DTYPE_BF16, f.reduce);
      if (!s.ok()) return s;
    }
    float* wide = reduced();
    Bf16ToF32(f.narrow->data<uint16_t>(), wide, n);
    return wide;
  }
  Tensor* g = f.partial;
  if (!f.in_place || shared) {
    std::memcpy(reduced(), f.partial->raw(), f.partial->size_bytes());
    g = f.reduced.get();
  }
  if (n > 0) {  // (the same on every member: the shapes are)
    absl::Status s = f.replicas->AllReduce(g->raw(), n, v1::DTYPE_F32, f.reduce);
    if (!s.ok()) return s;
  }
  return g->data<float>();
}

// One run: single-copy where `f.direct` and no output shares the partial's memory (`shared`:
// an output would be overwritten while it is still read; `out_elems`: each output's element
// bytes), each member reducing and updating
// one segment (`update(begin, len, g)`, g's element 0 the segment's first) and storing it into
// every member's `outputs`, the riders summed in the same session; otherwise the riders'
// bucket and the partial all-reduced on the ring and the whole update. With a bf16 wire the
// partial is rounded to bf16 first and each reduced segment widened to f32 for the update.
absl::Status RunFusedReduction(
    const FusedReduction& f, const std::vector<void*>& outputs,
    const std::vector<size_t>& out_elems, bool shared,
    const std::function<absl::Status(int64_t, int64_t, const float*)>& update) {
  const absl::Time start = absl::Now();
  const int64_t n = f.partial->num_elements();
  Riders& rider = *f.rider;
  const bool riders = !rider.kinds.empty();
  const bool bf16 = f.wire == v1::DTYPE_BF16;
  const float inv = 1.0f / static_cast<float>(f.replicas->size());
  if (riders) rider.Pack();
  if (bf16) F32ToBf16(f.partial->data<float>(), f.narrow->data<uint16_t>(), n);
  if (f.direct && !shared) {
    const DirectExtraSum extra{riders ? rider.bucket->raw() : nullptr, rider.total,
                               riders ? rider.sums->raw() : nullptr, v1::DTYPE_F32};
    absl::Status failed;
    std::vector<float> wide;  // bf16: a reduced segment widened
    absl::StatusOr<DirectResult> done = DirectAllReduceUpdate(
        *f.replicas, bf16 ? f.narrow->raw() : f.partial->raw(), n, f.wire, f.reduce, outputs,
        out_elems,
        [&](int64_t begin, int64_t len, const void* g) {
          const float* reduced = static_cast<const float*>(g);
          if (bf16) {
            wide.resize(len);
            Bf16ToF32(static_cast<const uint16_t*>(g), wide.data(), len);
            reduced = wide.data();
          }
          absl::Status s = update(begin, len, reduced);
          if (!s.ok() && failed.ok()) failed = s;
        },
        riders ? &extra : nullptr);
    if (!done.ok()) return done.status();
    if (!failed.ok()) return failed;
    if (*done == DirectResult::kDone) {
      if (riders) rider.Unpack(rider.sums->data<float>(), inv);
      *f.timer += absl::Now() - start;
      return absl::OkStatus();
    }
  }
  if (riders) {
    absl::Status s =
        f.replicas->AllReduce(rider.bucket->raw(), rider.total, v1::DTYPE_F32, ReduceOp::kSum);
    if (!s.ok()) return s;
    rider.Unpack(rider.bucket->data<float>(), inv);
  }
  absl::StatusOr<const float*> g = RingAllReduce(f, shared);
  if (!g.ok()) return g.status();
  *f.timer += absl::Now() - start;
  return update(0, n, *g);
}

}  // namespace

AdamWHyperParams AdamWHyperParamsOf(const v1::AdamWAttrs& attrs) {
  AdamWHyperParams hp;
  hp.learning_rate = attrs.learning_rate();
  hp.b1 = attrs.b1();
  hp.b2 = attrs.b2();
  hp.eps = attrs.eps();
  hp.weight_decay = attrs.weight_decay();
  return hp;
}

absl::StatusOr<int64_t> AdamWCount(const Tensor& step) {
  const float s = step.data<float>()[0];
  if (!(s >= 0.0f && s < 4.6e18f)) {  // (false for NaN)
    return absl::InvalidArgumentError(absl::StrCat("adamw: the step counter is ", s,
                                                   "; expected a count of updates in [0, 2^62)"));
  }
  return static_cast<int64_t>(s) + 1;
}

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
  const DType wire = op.adamw().reduce_dtype() == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_F32
                                                                        : op.adamw().reduce_dtype();
  if (wire != v1::DTYPE_F32 && wire != v1::DTYPE_BF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("OP_ADAM_UPDATE: reduce_dtype ", DTypeName(wire), "; expected f32 or bf16"));
  }
  absl::StatusOr<std::shared_ptr<Riders>> made =
      MakeRiders("OP_ADAM_UPDATE", reductions->riders, in, 5, out, 3);
  if (!made.ok()) return made.status();
  std::shared_ptr<Riders> rider = *std::move(made);
  const AdamWHyperParams hp = AdamWHyperParamsOf(op.adamw());
  Tensor *p_out = out[0], *mu_out = out[1], *nu_out = out[2];
  Bf16Copy* copy = Bf16CopyOf(op.outputs(0));  // the new param in bf16 too, or null
  // Elements [begin, begin + len) of the update, from the gradient `g` (its element 0 is
  // element `begin`).
  auto update = [=](int64_t count, const float* g, int64_t begin, int64_t len) {
    AdamWUpdate(hp, count, param->data<float>() + begin, g, mu->data<float>() + begin,
                nu->data<float>() + begin, p_out->data<float>() + begin,
                mu_out->data<float>() + begin, nu_out->data<float>() + begin, len);
    if (copy != nullptr) {
      F32ToBf16(p_out->data<float>() + begin, copy->values.data<uint16_t>() + begin, len);
    }
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
      absl::StatusOr<int64_t> count = AdamWCount(*step);
      if (!count.ok()) return count.status();
      for (int i = 0; i < riders; ++i) {
        std::memcpy(rider->out[i]->raw(), rider->in[i]->raw(), rider->in[i]->size_bytes());
      }
      // A sweep of one segment: every compute thread takes part (JoinAdamUpdates joins runs of
      // several such updates; this one stands alone).
      const AdamWSegment segment{param->data<float>(),
                                 grad->data<float>(),
                                 mu->data<float>(),
                                 nu->data<float>(),
                                 p_out->data<float>(),
                                 mu_out->data<float>(),
                                 nu_out->data<float>(),
                                 n,
                                 copy != nullptr ? copy->values.data<uint16_t>() : nullptr};
      AdamWSweep(hp, *count, {&segment, 1});
      if (copy != nullptr) copy->written = true;
      return absl::OkStatus();
    });
  }
  // The partial gradient over the grad axes, reduced with the update (RunFusedReduction).
  // Collective time counts the all-reduces, and on the direct path the 1/P of the update done
  // inside it.
  const FusedReduction f = NewFusedReduction(
      replicas, in[1], reduce, wire, reduce_in_place_.count(&op) > 0, rider, &collective_time_);
  return CompiledOp([=](const RunContext&) {
    // (Read at each run: a step binds its arguments and results anew.)
    absl::StatusOr<int64_t> count = AdamWCount(*step);
    if (!count.ok()) return count.status();
    std::vector<void*> outputs = {p_out->raw(), mu_out->raw(), nu_out->raw()};
    std::vector<size_t> elems(3, sizeof(float));
    if (copy != nullptr) {  // (every member's, written by the segment's owner)
      outputs.push_back(copy->values.raw());
      elems.push_back(sizeof(uint16_t));
    }
    absl::Status s = RunFusedReduction(f, outputs, elems, /*shared=*/false,
                                       [&](int64_t begin, int64_t len, const float* g) {
                                         update(*count, g, begin, len);
                                         return absl::OkStatus();
                                       });
    if (copy != nullptr) copy->written = s.ok();
    return s;
  });
}

absl::StatusOr<Executor::CompiledOp> Executor::CompileFusedReduceUpdate(
    const v1::Op& op, const std::vector<Tensor*>& in, const std::vector<Tensor*>& out) {
  const size_t colon = op.fn().find(':');
  const std::string reduction = op.fn().substr(0, colon);
  const std::string kinds = colon == std::string::npos ? "" : op.fn().substr(colon + 1);
  if ((reduction != "sum" && reduction != "mean") ||
      kinds.find_first_not_of("sm") != std::string::npos || kinds.size() >= in.size() ||
      kinds.size() > out.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "OP_FUSED_ELEMENTWISE over axes: fn must be the reduction of input 0 (sum or mean), then "
        "':' and one s or m per joined reduction (whose operands and results are the last inputs "
        "and outputs); got '",
        op.fn(), "' with ", in.size(), " inputs and ", out.size(), " outputs"));
  }
  const std::vector<Tensor*> own_in(in.begin(), in.end() - kinds.size());
  const std::vector<Tensor*> own_out(out.begin(), out.end() - kinds.size());
  absl::StatusOr<std::shared_ptr<Riders>> made =
      MakeRiders("OP_FUSED_ELEMENTWISE", kinds, in, own_in.size(), out, own_out.size());
  if (!made.ok()) return made.status();
  std::shared_ptr<Riders> rider = *std::move(made);
  std::vector<FusedInstruction> instrs;
  for (const v1::FusedInstr& f : op.fused())
    instrs.push_back({f.fn(), std::vector<int>(f.args().begin(), f.args().end())});
  absl::StatusOr<std::unique_ptr<RangeKernel>> k = CreateFusedElementwiseRange(
      instrs, std::vector<const Tensor*>(own_in.begin(), own_in.end()),
      std::vector<int>(op.fused_outputs().begin(), op.fused_outputs().end()), own_out);
  if (!k.ok()) return k.status();
  std::shared_ptr<RangeKernel> kernel = *std::move(k);
  absl::StatusOr<Communicator*> c =
      CommunicatorFor(std::vector<std::string>(op.axis_names().begin(), op.axis_names().end()));
  if (!c.ok()) return c.status();
  Communicator* replicas = *c;
  Tensor* partial = in[0];
  const int riders = static_cast<int>(kinds.size());
  if (replicas->size() == 1) {  // a group of one: the sums (and means) are the operands
    return CompiledOp([kernel, rider, riders](const RunContext&) {
      for (int i = 0; i < riders; ++i)
        std::memcpy(rider->out[i]->raw(), rider->in[i]->raw(), rider->in[i]->size_bytes());
      return kernel->Run();
    });
  }
  // As OP_ADAM_UPDATE's (RunFusedReduction); an output that is a view of the partial takes the
  // ring, on a copy.
  const FusedReduction f =
      NewFusedReduction(replicas, partial, reduction == "sum" ? ReduceOp::kSum : ReduceOp::kMean,
                        v1::DTYPE_F32, reduce_in_place_.count(&op) > 0, rider, &collective_time_);
  return CompiledOp([=](const RunContext&) {
    const char* pb = static_cast<const char*>(partial->raw());
    const char* pe = pb + partial->size_bytes();
    bool shared = false;
    std::vector<void*> outputs;
    for (Tensor* t : own_out) {
      const char* ob = static_cast<const char*>(t->raw());
      shared = shared || (ob < pe && pb < ob + t->size_bytes());
      outputs.push_back(t->raw());
    }
    return RunFusedReduction(f, outputs, std::vector<size_t>(outputs.size(), sizeof(float)), shared,
                             [&](int64_t begin, int64_t len, const float* g) {
                               return kernel->RunRange(begin, len, g);
                             });
  });
}

}  // namespace meshrun
