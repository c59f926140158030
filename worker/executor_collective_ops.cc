// Compiling the shard_map collectives: jax.lax's psum, pmean, pmax, all_gather, psum_scatter,
// all_to_all and ppermute with their dim semantics, on top of the flat collectives of
// core/collectives, and buckets of several reductions run as one all-reduce.
#include <algorithm>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/array_ops.h"
#include "core/collectives/permute.h"
#include "core/sharding/named_sharding.h"
#include "worker/executor.h"
#include "worker/reduction_bucket.h"

namespace meshrun {

namespace {

// An op running `fn`, its time added to `*timer` (the executor's collective time).
Executor::CompiledOp Timed(absl::Duration* timer, std::function<absl::Status()> fn) {
  return [timer, fn = std::move(fn)](const RunContext&) {
    const absl::Time start = absl::Now();
    absl::Status s = fn();
    *timer += absl::Now() - start;
    return s;
  };
}

// jax.lax.all_gather(x, axis=op.dim, tiled=op.tiled) over comm's group.
absl::StatusOr<Executor::CompiledOp> CompileAllGather(const v1::Op& op, Communicator* comm,
                                                      const Tensor* x, Tensor* y,
                                                      absl::Duration* timer) {
  const int64_t n = comm->size();
  const Dims& d = x->dims();
  const DType dtype = x->dtype();
  const size_t elem = DTypeSize(dtype);
  const int64_t a = op.dim();
  if (a < 0 || a > static_cast<int64_t>(d.size()) ||
      (op.tiled() && a == static_cast<int64_t>(d.size()))) {
    return absl::InvalidArgumentError(
        absl::StrCat("all_gather axis ", a, " is out of range for ", DimsToString(d)));
  }
  Dims expected = d;
  if (op.tiled()) {
    expected[a] *= n;
  } else {
    expected.insert(expected.begin() + a, n);
  }
  if (y->dims() != expected) return OpOutputMismatch(op, *y, DimsToString(expected));
  const int64_t outer = NumElements(d, 0, a), inner = NumElements(d, a, d.size());
  if (outer == 1) {  // the blocks are already in the result's order: gather straight into it
    return Timed(timer,
                 [=] { return comm->AllGather(x->raw(), x->num_elements(), dtype, y->raw()); });
  }
  auto scratch = std::make_shared<std::vector<char>>(n * x->size_bytes());
  return Timed(timer, [=] {
    // Gather blocks as [n, outer, inner], then move the group axis inside: [outer, n, inner].
    if (absl::Status s = comm->AllGather(x->raw(), x->num_elements(), dtype, scratch->data());
        !s.ok())
      return s;
    SwapLeadingAxes(scratch->data(), n, outer, inner, elem, y->raw());
    return absl::OkStatus();
  });
}

// jax.lax.psum_scatter(x, scatter_dimension=op.dim, tiled=op.tiled) over comm's group.
absl::StatusOr<Executor::CompiledOp> CompilePsumScatter(const v1::Op& op, Communicator* comm,
                                                        const Tensor* x, Tensor* y,
                                                        absl::Duration* timer) {
  const int64_t n = comm->size();
  const Dims& d = x->dims();
  const DType dtype = x->dtype();
  const size_t elem = DTypeSize(dtype);
  const int64_t s_dim = op.dim();
  if (s_dim < 0 || s_dim >= static_cast<int64_t>(d.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("psum_scatter dimension ", s_dim, " is out of range for ", DimsToString(d)));
  }
  if (op.tiled() ? d[s_dim] % n != 0 : d[s_dim] != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("psum_scatter: dim ", s_dim, " of ", DimsToString(d), " (", d[s_dim],
                     ") must be ", op.tiled() ? "divisible by" : "equal to", " the axis size ", n));
  }
  Dims expected = d;
  if (op.tiled()) {
    expected[s_dim] /= n;
  } else {
    expected.erase(expected.begin() + s_dim);
  }
  if (y->dims() != expected) return OpOutputMismatch(op, *y, DimsToString(expected));
  const int64_t outer = NumElements(d, 0, s_dim),
                block = x->num_elements() / std::max<int64_t>(1, outer * n);
  if (outer == 1) {  // block j of the scatter dim is already flat block j: no repacking
    return Timed(timer, [=] {
      return comm->ReduceScatter(x->raw(), block, dtype, ReduceOp::kSum, y->raw());
    });
  }
  // A Tensor, so a large one lives where peers can read it (the direct psum_scatter).
  auto packed = std::make_shared<Tensor>(Tensor::Uninitialized(dtype, {x->num_elements()}));
  return Timed(timer, [=] {
    // [outer, n, block] -> [n, outer, block]: block j of the scatter dim becomes flat block j.
    SwapLeadingAxes(x->raw(), outer, n, block, elem, packed->raw());
    return comm->ReduceScatter(packed->raw(), outer * block, dtype, ReduceOp::kSum, y->raw());
  });
}

// jax.lax.ppermute(x, perm=op.perm's (source, destination) pairs) over comm's group.
absl::StatusOr<Executor::CompiledOp> CompilePpermute(const v1::Op& op, Communicator* comm,
                                                     const Tensor* x, Tensor* y,
                                                     absl::Duration* timer) {
  const int64_t n = comm->size();
  const Dims& d = x->dims();
  const DType dtype = x->dtype();
  if (y->dims() != d) return OpOutputMismatch(op, *y, DimsToString(d));
  if (op.perm_size() % 2 != 0)
    return absl::InvalidArgumentError("ppermute perm must hold (source, destination) pairs");
  std::vector<std::pair<int, int>> perm;
  for (int i = 0; i < op.perm_size(); i += 2) perm.emplace_back(op.perm(i), op.perm(i + 1));
  if (absl::Status s = ValidatePermutation(perm, static_cast<int>(n)); !s.ok()) return s;
  return Timed(timer,
               [=] { return comm->Permute(x->raw(), x->num_elements(), dtype, perm, y->raw()); });
}

// jax.lax.all_to_all(x, split_axis=op.split_dim, concat_axis=op.concat_dim) over comm's group.
absl::StatusOr<Executor::CompiledOp> CompileAllToAll(const v1::Op& op, Communicator* comm,
                                                     const Tensor* x, Tensor* y,
                                                     absl::Duration* timer) {
  const int64_t n = comm->size();
  const Dims& d = x->dims();
  const DType dtype = x->dtype();
  const size_t elem = DTypeSize(dtype);
  const int64_t sd = op.split_dim(), cd = op.concat_dim();
  if (sd < 0 || cd < 0 || sd >= static_cast<int64_t>(d.size()) ||
      cd >= static_cast<int64_t>(d.size()) || d[sd] % n != 0) {
    return absl::InvalidArgumentError(absl::StrCat("all_to_all: split_axis ", sd,
                                                   " and concat_axis ", cd, " do not fit ",
                                                   DimsToString(d), " over an axis of size ", n));
  }
  Dims block = d;
  block[sd] /= n;
  Dims expected = block;
  expected[cd] *= n;
  if (y->dims() != expected) return OpOutputMismatch(op, *y, DimsToString(expected));
  const int64_t outer_s = NumElements(d, 0, sd),
                inner_s = x->num_elements() / std::max<int64_t>(1, outer_s * n);
  const int64_t outer_c = NumElements(block, 0, cd), inner_c = NumElements(block, cd, block.size());
  auto packed = std::make_shared<std::vector<char>>(x->size_bytes());
  auto received = std::make_shared<std::vector<char>>(x->size_bytes());
  return Timed(timer, [=] {
    SwapLeadingAxes(x->raw(), outer_s, n, inner_s, elem, packed->data());
    if (absl::Status s =
            comm->AllToAll(packed->data(), x->num_elements() / n, dtype, received->data());
        !s.ok()) {
      return s;
    }
    SwapLeadingAxes(received->data(), n, outer_c, inner_c, elem, y->raw());
    return absl::OkStatus();
  });
}

}  // namespace

absl::StatusOr<Executor::CompiledOp> Executor::CompileCollective(const v1::Op& op,
                                                                 const std::vector<Tensor*>& in,
                                                                 const std::vector<Tensor*>& out) {
  std::vector<std::string> axes(op.axis_names().begin(), op.axis_names().end());
  absl::StatusOr<Communicator*> comm_or = CommunicatorFor(axes);
  if (!comm_or.ok()) return comm_or.status();
  Communicator* comm = *comm_or;
  if ((op.kind() == v1::OP_PSUM || op.kind() == v1::OP_PMEAN) && op.inputs_size() > 1) {
    return CompileBucketReduction(op, comm, in, out);
  }
  if (absl::Status s = OpArity(op, 1, 1); !s.ok()) return s;
  const Tensor* x = in[0];
  Tensor* y = out[0];
  const Dims& d = x->dims();
  const DType dtype = x->dtype();
  if (y->dtype() != dtype) return OpOutputMismatch(op, *y, DTypeName(dtype));
  absl::Duration* timer = &collective_time_;
  switch (op.kind()) {
    case v1::OP_PSUM:
    case v1::OP_PMEAN:
    case v1::OP_PMAX: {
      if (y->dims() != d) return OpOutputMismatch(op, *y, DimsToString(d));
      const ReduceOp rop = op.kind() == v1::OP_PSUM    ? ReduceOp::kSum
                           : op.kind() == v1::OP_PMEAN ? ReduceOp::kMean
                                                       : ReduceOp::kMax;
      if (reduce_in_place_.count(&op)) {
        views_.insert(op.outputs(0));  // its memory is the input's, re-pointed at each run
        return Timed(timer, [=] {
          y->ShareMemory(*x, 0);
          return comm->AllReduce(y->raw(), y->num_elements(), dtype, rop);
        });
      }
      return Timed(timer, [=] {
        std::memcpy(y->raw(), x->raw(), x->size_bytes());
        return comm->AllReduce(y->raw(), y->num_elements(), dtype, rop);
      });
    }
    case v1::OP_ALL_GATHER:
      return CompileAllGather(op, comm, x, y, timer);
    case v1::OP_PSUM_SCATTER:
      return CompilePsumScatter(op, comm, x, y, timer);
    case v1::OP_PPERMUTE:
      return CompilePpermute(op, comm, x, y, timer);
    case v1::OP_ALL_TO_ALL:
      return CompileAllToAll(op, comm, x, y, timer);
    default:
      return absl::InvalidArgumentError(absl::StrCat("unsupported collective op kind ", op.kind()));
  }
}

absl::StatusOr<Executor::CompiledOp> Executor::CompileBucketReduction(
    const v1::Op& op, Communicator* comm, const std::vector<Tensor*>& in,
    const std::vector<Tensor*>& out) {
  if (in.size() != out.size()) {
    return absl::InvalidArgumentError(absl::StrCat(v1::OpKind_Name(op.kind()), " of ", in.size(),
                                                   " operands has ", out.size(), " results"));
  }
  int64_t total = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i]->dtype() != v1::DTYPE_F32 || out[i]->dtype() != v1::DTYPE_F32 ||
        in[i]->dims() != out[i]->dims()) {
      return OpOutputMismatch(op, *out[i], absl::StrCat("f32", DimsToString(in[i]->dims())));
    }
    total += in[i]->num_elements();
  }
  // One all-reduce of the operands side by side, as DDP's buckets: one round of messages for
  // all of them.
  // fn: one letter per operand, 's' its sum or 'm' its mean over the group (one psum of the
  // bucket, the means divided by the group's size afterwards, as pmean does).
  const std::string kinds =
      op.fn().empty() ? std::string(in.size(), op.kind() == v1::OP_PMEAN ? 'm' : 's') : op.fn();
  if (kinds.size() != in.size() || kinds.find_first_not_of("sm") != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "combined reduction of ", in.size(), " operands: fn '", kinds, "' is not one s or m each"));
  }
  auto bucket = std::make_shared<Tensor>(v1::DTYPE_F32, Dims{total});
  const float inv = 1.0f / static_cast<float>(comm->size());
  absl::Duration* timer = &collective_time_;
  return CompiledOp([=](const RunContext&) -> absl::Status {
    const absl::Time start = absl::Now();
    PackBucket(in, bucket->data<float>());
    absl::Status s = comm->AllReduce(bucket->raw(), total, v1::DTYPE_F32, ReduceOp::kSum);
    UnpackBucket(bucket->data<float>(), out, kinds, inv);
    *timer += absl::Now() - start;
    return s;
  });
}

}  // namespace meshrun
