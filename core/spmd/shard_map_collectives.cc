// ShardMapBuilder: collectives over mesh axes, axis_index, and the random-key ops.
#include "absl/strings/str_cat.h"
#include "core/sharding/named_sharding.h"
#include "core/spmd/shard_map.h"
#include "core/spmd/shard_map_internal.h"

namespace meshrun {

using shard_map_internal::MakeOp;
using shard_map_internal::SetAxes;

ShardMapBuilder::Value ShardMapBuilder::RandomBits(Value key, const Dims& dims) {
  if (!Valid(key)) return {};
  if (!Check(dtype(key) == v1::DTYPE_U32 && NumElements(shape(key)) == 2,
             "random_bits takes a u32[2] key"))
    return {};
  return Add(MakeOp(v1::OP_RANDOM_BITS, {Name(key)}), v1::DTYPE_U32, dims);
}

ShardMapBuilder::Value ShardMapBuilder::RandomBitsBlock(Value key, const Dims& global_dims,
                                                        const PartitionSpec& spec,
                                                        const std::string& fn) {
  if (!Valid(key)) return {};
  if (!Check(dtype(key) == v1::DTYPE_U32 && NumElements(shape(key)) == 2,
             "random_bits takes a u32[2] key"))
    return {};
  const NamedSharding sharding(mesh_, spec);
  absl::Status fits = sharding.Validate(global_dims);
  if (!Check(fits.ok(), absl::StrCat("random_bits: ", fits.message()))) return {};
  v1::Op op = MakeOp(v1::OP_RANDOM_BITS, {Name(key)});
  op.set_fn(fn);
  for (int64_t d : global_dims) op.add_dims(d);
  *op.mutable_spec() = spec.ToProto();
  return Add(std::move(op), v1::DTYPE_U32, sharding.ShardDims(global_dims));
}

ShardMapBuilder::Value ShardMapBuilder::Threefry2x32(Value k0, Value k1, Value x0, Value x1,
                                                     int word) {
  const std::vector<Value> args = {k0, k1, x0, x1};
  for (Value v : args)
    if (!Valid(v)) return {};
  Dims out = shape(x0);  // the first operand of more than one element's shape
  for (Value v : args) {
    if (NumElements(shape(v)) != 1) {
      out = shape(v);
      break;
    }
  }
  for (Value v : args) {
    if (!Check(dtype(v) == v1::DTYPE_U32 && (shape(v) == out || NumElements(shape(v)) == 1),
               absl::StrCat("threefry2x32: operand ", DTypeName(dtype(v)), DimsToString(shape(v)),
                            "; expected u32 of shape ", DimsToString(out), " or one element")))
      return {};
  }
  v1::Op op = MakeOp(v1::OP_THREEFRY2X32, {Name(k0), Name(k1), Name(x0), Name(x1)});
  op.set_dim(word);
  return Add(std::move(op), v1::DTYPE_U32, out);
}

ShardMapBuilder::Value ShardMapBuilder::DropoutMask(Value key, const Dims& dims, float rate) {
  if (!Valid(key)) return {};
  if (!Check(dtype(key) == v1::DTYPE_U32 && NumElements(shape(key)) == 2,
             "dropout takes a u32[2] key"))
    return {};
  if (!Check(rate >= 0.0f && rate < 1.0f,
             absl::StrCat("dropout rate ", rate, ": expected 0 <= rate < 1")))
    return {};
  v1::Op op = MakeOp(v1::OP_DROPOUT_MASK, {Name(key)});
  op.set_rate(rate);
  return Add(std::move(op), v1::DTYPE_F32, dims);
}

ShardMapBuilder::Value ShardMapBuilder::AxisIndex(const std::vector<std::string>& axes) {
  absl::StatusOr<int> n = GroupSize(axes);
  if (!Check(n.ok(), absl::StrCat("axis_index: ", n.status().message()))) return {};
  v1::Op op = MakeOp(v1::OP_AXIS_INDEX, {});
  SetAxes(op, axes);
  return Add(std::move(op), v1::DTYPE_I32, {});
}

ShardMapBuilder::Value ShardMapBuilder::AllReduce(v1::OpKind kind, const char* name, Value x,
                                                  const std::vector<std::string>& axes) {
  if (!Valid(x)) return {};
  absl::StatusOr<int> n = GroupSize(axes);
  if (!Check(n.ok(), absl::StrCat(name, ": ", n.status().message()))) return {};
  v1::Op op = MakeOp(kind, {Name(x)});
  SetAxes(op, axes);
  return Add(std::move(op), dtype(x), shape(x));
}

ShardMapBuilder::Value ShardMapBuilder::Psum(Value x, const std::vector<std::string>& axes) {
  return AllReduce(v1::OP_PSUM, "psum", x, axes);
}
ShardMapBuilder::Value ShardMapBuilder::Pmean(Value x, const std::vector<std::string>& axes) {
  return AllReduce(v1::OP_PMEAN, "pmean", x, axes);
}
ShardMapBuilder::Value ShardMapBuilder::Pmax(Value x, const std::vector<std::string>& axes) {
  return AllReduce(v1::OP_PMAX, "pmax", x, axes);
}

ShardMapBuilder::Value ShardMapBuilder::AllGather(Value x, const std::vector<std::string>& axes,
                                                  int64_t axis, bool tiled) {
  if (!Valid(x)) return {};
  absl::StatusOr<int> n = GroupSize(axes);
  if (!Check(n.ok(), absl::StrCat("all_gather: ", n.status().message()))) return {};
  Dims out = shape(x);
  const int64_t rank = static_cast<int64_t>(out.size());
  if (!Check(axis >= 0 && (tiled ? axis < rank : axis <= rank),
             absl::StrCat("all_gather: axis ", axis, " out of range for ", DimsToString(out)))) {
    return {};
  }
  if (tiled) {
    out[axis] *= *n;
  } else {
    out.insert(out.begin() + axis, *n);
  }
  v1::Op op = MakeOp(v1::OP_ALL_GATHER, {Name(x)});
  SetAxes(op, axes);
  op.set_dim(axis);
  op.set_tiled(tiled);
  return Add(std::move(op), dtype(x), out);
}

ShardMapBuilder::Value ShardMapBuilder::PsumScatter(Value x, const std::vector<std::string>& axes,
                                                    int64_t scatter_dimension, bool tiled) {
  if (!Valid(x)) return {};
  absl::StatusOr<int> n = GroupSize(axes);
  if (!Check(n.ok(), absl::StrCat("psum_scatter: ", n.status().message()))) return {};
  Dims out = shape(x);
  const int64_t d = scatter_dimension;
  if (!Check(d >= 0 && d < static_cast<int64_t>(out.size()) &&
                 (tiled ? out[d] % *n == 0 : out[d] == *n),
             absl::StrCat("psum_scatter: dim ", d, " of ", DimsToString(out), " must be ",
                          tiled ? "divisible by" : "equal to", " the axis size ", *n))) {
    return {};
  }
  if (tiled) {
    out[d] /= *n;
  } else {
    out.erase(out.begin() + d);
  }
  v1::Op op = MakeOp(v1::OP_PSUM_SCATTER, {Name(x)});
  SetAxes(op, axes);
  op.set_dim(d);
  op.set_tiled(tiled);
  return Add(std::move(op), dtype(x), out);
}

ShardMapBuilder::Value ShardMapBuilder::Ppermute(Value x, const std::vector<std::string>& axes,
                                                 const std::vector<std::pair<int, int>>& perm) {
  if (!Valid(x)) return {};
  absl::StatusOr<int> n = GroupSize(axes);
  if (!Check(n.ok(), absl::StrCat("ppermute: ", n.status().message()))) return {};
  v1::Op op = MakeOp(v1::OP_PPERMUTE, {Name(x)});
  SetAxes(op, axes);
  for (const auto& [src, dst] : perm) {
    op.add_perm(src);
    op.add_perm(dst);
  }
  return Add(std::move(op), dtype(x), shape(x));
}

ShardMapBuilder::Value ShardMapBuilder::AllToAll(Value x, const std::vector<std::string>& axes,
                                                 int64_t split_axis, int64_t concat_axis) {
  if (!Valid(x)) return {};
  absl::StatusOr<int> n = GroupSize(axes);
  if (!Check(n.ok(), absl::StrCat("all_to_all: ", n.status().message()))) return {};
  Dims out = shape(x);
  const int64_t rank = static_cast<int64_t>(out.size());
  if (!Check(split_axis >= 0 && split_axis < rank && concat_axis >= 0 && concat_axis < rank &&
                 out[split_axis] % *n == 0,
             absl::StrCat("all_to_all: split_axis ", split_axis, " of ", DimsToString(out),
                          " must be divisible by the axis size ", *n))) {
    return {};
  }
  out[split_axis] /= *n;
  out[concat_axis] *= *n;
  v1::Op op = MakeOp(v1::OP_ALL_TO_ALL, {Name(x)});
  SetAxes(op, axes);
  op.set_split_dim(split_axis);
  op.set_concat_dim(concat_axis);
  return Add(std::move(op), dtype(x), out);
}

ShardMapBuilder::Value ShardMapBuilder::FoldIn(Value key, Value data) {
  if (!Valid(key) || !Valid(data)) return {};
  if (!Check(dtype(key) == v1::DTYPE_U32 && NumElements(shape(key)) == 2 &&
                 NumElements(shape(data)) == 1,
             "fold_in takes a u32[2] key and a scalar")) {
    return {};
  }
  return Add(MakeOp(v1::OP_FOLD_IN, {Name(key), Name(data)}), v1::DTYPE_U32, {2});
}

}  // namespace meshrun
