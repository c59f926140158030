// Compiling the shard_map ops that move data (core/array_ops): broadcast, reshape, transpose,
// concatenate, slices and dynamic slices (as views of their input where they can be), conversions,
// fills, rev and iota.
#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/array_ops.h"
#include "worker/executor.h"
#include "worker/kernels/kernel.h"

namespace meshrun {
namespace {

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

// broadcast_in_dim after its reshape: each dim of x is 1 or y's.
absl::StatusOr<Executor::CompiledOp> CompileBroadcast(const v1::Op& op,
                                                      const std::vector<Tensor*>& in,
                                                      const std::vector<Tensor*>& out) {
  if (absl::Status s = OpArity(op, 1, 1); !s.ok()) return s;
  const Tensor* x = in[0];
  Tensor* y = out[0];
  bool ok = x->dims().size() == y->dims().size() && x->dtype() == y->dtype();
  for (size_t d = 0; ok && d < x->dims().size(); ++d)
    ok = x->dims()[d] == 1 || x->dims()[d] == y->dims()[d];
  if (!ok)
    return OpOutputMismatch(op, *y, absl::StrCat("a broadcast of ", DimsToString(x->dims())));
  return Executor::CompiledOp([x, y](const RunContext&) {
    Broadcast(*x, *y);
    return absl::OkStatus();
  });
}

// transpose by op.perm, a permutation of x's dims.
absl::StatusOr<Executor::CompiledOp> CompileTranspose(const v1::Op& op,
                                                      const std::vector<Tensor*>& in,
                                                      const std::vector<Tensor*>& out) {
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
  return Executor::CompiledOp([x, y, perm](const RunContext&) {
    Transpose(*x, perm, *y);
    return absl::OkStatus();
  });
}

// concatenate along op.dim; parts the executor placed in y already are not copied.
absl::StatusOr<Executor::CompiledOp> CompileConcatenate(const v1::Op& op,
                                                        const std::vector<Tensor*>& in,
                                                        const std::vector<Tensor*>& out) {
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
  return Executor::CompiledOp([xs, y, dim, leading](const RunContext&) {
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

// convert_element_type: oneDNN's reorder for f32 <-> bf16 where it has one, else Convert.
absl::StatusOr<Executor::CompiledOp> CompileConvert(const v1::Op& op,
                                                    const std::vector<Tensor*>& in,
                                                    const std::vector<Tensor*>& out) {
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
  return Executor::CompiledOp([x, y](const RunContext&) {
    Convert(*x, *y);
    return absl::OkStatus();
  });
}

// bitcast_convert_type between dtypes of one width.
absl::StatusOr<Executor::CompiledOp> CompileBitcastConvert(const v1::Op& op,
                                                           const std::vector<Tensor*>& in,
                                                           const std::vector<Tensor*>& out) {
  if (absl::Status s = OpArity(op, 1, 1); !s.ok()) return s;
  const Tensor* x = in[0];
  Tensor* y = out[0];
  if (x->dims() != y->dims() || DTypeSize(x->dtype()) != DTypeSize(y->dtype())) {
    return OpOutputMismatch(
        op, *y,
        absl::StrCat("a dtype of ", DTypeName(x->dtype()), "'s width, ", DimsToString(x->dims())));
  }
  return Executor::CompiledOp([x, y](const RunContext&) {
    if (x->raw() != y->raw()) std::memcpy(y->raw(), x->raw(), x->size_bytes());
    return absl::OkStatus();
  });
}

// y filled with op.value.
absl::StatusOr<Executor::CompiledOp> CompileFillValue(const v1::Op& op,
                                                      const std::vector<Tensor*>& in,
                                                      const std::vector<Tensor*>& out) {
  if (absl::Status s = OpArity(op, 0, 1); !s.ok()) return s;
  Tensor* y = out[0];
  const double value = op.value();
  return Executor::CompiledOp([y, value](const RunContext&) {
    FillFromDouble(*y, 0, y->num_elements(), value);
    return absl::OkStatus();
  });
}

// rev along op.dims.
absl::StatusOr<Executor::CompiledOp> CompileReverse(const v1::Op& op,
                                                    const std::vector<Tensor*>& in,
                                                    const std::vector<Tensor*>& out) {
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
  return Executor::CompiledOp([x, y, dims](const RunContext&) {
    Reverse(*x, dims, *y);
    return absl::OkStatus();
  });
}

// iota along op.dim.
absl::StatusOr<Executor::CompiledOp> CompileIota(const v1::Op& op, const std::vector<Tensor*>& in,
                                                 const std::vector<Tensor*>& out) {
  if (absl::Status s = OpArity(op, 0, 1); !s.ok()) return s;
  Tensor* y = out[0];
  const int64_t dim = op.dim();
  if (dim < 0 || dim >= static_cast<int64_t>(y->dims().size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("iota along dim ", dim, " of ", DimsToString(y->dims())));
  }
  const int64_t inner = NumElements(y->dims(), dim + 1, y->dims().size()), size = y->dims()[dim];
  return Executor::CompiledOp([y, inner, size](const RunContext&) {
    // One period (size runs of `inner` equal values), then copied over the rest: one
    // conversion per value rather than a division and a conversion per element.
    const int64_t n = y->num_elements();
    if (n == 0) return absl::OkStatus();
    for (int64_t v = 0; v < size; ++v) FillFromDouble(*y, v * inner, inner, static_cast<double>(v));
    char* base = static_cast<char*>(y->raw());
    const size_t period = size * inner * DTypeSize(y->dtype());
    for (int64_t p = 1; p < n / (size * inner); ++p) std::memcpy(base + p * period, base, period);
    return absl::OkStatus();
  });
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

std::optional<int64_t> SliceBlockOffset(const v1::Op& op, const Dims& xd, const Dims& yd) {
  const int64_t rank = static_cast<int64_t>(xd.size());
  if (op.kind() != v1::OP_SLICE || static_cast<int64_t>(yd.size()) != rank ||
      op.starts_size() != rank)
    return std::nullopt;
  // The block is contiguous when the dims before its first partial one are single indices and
  // those after it are whole.
  int64_t partial = 0;
  while (partial < rank && yd[partial] == 1) ++partial;
  if (partial == rank) partial = rank - 1;
  for (int64_t d = partial + 1; d < rank; ++d) {
    if (yd[d] != xd[d]) return std::nullopt;
  }
  int64_t offset = 0, stride = 1;
  for (int64_t d = rank - 1; d >= 0; --d) {
    offset += op.starts(d) * stride;
    stride *= xd[d];
  }
  return offset;
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
      const std::optional<int64_t> offset = SliceBlockOffset(op, xd, yd);
      if (!offset.has_value()) break;
      const size_t byte_offset = *offset * elem;
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

absl::StatusOr<Executor::CompiledOp> Executor::CompileLayout(const v1::Op& op,
                                                             const std::vector<Tensor*>& in,
                                                             const std::vector<Tensor*>& out) {
  switch (op.kind()) {
    case v1::OP_BROADCAST:
      return CompileBroadcast(op, in, out);
    case v1::OP_TRANSPOSE:
      return CompileTranspose(op, in, out);
    case v1::OP_CONCATENATE:
      return CompileConcatenate(op, in, out);
    case v1::OP_CONVERT:
      if (auto block = bf16_copy_converts_.find(&op); block != bf16_copy_converts_.end()) {
        views_.insert(op.outputs(0));  // another's memory or its own, never the buffer's
        return CompileConvertReadingCopy(buffer(block->second.root), block->second.offset, in[0],
                                         out[0]);
      }
      return CompileConvert(op, in, out);
    case v1::OP_BITCAST_CONVERT:
      return CompileBitcastConvert(op, in, out);
    case v1::OP_FILL_VALUE:
      return CompileFillValue(op, in, out);
    case v1::OP_REVERSE:
      return CompileReverse(op, in, out);
    case v1::OP_IOTA:
      return CompileIota(op, in, out);
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
    default:
      return absl::InvalidArgumentError(absl::StrCat("unsupported op kind ", op.kind()));
  }
}

}  // namespace meshrun
