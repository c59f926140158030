// Compiling the shard_map ops: element-wise math and reductions on oneDNN, data movement from
// core/array_ops, and collectives with jax.lax's dim semantics on top of the flat collectives.
#include <algorithm>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/array_ops.h"
#include "core/collectives/permute.h"
#include "core/sharding/named_sharding.h"
#include "worker/executor.h"
#include "worker/kernels/kernel.h"
#include "worker/reduction_bucket.h"

namespace meshrun {

absl::Status OpArity(const v1::Op& op, int inputs, int outputs) {
  if ((inputs >= 0 && op.inputs_size() != inputs) || op.outputs_size() != outputs) {
    return absl::InvalidArgumentError(absl::StrCat(v1::OpKind_Name(op.kind()), " takes ", inputs,
                                                   " inputs and ", outputs, " outputs; got ",
                                                   op.inputs_size(), " and ", op.outputs_size()));
  }
  return absl::OkStatus();
}

absl::Status OpOutputMismatch(const v1::Op& op, const Tensor& got, const std::string& expected) {
  return absl::InvalidArgumentError(absl::StrCat(v1::OpKind_Name(op.kind()), ": output is ",
                                                 DTypeName(got.dtype()), DimsToString(got.dims()),
                                                 "; expected ", expected));
}

namespace {

int64_t Prod(const Dims& d, size_t begin, size_t end) {
  int64_t p = 1;
  for (size_t i = begin; i < end && i < d.size(); ++i) p *= d[i];
  return p;
}

Executor::CompiledOp FromKernel(absl::StatusOr<std::unique_ptr<Kernel>> k) {
  std::shared_ptr<Kernel> kernel = std::move(*k);
  return [kernel](const RunContext&) { return kernel ? kernel->Run() : absl::OkStatus(); };
}

// The start block of a dynamic_slice: y is block `index` of x's dim `dim` (blocks of y's size).
// Errors: OutOfRange naming the block when it is outside the dim.
absl::StatusOr<int64_t> DynamicSliceBlock(const Tensor& x, const Tensor& index, const Tensor& y,
                                          int64_t dim) {
  const int64_t i = static_cast<int64_t>(GetAsDouble(index, 0));
  const int64_t size = y.dims()[dim];
  if (i < 0 || (i + 1) * size > x.dims()[dim]) {
    return absl::OutOfRangeError(absl::StrCat("dynamic_slice start block ", i, " of size ", size,
                                              " is outside dim ", dim, " (", x.dims()[dim], ")"));
  }
  return i;
}

// The starts of a dynamic slice of `size` out of `dims`, read from `starts` (one scalar each)
// and clamped to [0, dim - size] as XLA does.
std::vector<int64_t> ClampedStarts(const std::vector<const Tensor*>& starts, const Dims& dims,
                                   const Dims& size) {
  std::vector<int64_t> out(dims.size());
  for (size_t d = 0; d < dims.size(); ++d) {
    const int64_t s = static_cast<int64_t>(GetAsDouble(*starts[d], 0));
    out[d] = std::clamp<int64_t>(s, 0, dims[d] - size[d]);
  }
  return out;
}

}  // namespace

absl::StatusOr<Executor::CompiledOp> Executor::CompileDynamicSlice(
    const v1::Op& op, const std::vector<Tensor*>& in, const std::vector<Tensor*>& out) {
  const bool update = op.kind() == v1::OP_DYNAMIC_UPDATE_SLICE;
  const int first_start = update ? 2 : 1;
  const Tensor* x = in.empty() ? nullptr : in[0];
  if (x == nullptr || op.outputs_size() != 1 ||
      op.inputs_size() != first_start + static_cast<int>(x->dims().size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        v1::OpKind_Name(op.kind()), " takes ", update ? "x, update" : "x",
        " and one start per dim of x, and one output; got ", op.inputs_size(), " inputs"));
  }
  std::vector<const Tensor*> starts(in.begin() + first_start, in.end());
  for (const Tensor* s : starts) {
    if (s->num_elements() != 1)
      return absl::InvalidArgumentError(absl::StrCat(v1::OpKind_Name(op.kind()), ": a start is ",
                                                     DimsToString(s->dims()),
                                                     "; expected a scalar"));
  }
  Tensor* y = out[0];
  const Tensor* block = update ? in[1] : y;  // the block's dims
  bool ok = block->dims().size() == x->dims().size() && block->dtype() == x->dtype();
  for (size_t d = 0; ok && d < x->dims().size(); ++d) ok = block->dims()[d] <= x->dims()[d];
  if (!ok || (update && (y->dims() != x->dims() || y->dtype() != x->dtype()))) {
    return OpOutputMismatch(
        op, *y,
        absl::StrCat("a block of ", DTypeName(x->dtype()), DimsToString(x->dims()), " (",
                     update ? "the update's dims" : "at most its dims", ")"));
  }
  if (!update) {
    return CompiledOp([x, y, starts](const RunContext&) {
      Slice(*x, ClampedStarts(starts, x->dims(), y->dims()), *y);
      return absl::OkStatus();
    });
  }
  return CompiledOp([x, block, y, starts](const RunContext&) {
    const std::vector<int64_t> at = ClampedStarts(starts, x->dims(), block->dims());
    if (x->raw() != y->raw()) std::memcpy(y->raw(), x->raw(), x->size_bytes());
    UpdateSlice(*block, at, *y);
    return absl::OkStatus();
  });
}

std::optional<Executor::CompiledOp> Executor::CompileView(const v1::Op& op, const Tensor* x,
                                                          Tensor* y) {
  if (!view_ops_.count(&op)) return std::nullopt;
  const Dims& xd = x->dims();
  const Dims& yd = y->dims();
  // Row-major strides of x, in elements.
  std::vector<int64_t> stride(xd.size(), 1);
  for (int d = static_cast<int>(xd.size()) - 2; d >= 0; --d) stride[d] = stride[d + 1] * xd[d + 1];
  // A block of x is contiguous when the dims before its first partial one are single indices and
  // those after it are whole.
  auto contiguous = [&](int64_t partial) {
    for (int64_t d = 0; d < static_cast<int64_t>(xd.size()); ++d) {
      if (d < partial && yd[d] != 1) return false;
      if (d > partial && yd[d] != xd[d]) return false;
    }
    return true;
  };
  const size_t elem = DTypeSize(x->dtype());
  views_.insert(op.outputs(0));
  switch (op.kind()) {
    case v1::OP_RESHAPE:
      return CompiledOp([x, y](const RunContext&) {
        y->ShareMemory(*x, 0);
        return absl::OkStatus();
      });
    case v1::OP_SLICE: {
      int64_t partial = 0;
      while (partial < static_cast<int64_t>(xd.size()) && yd[partial] == 1) ++partial;
      if (partial == static_cast<int64_t>(xd.size())) partial = static_cast<int64_t>(xd.size()) - 1;
      if (!contiguous(partial)) break;
      int64_t offset = 0;
      for (size_t d = 0; d < xd.size(); ++d) offset += op.starts(d) * stride[d];
      const size_t byte_offset = offset * elem;
      return CompiledOp([x, y, byte_offset](const RunContext&) {
        y->ShareMemory(*x, byte_offset);
        return absl::OkStatus();
      });
    }
    case v1::OP_DYNAMIC_SLICE: {
      const int64_t dim = op.dim();
      if (!contiguous(dim)) break;
      const Tensor* index = buffer(op.inputs(1));
      const size_t block_bytes = stride[dim] * yd[dim] * elem;
      return CompiledOp([x, y, index, dim, block_bytes](const RunContext&) {
        absl::StatusOr<int64_t> i = DynamicSliceBlock(*x, *index, *y, dim);
        if (!i.ok()) return i.status();
        y->ShareMemory(*x, *i * block_bytes);
        return absl::OkStatus();
      });
    }
    default:
      break;
  }
  views_.erase(op.outputs(0));
  return std::nullopt;
}

absl::StatusOr<Executor::CompiledOp> Executor::CompileGeneral(const v1::Op& op,
                                                              const std::vector<Tensor*>& in,
                                                              const std::vector<Tensor*>& out) {
  switch (op.kind()) {
    case v1::OP_UNARY: {
      if (absl::Status s = OpArity(op, 1, 1); !s.ok()) return s;
      auto k = CreateUnary(op.fn(), *in[0], *out[0], op.value());
      if (!k.ok()) return k.status();
      return FromKernel(std::move(k));
    }
    case v1::OP_SOFTMAX_CROSS_ENTROPY: {
      if (absl::Status s = OpArity(op, 2, 1); !s.ok()) return s;
      auto k = CreateSoftmaxCrossEntropy(*in[0], *in[1], *out[0]);
      if (!k.ok()) return k.status();
      return FromKernel(std::move(k));
    }
    case v1::OP_SOFTMAX_CROSS_ENTROPY_GRAD: {
      if (absl::Status s = OpArity(op, 3, 1); !s.ok()) return s;
      auto k = CreateSoftmaxCrossEntropyGrad(*in[0], *in[1], *in[2], *out[0]);
      if (!k.ok()) return k.status();
      return FromKernel(std::move(k));
    }
    case v1::OP_UNARY_GRAD: {
      if (absl::Status s = OpArity(op, 2, 1); !s.ok()) return s;
      auto k = CreateUnaryGrad(op.fn(), *in[0], *in[1], *out[0], op.grad_from_output());
      if (!k.ok()) return k.status();
      return FromKernel(std::move(k));
    }
    case v1::OP_SELECT: {  // a fused loop of one op
      if (absl::Status s = OpArity(op, 3, 1); !s.ok()) return s;
      auto k = CreateFusedElementwise({{"select", {0, 1, 2}}},
                                      std::vector<const Tensor*>(in.begin(), in.end()), {0}, out);
      if (!k.ok()) return k.status();
      return FromKernel(std::move(k));
    }
    case v1::OP_FUSED_ELEMENTWISE: {
      if (op.axis_names_size() > 0) return CompileFusedReduceUpdate(op, in, out);
      std::vector<FusedInstruction> instrs;
      for (const v1::FusedInstr& f : op.fused())
        instrs.push_back({f.fn(), std::vector<int>(f.args().begin(), f.args().end())});
      auto k = CreateFusedElementwise(
          instrs, std::vector<const Tensor*>(in.begin(), in.end()),
          std::vector<int>(op.fused_outputs().begin(), op.fused_outputs().end()), out);
      if (!k.ok()) return k.status();
      return FromKernel(std::move(k));
    }
    case v1::OP_BINARY: {
      if (absl::Status s = OpArity(op, 2, 1); !s.ok()) return s;
      auto k = CreateBinary(op.fn(), *in[0], *in[1], *out[0]);
      if (!k.ok()) return k.status();
      return FromKernel(std::move(k));
    }
    case v1::OP_REDUCE: {
      if (absl::Status s = OpArity(op, 1, 1); !s.ok()) return s;
      Dims expected = in[0]->dims();
      for (int64_t d : op.dims()) {
        if (d < 0 || d >= static_cast<int64_t>(expected.size())) {
          return absl::InvalidArgumentError(
              absl::StrCat("reduce over dim ", d, " of ", DimsToString(in[0]->dims())));
        }
        expected[d] = 1;
      }
      if (out[0]->dims() != expected) return OpOutputMismatch(op, *out[0], DimsToString(expected));
      auto k = CreateReduce(op.fn(), *in[0], *out[0]);
      if (!k.ok()) return k.status();
      return FromKernel(std::move(k));
    }
    case v1::OP_BROADCAST: {
      if (absl::Status s = OpArity(op, 1, 1); !s.ok()) return s;
      const Tensor* x = in[0];
      Tensor* y = out[0];
      bool ok = x->dims().size() == y->dims().size() && x->dtype() == y->dtype();
      for (size_t d = 0; ok && d < x->dims().size(); ++d)
        ok = x->dims()[d] == 1 || x->dims()[d] == y->dims()[d];
      if (!ok)
        return OpOutputMismatch(op, *y, absl::StrCat("a broadcast of ", DimsToString(x->dims())));
      return CompiledOp([x, y](const RunContext&) {
        Broadcast(*x, *y);
        return absl::OkStatus();
      });
    }
    case v1::OP_RESHAPE: {
      if (absl::Status s = OpArity(op, 1, 1); !s.ok()) return s;
      const Tensor* x = in[0];
      Tensor* y = out[0];
      if (x->num_elements() != y->num_elements() || x->dtype() != y->dtype()) {
        return OpOutputMismatch(
            op, *y, absl::StrCat(x->num_elements(), " elements of ", DTypeName(x->dtype())));
      }
      if (std::optional<CompiledOp> view = CompileView(op, x, y)) return *view;
      return CompiledOp([x, y](const RunContext&) {
        std::memcpy(y->raw(), x->raw(), x->size_bytes());
        return absl::OkStatus();
      });
    }
    case v1::OP_TRANSPOSE: {
      if (absl::Status s = OpArity(op, 1, 1); !s.ok()) return s;
      const Tensor* x = in[0];
      Tensor* y = out[0];
      std::vector<int64_t> perm(op.perm().begin(), op.perm().end());
      Dims expected;
      std::vector<bool> seen(x->dims().size(), false);
      for (int64_t p : perm) {
        if (p < 0 || p >= static_cast<int64_t>(seen.size()) || seen[p]) {
          return absl::InvalidArgumentError(
              absl::StrCat("transpose: perm is not a permutation of ", seen.size(), " dims"));
        }
        seen[p] = true;
        expected.push_back(x->dims()[p]);
      }
      if (y->dims() != expected || perm.size() != seen.size())
        return OpOutputMismatch(op, *y, DimsToString(expected));
      return CompiledOp([x, y, perm](const RunContext&) {
        Transpose(*x, perm, *y);
        return absl::OkStatus();
      });
    }
    case v1::OP_CONCATENATE: {
      if (absl::Status s = OpArity(op, -1, 1); !s.ok()) return s;
      std::vector<const Tensor*> xs(in.begin(), in.end());
      Tensor* y = out[0];
      const int64_t dim = op.dim();
      if (xs.empty() || dim < 0 || dim >= static_cast<int64_t>(y->dims().size())) {
        return absl::InvalidArgumentError(
            absl::StrCat("concatenate along dim ", dim, " of ", DimsToString(y->dims())));
      }
      for (const Tensor* x : xs) {
        if (x->dims().size() != y->dims().size() || x->dtype() != y->dtype()) {
          return OpOutputMismatch(op, *y,
                                  absl::StrCat("the concatenation of parts like ",
                                               DTypeName(x->dtype()), DimsToString(x->dims())));
        }
      }
      Dims expected = xs[0]->dims();
      expected[dim] = 0;
      for (const Tensor* x : xs) expected[dim] += x->dims()[dim];
      if (y->dims() != expected) return OpOutputMismatch(op, *y, DimsToString(expected));
      bool leading = true;  // parts are contiguous blocks of y
      for (int64_t d = 0; d < dim; ++d) leading = leading && y->dims()[d] == 1;
      return CompiledOp([xs, y, dim, leading](const RunContext&) {
        // Parts already computed in place (Executor::placements_) need no copy.
        const char* at = static_cast<const char*>(y->raw());
        bool in_place = leading;
        for (const Tensor* x : xs) {
          in_place = in_place && x->raw() == at;
          at += x->size_bytes();
        }
        if (!in_place) Concatenate(xs, dim, *y);
        return absl::OkStatus();
      });
    }
    case v1::OP_CONVERT: {
      if (absl::Status s = OpArity(op, 1, 1); !s.ok()) return s;
      const Tensor* x = in[0];
      Tensor* y = out[0];
      if (x->dims() != y->dims()) return OpOutputMismatch(op, *y, DimsToString(x->dims()));
      if (x->dtype() != y->dtype()) {
        // f32 <-> bf16 as oneDNN's reorder where it has bf16 (AVX512 core and up); other pairs,
        // or no bf16 reorder, the loop below.
        absl::StatusOr<std::unique_ptr<Kernel>> k = CreateConvert(*x, *y);
        if (k.ok()) return FromKernel(std::move(k));
      }
      return CompiledOp([x, y](const RunContext&) {
        Convert(*x, *y);
        return absl::OkStatus();
      });
    }
    case v1::OP_BITCAST_CONVERT: {
      if (absl::Status s = OpArity(op, 1, 1); !s.ok()) return s;
      const Tensor* x = in[0];
      Tensor* y = out[0];
      if (x->dims() != y->dims() || DTypeSize(x->dtype()) != DTypeSize(y->dtype())) {
        return OpOutputMismatch(op, *y,
                                absl::StrCat("a dtype of ", DTypeName(x->dtype()), "'s width, ",
                                             DimsToString(x->dims())));
      }
      return CompiledOp([x, y](const RunContext&) {
        if (x->raw() != y->raw()) std::memcpy(y->raw(), x->raw(), x->size_bytes());
        return absl::OkStatus();
      });
    }
    case v1::OP_ADAM_UPDATE:
      return CompileAdamUpdate(op, in, out);
    case v1::OP_RANDOM_INIT:
    case v1::OP_RANDOM_BITS:
    case v1::OP_DROPOUT_MASK:
    case v1::OP_FOLD_IN:
      return CompileRandom(op, in, out);
    case v1::OP_FILL_VALUE: {
      if (absl::Status s = OpArity(op, 0, 1); !s.ok()) return s;
      Tensor* y = out[0];
      const double value = op.value();
      return CompiledOp([y, value](const RunContext&) {
        for (int64_t i = 0; i < y->num_elements(); ++i) SetFromDouble(*y, i, value);
        return absl::OkStatus();
      });
    }
    case v1::OP_SLICE: {
      if (absl::Status s = OpArity(op, 1, 1); !s.ok()) return s;
      const Tensor* x = in[0];
      Tensor* y = out[0];
      std::vector<int64_t> starts(op.starts().begin(), op.starts().end());
      bool ok = starts.size() == x->dims().size() && y->dims().size() == x->dims().size() &&
                y->dtype() == x->dtype();
      for (size_t d = 0; ok && d < starts.size(); ++d)
        ok = starts[d] >= 0 && starts[d] + y->dims()[d] <= x->dims()[d];
      if (!ok) {
        return absl::InvalidArgumentError(absl::StrCat("slice of ", DimsToString(y->dims()),
                                                       " does not fit in ", DimsToString(x->dims()),
                                                       " at the given starts"));
      }
      if (std::optional<CompiledOp> view = CompileView(op, x, y)) return *view;
      return CompiledOp([x, y, starts](const RunContext&) {
        Slice(*x, starts, *y);
        return absl::OkStatus();
      });
    }
    case v1::OP_DYNAMIC_SLICE: {
      if (absl::Status s = OpArity(op, 2, 1); !s.ok()) return s;
      const Tensor* x = in[0];
      const Tensor* index = in[1];
      Tensor* y = out[0];
      const int64_t dim = op.dim();
      Dims expected = x->dims();
      if (dim < 0 || dim >= static_cast<int64_t>(expected.size()) || index->num_elements() != 1) {
        return absl::InvalidArgumentError(absl::StrCat("dynamic_slice along dim ", dim, " of ",
                                                       DimsToString(x->dims()),
                                                       " with a scalar start index"));
      }
      expected[dim] = y->dims().size() == expected.size() ? y->dims()[dim] : -1;
      if (y->dims() != expected || y->dtype() != x->dtype() ||
          x->dims()[dim] % y->dims()[dim] != 0) {
        return OpOutputMismatch(
            op, *y, absl::StrCat("a slice of ", DimsToString(x->dims()), " along dim ", dim));
      }
      if (std::optional<CompiledOp> view = CompileView(op, x, y)) return *view;
      return CompiledOp([x, index, y, dim](const RunContext&) {
        absl::StatusOr<int64_t> i = DynamicSliceBlock(*x, *index, *y, dim);
        if (!i.ok()) return i.status();
        std::vector<int64_t> starts(x->dims().size(), 0);
        starts[dim] = *i * y->dims()[dim];
        Slice(*x, starts, *y);
        return absl::OkStatus();
      });
    }
    case v1::OP_DYNAMIC_SLICE_ND:
    case v1::OP_DYNAMIC_UPDATE_SLICE:
      return CompileDynamicSlice(op, in, out);
    case v1::OP_SORT: {
      if (absl::Status s = OpArity(op, -1, 1); !s.ok()) return s;
      auto k = CreateSort(std::vector<const Tensor*>(in.begin(), in.end()), op.dim(),
                          op.sort_keys(), op.sort_result(), *out[0]);
      if (!k.ok()) return k.status();
      return FromKernel(std::move(k));
    }
    case v1::OP_REVERSE: {
      if (absl::Status s = OpArity(op, 1, 1); !s.ok()) return s;
      const Tensor* x = in[0];
      Tensor* y = out[0];
      std::vector<int64_t> dims(op.dims().begin(), op.dims().end());
      bool ok = y->dims() == x->dims() && y->dtype() == x->dtype();
      for (int64_t d : dims) ok = ok && d >= 0 && d < static_cast<int64_t>(x->dims().size());
      if (!ok) {
        return absl::InvalidArgumentError(absl::StrCat(
            "rev of dims (", absl::StrJoin(dims, ", "), ") of ", DTypeName(x->dtype()),
            DimsToString(x->dims()), " into ", DTypeName(y->dtype()), DimsToString(y->dims()),
            "; expected dims of x and an output of x's dtype and shape"));
      }
      return CompiledOp([x, y, dims](const RunContext&) {
        Reverse(*x, dims, *y);
        return absl::OkStatus();
      });
    }
    case v1::OP_CUMULATIVE: {
      if (absl::Status s = OpArity(op, 1, 1); !s.ok()) return s;
      auto k = CreateCumulative(op.fn(), op.dim(), op.tiled(), *in[0], *out[0]);
      if (!k.ok()) return k.status();
      return FromKernel(std::move(k));
    }
    case v1::OP_IOTA: {
      if (absl::Status s = OpArity(op, 0, 1); !s.ok()) return s;
      Tensor* y = out[0];
      const int64_t dim = op.dim();
      if (dim < 0 || dim >= static_cast<int64_t>(y->dims().size())) {
        return absl::InvalidArgumentError(
            absl::StrCat("iota along dim ", dim, " of ", DimsToString(y->dims())));
      }
      const int64_t inner = Prod(y->dims(), dim + 1, y->dims().size()), size = y->dims()[dim];
      return CompiledOp([y, inner, size](const RunContext&) {
        for (int64_t i = 0; i < y->num_elements(); ++i) SetFromDouble(*y, i, (i / inner) % size);
        return absl::OkStatus();
      });
    }
    case v1::OP_AXIS_INDEX: {
      if (absl::Status s = OpArity(op, 0, 1); !s.ok()) return s;
      std::vector<std::string> axes(op.axis_names().begin(), op.axis_names().end());
      absl::StatusOr<Communicator*> comm = CommunicatorFor(axes);
      if (!comm.ok()) return comm.status();
      if (out[0]->num_elements() != 1) return OpOutputMismatch(op, *out[0], "a scalar");
      Tensor* y = out[0];
      const int index = (*comm)->index();
      return CompiledOp([y, index](const RunContext&) {
        SetFromDouble(*y, 0, index);
        return absl::OkStatus();
      });
    }
    default:
      return absl::InvalidArgumentError(absl::StrCat("unsupported op kind ", op.kind()));
  }
}

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
  const int64_t n = comm->size();
  const Dims& d = x->dims();
  const DType dtype = x->dtype();
  const size_t elem = DTypeSize(dtype);
  if (y->dtype() != dtype) return OpOutputMismatch(op, *y, DTypeName(dtype));
  absl::Duration* timer = &collective_time_;
  auto timed = [timer](std::function<absl::Status()> fn) -> CompiledOp {
    return [timer, fn](const RunContext&) {
      const absl::Time start = absl::Now();
      absl::Status s = fn();
      *timer += absl::Now() - start;
      return s;
    };
  };
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
        return timed([=] {
          y->ShareMemory(*x, 0);
          return comm->AllReduce(y->raw(), y->num_elements(), dtype, rop);
        });
      }
      return timed([=] {
        std::memcpy(y->raw(), x->raw(), x->size_bytes());
        return comm->AllReduce(y->raw(), y->num_elements(), dtype, rop);
      });
    }
    case v1::OP_ALL_GATHER: {
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
      const int64_t outer = Prod(d, 0, a), inner = Prod(d, a, d.size());
      if (outer == 1) {  // the blocks are already in the result's order: gather straight into it
        return timed([=] { return comm->AllGather(x->raw(), x->num_elements(), dtype, y->raw()); });
      }
      auto scratch = std::make_shared<std::vector<char>>(n * x->size_bytes());
      return timed([=] {
        // Gather blocks as [n, outer, inner], then move the group axis inside: [outer, n, inner].
        if (absl::Status s = comm->AllGather(x->raw(), x->num_elements(), dtype, scratch->data());
            !s.ok())
          return s;
        SwapLeadingAxes(scratch->data(), n, outer, inner, elem, y->raw());
        return absl::OkStatus();
      });
    }
    case v1::OP_PSUM_SCATTER: {
      const int64_t s_dim = op.dim();
      if (s_dim < 0 || s_dim >= static_cast<int64_t>(d.size())) {
        return absl::InvalidArgumentError(absl::StrCat("psum_scatter dimension ", s_dim,
                                                       " is out of range for ", DimsToString(d)));
      }
      if (op.tiled() ? d[s_dim] % n != 0 : d[s_dim] != n) {
        return absl::InvalidArgumentError(absl::StrCat(
            "psum_scatter: dim ", s_dim, " of ", DimsToString(d), " (", d[s_dim], ") must be ",
            op.tiled() ? "divisible by" : "equal to", " the axis size ", n));
      }
      Dims expected = d;
      if (op.tiled()) {
        expected[s_dim] /= n;
      } else {
        expected.erase(expected.begin() + s_dim);
      }
      if (y->dims() != expected) return OpOutputMismatch(op, *y, DimsToString(expected));
      const int64_t outer = Prod(d, 0, s_dim),
                    block = x->num_elements() / std::max<int64_t>(1, outer * n);
      if (outer == 1) {  // block j of the scatter dim is already flat block j: no repacking
        return timed(
            [=] { return comm->ReduceScatter(x->raw(), block, dtype, ReduceOp::kSum, y->raw()); });
      }
      // A Tensor, so a large one lives where peers can read it (the direct psum_scatter).
      auto packed = std::make_shared<Tensor>(Tensor::Uninitialized(dtype, {x->num_elements()}));
      return timed([=] {
        // [outer, n, block] -> [n, outer, block]: block j of the scatter dim becomes flat block j.
        SwapLeadingAxes(x->raw(), outer, n, block, elem, packed->raw());
        return comm->ReduceScatter(packed->raw(), outer * block, dtype, ReduceOp::kSum, y->raw());
      });
    }
    case v1::OP_PPERMUTE: {
      if (y->dims() != d) return OpOutputMismatch(op, *y, DimsToString(d));
      if (op.perm_size() % 2 != 0)
        return absl::InvalidArgumentError("ppermute perm must hold (source, destination) pairs");
      std::vector<std::pair<int, int>> perm;
      for (int i = 0; i < op.perm_size(); i += 2) perm.emplace_back(op.perm(i), op.perm(i + 1));
      if (absl::Status s = ValidatePermutation(perm, static_cast<int>(n)); !s.ok()) return s;
      return timed(
          [=] { return comm->Permute(x->raw(), x->num_elements(), dtype, perm, y->raw()); });
    }
    case v1::OP_ALL_TO_ALL: {
      const int64_t sd = op.split_dim(), cd = op.concat_dim();
      if (sd < 0 || cd < 0 || sd >= static_cast<int64_t>(d.size()) ||
          cd >= static_cast<int64_t>(d.size()) || d[sd] % n != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("all_to_all: split_axis ", sd, " and concat_axis ", cd, " do not fit ",
                         DimsToString(d), " over an axis of size ", n));
      }
      Dims block = d;
      block[sd] /= n;
      Dims expected = block;
      expected[cd] *= n;
      if (y->dims() != expected) return OpOutputMismatch(op, *y, DimsToString(expected));
      const int64_t outer_s = Prod(d, 0, sd),
                    inner_s = x->num_elements() / std::max<int64_t>(1, outer_s * n);
      const int64_t outer_c = Prod(block, 0, cd), inner_c = Prod(block, cd, block.size());
      auto packed = std::make_shared<std::vector<char>>(x->size_bytes());
      auto received = std::make_shared<std::vector<char>>(x->size_bytes());
      return timed([=] {
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
