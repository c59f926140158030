// ShardMapBuilder's per-block layout ops (core/spmd/shard_map.h): reshape, broadcast, transpose,
// concatenate, stack, conversions, cumulative ops, sort, rev, slices, dynamic slices and iota.
#include "absl/strings/str_cat.h"
#include "core/spmd/shard_map.h"
#include "core/spmd/shard_map_internal.h"

namespace meshrun {

using shard_map_internal::MakeOp;

ShardMapBuilder::Value ShardMapBuilder::Reshape(Value x, const Dims& dims) {
  if (!Valid(x)) return {};
  if (!Check(NumElements(dims) == NumElements(shape(x)),
             absl::StrCat("reshape ", DimsToString(shape(x)), " to ", DimsToString(dims)))) {
    return {};
  }
  if (dims == shape(x)) return x;  // values are immutable: the same array
  return Add(MakeOp(v1::OP_RESHAPE, {Name(x)}), dtype(x), dims);
}

ShardMapBuilder::Value ShardMapBuilder::BroadcastTo(Value x, const Dims& dims) {
  if (!Valid(x)) return {};
  Dims from = shape(x);
  if (from.size() < dims.size()) {
    from.insert(from.begin(), dims.size() - from.size(), 1);
    x = Reshape(x, from);
  }
  bool ok = from.size() == dims.size();
  for (size_t i = 0; ok && i < dims.size(); ++i) ok = from[i] == 1 || from[i] == dims[i];
  if (!Check(ok, absl::StrCat("broadcast ", DimsToString(shape(x)), " to ", DimsToString(dims))))
    return {};
  return Add(MakeOp(v1::OP_BROADCAST, {Name(x)}), dtype(x), dims);
}

ShardMapBuilder::Value ShardMapBuilder::Transpose(Value x, const std::vector<int64_t>& perm) {
  if (!Valid(x)) return {};
  Dims out;
  for (int64_t p : perm) {
    if (!Check(p >= 0 && p < static_cast<int64_t>(shape(x).size()), "transpose: bad perm"))
      return {};
    out.push_back(shape(x)[p]);
  }
  v1::Op op = MakeOp(v1::OP_TRANSPOSE, {Name(x)});
  for (int64_t p : perm) op.add_perm(p);
  return Add(std::move(op), dtype(x), out);
}

ShardMapBuilder::Value ShardMapBuilder::Concatenate(const std::vector<Value>& values, int64_t dim) {
  if (!Check(!values.empty(), "concatenate of nothing")) return {};
  std::vector<std::string> names;
  Dims out = shape(values[0]);
  if (!Check(dim >= 0 && dim < static_cast<int64_t>(out.size()), "concatenate: dim out of range"))
    return {};
  out[dim] = 0;
  for (Value v : values) {
    if (!Valid(v)) return {};
    Dims d = shape(v), ref = shape(values[0]);
    d[dim] = ref[dim] = 0;
    if (!Check(d == ref && dtype(v) == dtype(values[0]),
               "concatenate: shapes differ off the concat dim"))
      return {};
    out[dim] += shape(v)[dim];
    names.push_back(Name(v));
  }
  v1::Op op = MakeOp(v1::OP_CONCATENATE, names);
  op.set_dim(dim);
  return Add(std::move(op), dtype(values[0]), out);
}

ShardMapBuilder::Value ShardMapBuilder::Stack(const std::vector<Value>& values, int64_t dim) {
  std::vector<Value> expanded;
  for (Value v : values) {
    if (!Valid(v)) return {};
    Dims d = shape(v);
    if (!Check(dim >= 0 && dim <= static_cast<int64_t>(d.size()), "stack: dim out of range"))
      return {};
    d.insert(d.begin() + dim, 1);
    expanded.push_back(Reshape(v, d));
  }
  return Concatenate(expanded, dim);
}

ShardMapBuilder::Value ShardMapBuilder::Convert(Value x, DType dtype) {
  if (!Valid(x)) return {};
  return Add(MakeOp(v1::OP_CONVERT, {Name(x)}), dtype, shape(x));
}

ShardMapBuilder::Value ShardMapBuilder::ToF32(Value v) {
  if (dtype(v) != v1::DTYPE_BF16) return v;  // (an invalid value too: its dtype is unset)
  v1::Op op = MakeOp(v1::OP_CONVERT, {Name(v)});
  op.set_widened(true);
  return Add(std::move(op), v1::DTYPE_F32, shape(v));
}

ShardMapBuilder::Value ShardMapBuilder::Cumulative(Value x, const std::string& fn, int64_t dim,
                                                   bool reverse) {
  if (!Valid(x)) return {};
  if (!Check(dim >= 0 && dim < static_cast<int64_t>(shape(x).size()),
             absl::StrCat("cumulative ", fn, " along dim ", dim, " of ", DimsToString(shape(x)))))
    return {};
  const DType original = dtype(x);
  x = ToF32(x);
  v1::Op op = MakeOp(v1::OP_CUMULATIVE, {Name(x)});
  op.set_fn(fn);
  op.set_dim(dim);
  op.set_tiled(reverse);
  return Restore(Add(std::move(op), dtype(x), shape(x)), original);
}

ShardMapBuilder::Value ShardMapBuilder::Sort(const std::vector<Value>& operands, int64_t dim,
                                             int num_keys, int result) {
  for (Value v : operands)
    if (!Valid(v)) return {};
  bool ok = !operands.empty() && num_keys >= 1 && num_keys <= static_cast<int>(operands.size()) &&
            result >= 0 && result < static_cast<int>(operands.size());
  for (size_t i = 0; ok && i < operands.size(); ++i)
    ok = shape(operands[i]) == shape(operands[0]) && DTypeSize(dtype(operands[i])) == 4;
  ok = ok && dim >= 0 && dim < static_cast<int64_t>(shape(operands[0]).size());
  if (!Check(ok, absl::StrCat("sort along dim ", dim, " of ", operands.size(), " operands, ",
                              num_keys, " keys: expected 4-byte operands of one shape")))
    return {};
  std::vector<std::string> inputs;
  for (Value v : operands) inputs.push_back(Name(v));
  v1::Op op = MakeOp(v1::OP_SORT, inputs);
  op.set_dim(dim);
  op.set_sort_keys(num_keys);
  op.set_sort_result(result);
  return Add(std::move(op), dtype(operands[result]), shape(operands[0]));
}

ShardMapBuilder::Value ShardMapBuilder::Reverse(Value x, const std::vector<int64_t>& dims) {
  if (!Valid(x)) return {};
  for (int64_t d : dims) {
    if (!Check(d >= 0 && d < static_cast<int64_t>(shape(x).size()),
               absl::StrCat("rev of dim ", d, " of ", DimsToString(shape(x)))))
      return {};
  }
  v1::Op op = MakeOp(v1::OP_REVERSE, {Name(x)});
  for (int64_t d : dims) op.add_dims(d);
  return Add(std::move(op), dtype(x), shape(x));
}

ShardMapBuilder::Value ShardMapBuilder::BitcastConvert(Value x, DType dtype) {
  if (!Valid(x)) return {};
  if (!Check(DTypeSize(dtype) == DTypeSize(this->dtype(x)) && DTypeSize(dtype) == 4,
             absl::StrCat("bitcast_convert_type ", DTypeName(this->dtype(x)), " to ",
                          DTypeName(dtype), ": expected two of f32, i32, u32")))
    return {};
  return Add(MakeOp(v1::OP_BITCAST_CONVERT, {Name(x)}), dtype, shape(x));
}

ShardMapBuilder::Value ShardMapBuilder::DynamicSlice(Value x, const std::vector<Value>& starts,
                                                     const Dims& sizes) {
  if (!Valid(x)) return {};
  for (Value s : starts)
    if (!Valid(s)) return {};
  const Dims dims = shape(x);
  bool ok = starts.size() == dims.size() && sizes.size() == dims.size();
  for (size_t d = 0; ok && d < dims.size(); ++d)
    ok = sizes[d] >= 0 && sizes[d] <= dims[d] && NumElements(shape(starts[d])) == 1;
  if (!Check(ok, absl::StrCat("dynamic_slice ", DimsToString(sizes), " of ", DimsToString(dims),
                              " with ", starts.size(), " scalar starts")))
    return {};
  std::vector<std::string> inputs = {Name(x)};
  for (Value s : starts) inputs.push_back(Name(s));
  return Add(MakeOp(v1::OP_DYNAMIC_SLICE_ND, inputs), dtype(x), sizes);
}

ShardMapBuilder::Value ShardMapBuilder::DynamicUpdateSlice(Value x, Value update,
                                                           const std::vector<Value>& starts) {
  if (!Valid(x) || !Valid(update)) return {};
  for (Value s : starts)
    if (!Valid(s)) return {};
  const Dims dims = shape(x), block = shape(update);
  bool ok =
      starts.size() == dims.size() && block.size() == dims.size() && dtype(x) == dtype(update);
  for (size_t d = 0; ok && d < dims.size(); ++d)
    ok = block[d] <= dims[d] && NumElements(shape(starts[d])) == 1;
  if (!Check(ok, absl::StrCat("dynamic_update_slice of ", DTypeName(dtype(update)),
                              DimsToString(block), " into ", DTypeName(dtype(x)),
                              DimsToString(dims), " with ", starts.size(), " scalar starts")))
    return {};
  std::vector<std::string> inputs = {Name(x), Name(update)};
  for (Value s : starts) inputs.push_back(Name(s));
  return Add(MakeOp(v1::OP_DYNAMIC_UPDATE_SLICE, inputs), dtype(x), dims);
}

ShardMapBuilder::Value ShardMapBuilder::Slice(Value x, const std::vector<int64_t>& starts,
                                              const Dims& sizes) {
  if (!Valid(x)) return {};
  bool ok = starts.size() == shape(x).size() && sizes.size() == starts.size();
  for (size_t d = 0; ok && d < starts.size(); ++d)
    ok = starts[d] >= 0 && starts[d] + sizes[d] <= shape(x)[d];
  if (!Check(ok, absl::StrCat("slice ", DimsToString(sizes), " does not fit in ",
                              DimsToString(shape(x)))))
    return {};
  v1::Op op = MakeOp(v1::OP_SLICE, {Name(x)});
  for (int64_t s : starts) op.add_starts(s);
  return Add(std::move(op), dtype(x), sizes);
}

ShardMapBuilder::Value ShardMapBuilder::DynamicSliceInDim(Value x, Value index, int64_t size,
                                                          int64_t dim) {
  if (!Valid(x) || !Valid(index)) return {};
  Dims out = shape(x);
  if (!Check(dim >= 0 && dim < static_cast<int64_t>(out.size()) && size > 0 &&
                 out[dim] % size == 0 && NumElements(shape(index)) == 1,
             absl::StrCat("dynamic_slice_in_dim: size ", size, " along dim ", dim, " of ",
                          DimsToString(out)))) {
    return {};
  }
  out[dim] = size;
  v1::Op op = MakeOp(v1::OP_DYNAMIC_SLICE, {Name(x), Name(index)});
  op.set_dim(dim);
  return Add(std::move(op), dtype(x), out);
}

ShardMapBuilder::Value ShardMapBuilder::Iota(DType dtype, const Dims& dims, int64_t dim) {
  if (!Check(dim >= 0 && dim < static_cast<int64_t>(dims.size()), "iota: dim out of range"))
    return {};
  v1::Op op = MakeOp(v1::OP_IOTA, {});
  op.set_dim(dim);
  return Add(std::move(op), dtype, dims);
}

}  // namespace meshrun
