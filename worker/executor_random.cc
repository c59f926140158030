// Compiling JAX's PRNG ops (core/random/threefry.h): keys are u32[2] values, and a device draws
// only its own block of a global array, with the values the whole array's draw has there.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/array_ops.h"
#include "core/random/threefry.h"
#include "core/sharding/named_sharding.h"
#include "worker/executor.h"

namespace meshrun {
namespace {

// Where a device's block lies in a global array.
struct Block {
  Dims global;
  std::vector<int64_t> offsets;  // of the block's first element, per dim
};

// Calls fn(i, flat) for each element of `local` (the block at `b`): i its row-major index in
// the block, flat its row-major index in the global array.
template <typename Fn>
void ForEachGlobalIndex(const Block& b, const Dims& local, Fn fn) {
  const size_t rank = local.size();
  std::vector<int64_t> idx(rank, 0);
  const int64_t n = NumElements(local);
  for (int64_t i = 0; i < n; ++i) {
    int64_t flat = 0;
    for (size_t d = 0; d < rank; ++d) flat = flat * b.global[d] + b.offsets[d] + idx[d];
    fn(i, flat);
    for (size_t d = rank; d-- > 0;) {
      if (++idx[d] < local[d]) break;
      idx[d] = 0;
    }
  }
}

// Calls fn(i, flat, len) for each run along the last dimension of `local` (the block at `b`):
// elements i .. i + len of the block, row-major, are the global array's flat .. flat + len.
template <typename Fn>
void ForEachGlobalRun(const Block& b, const Dims& local, Fn fn) {
  if (local.empty()) {
    fn(0, 0, 1);
    return;
  }
  const int64_t len = local.back(), global_len = b.global.back(), offset = b.offsets.back();
  if (len == 0) return;
  const Block rows{Dims(b.global.begin(), b.global.end() - 1),
                   std::vector<int64_t>(b.offsets.begin(), b.offsets.end() - 1)};
  ForEachGlobalIndex(rows, Dims(local.begin(), local.end() - 1), [&](int64_t r, int64_t flat) {
    fn(r * len, flat * global_len + offset, len);
  });
}

absl::Status RequireKey(const v1::Op& op, const Tensor& key) {
  if (key.dtype() == v1::DTYPE_U32 && key.num_elements() == 2) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(v1::OpKind_Name(op.kind()), ": key is ",
                                                 DTypeName(key.dtype()), DimsToString(key.dims()),
                                                 "; expected u32[2]"));
}

PRNGKey KeyOf(const Tensor& key) { return {key.data<uint32_t>()[0], key.data<uint32_t>()[1]}; }

// This device's block of the global array of op.dims() laid out as op.spec(), or the whole of
// y when op.dims() is empty. Errors: InvalidArgument when y is not that block.
absl::StatusOr<Block> BlockOf(const v1::Op& op, const Tensor& y, DType dtype, const Mesh* mesh,
                              int rank) {
  if (op.dims().empty()) return Block{y.dims(), std::vector<int64_t>(y.dims().size(), 0)};
  Block b{Dims(op.dims().begin(), op.dims().end()), {}};
  if (mesh == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(v1::OpKind_Name(op.kind()), " of a global array needs the mesh"));
  }
  const NamedSharding sharding(*mesh, PartitionSpec::FromProto(op.spec()));
  if (absl::Status s = sharding.Validate(b.global); !s.ok()) return s;
  if (y.dtype() != dtype || y.dims() != sharding.ShardDims(b.global)) {
    return OpOutputMismatch(
        op, y,
        absl::StrCat(DTypeName(dtype), DimsToString(sharding.ShardDims(b.global)),
                     " (the block of ", DimsToString(b.global), " under ",
                     sharding.spec().ToString(), ")"));
  }
  b.offsets = sharding.ShardOffsets(b.global, rank);
  return b;
}

}  // namespace

namespace {

// jax.nn.initializers' zeros, ones, normal and truncated_normal (op.fn), scaled by op.scale: this
// rank's block of the global array op.dims, each element drawn from its global index.
absl::StatusOr<Executor::CompiledOp> CompileRandomInit(const v1::Op& op,
                                                       const std::vector<Tensor*>& in,
                                                       const std::vector<Tensor*>& out,
                                                       const Mesh* mesh, int rank) {
  if (absl::Status s = OpArity(op, 0, 1); !s.ok()) return s;
  Tensor* y = out[0];
  if (op.dims().empty() && y->num_elements() != 1) {
    return absl::InvalidArgumentError("OP_RANDOM_INIT: dims (the global shape) unset");
  }
  absl::StatusOr<Block> block = BlockOf(op, *y, v1::DTYPE_F32, mesh, rank);
  if (!block.ok()) return block.status();
  const std::string fn = op.fn();
  if (fn != "zeros" && fn != "ones" && fn != "normal" && fn != "truncated_normal") {
    return absl::InvalidArgumentError(absl::StrCat(
        "OP_RANDOM_INIT: unknown fn '", fn, "'; allowed: zeros, ones, normal, truncated_normal"));
  }
  if (op.key_size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("OP_RANDOM_INIT: key has ", op.key_size(), " words; expected 2"));
  }
  const PRNGKey key{op.key(0), op.key(1)};
  const float scale = op.scale();
  const int kind = fn == "zeros" ? 0 : fn == "ones" ? 1 : fn == "normal" ? 2 : 3;
  return Executor::CompiledOp([y, b = *block, key, kind, scale](const RunContext&) {
    const int64_t n = NumElements(b.global);
    float* o = y->data<float>();
    ForEachGlobalIndex(b, y->dims(), [&](int64_t i, int64_t flat) {
      switch (kind) {
        case 0:
          o[i] = 0.0f;
          break;
        case 1:
          o[i] = 1.0f;
          break;
        case 2:
          o[i] = NormalAt(key, n, flat, scale);
          break;
        default:
          o[i] = TruncatedNormalAt(key, n, flat, scale);
      }
    });
    return absl::OkStatus();
  });
}

// jax.random.bits (op.fn legacy, partitionable, or split: a key per pair of words) of the key
// in[0], this rank's block of the global array.
absl::StatusOr<Executor::CompiledOp> CompileRandomBits(const v1::Op& op,
                                                       const std::vector<Tensor*>& in,
                                                       const std::vector<Tensor*>& out,
                                                       const Mesh* mesh, int rank) {
  if (absl::Status s = OpArity(op, 1, 1); !s.ok()) return s;
  const Tensor* key = in[0];
  Tensor* y = out[0];
  if (absl::Status s = RequireKey(op, *key); !s.ok()) return s;
  absl::StatusOr<Block> block = BlockOf(op, *y, v1::DTYPE_U32, mesh, rank);
  if (!block.ok()) return block.status();
  const std::string fn = op.fn().empty() ? "legacy" : op.fn();
  if (fn != "legacy" && fn != "partitionable" && fn != "split") {
    return absl::InvalidArgumentError(absl::StrCat("OP_RANDOM_BITS: unknown fn '", fn,
                                                   "'; allowed: legacy, partitionable, split"));
  }
  if (fn == "split" && (block->global.empty() || block->global.back() != 2)) {
    return absl::InvalidArgumentError(absl::StrCat("OP_RANDOM_BITS split: global shape ",
                                                   DimsToString(block->global),
                                                   " does not end in 2 (a key's words)"));
  }
  const bool whole = block->global == y->dims();
  return Executor::CompiledOp([key, y, b = *block, fn, whole](const RunContext&) {
    const PRNGKey k = KeyOf(*key);
    uint32_t* o = y->data<uint32_t>();
    if (fn == "legacy" && whole) {
      RandomBits(k, y->num_elements(), o);  // vectorised
    } else if (fn == "legacy") {
      const int64_t n = NumElements(b.global);
      ForEachGlobalIndex(b, y->dims(),
                         [&](int64_t i, int64_t flat) { o[i] = RandomBitsAt(k, n, flat); });
    } else if (fn == "partitionable") {
      ForEachGlobalRun(b, y->dims(), [&](int64_t i, int64_t flat, int64_t len) {
        PartitionableBits(k, flat, len, o + i);  // vectorised
      });
    } else {
      ForEachGlobalIndex(b, y->dims(), [&](int64_t i, int64_t flat) {
        o[i] = PartitionableSplitWordAt(k, flat / 2, static_cast<int>(flat % 2));
      });
    }
    return absl::OkStatus();
  });
}

// flax.linen.Dropout's mask: 1 / (1 - rate) where a draw is kept, 0 elsewhere.
absl::StatusOr<Executor::CompiledOp> CompileDropoutMask(const v1::Op& op,
                                                        const std::vector<Tensor*>& in,
                                                        const std::vector<Tensor*>& out) {
  if (absl::Status s = OpArity(op, 1, 1); !s.ok()) return s;
  const Tensor* key = in[0];
  Tensor* y = out[0];
  if (absl::Status s = RequireKey(op, *key); !s.ok()) return s;
  if (y->dtype() != v1::DTYPE_F32) return OpOutputMismatch(op, *y, "f32");
  const float rate = op.rate();
  if (!(rate >= 0.0f && rate < 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("dropout rate ", rate, ": expected 0 <= rate < 1"));
  }
  // The random words of a step are drawn into a buffer of the op's own, kept across steps.
  auto bits = std::make_shared<std::vector<uint32_t>>(y->num_elements());
  return Executor::CompiledOp([key, y, rate, bits](const RunContext&) {
    // Counts and pointers held in locals, so the loop vectorises (it once recounted y's
    // elements and reloaded the vector's data each element: 30% of a one-worker step).
    const int64_t n = y->num_elements();
    const uint32_t* b = bits->data();
    RandomBits(KeyOf(*key), n, bits->data());
    const float keep = 1.0f - rate, scale = 1.0f / keep;
    float* m = y->data<float>();
    for (int64_t i = 0; i < n; ++i) m[i] = BitsToUnitFloat(b[i]) < keep ? scale : 0.0f;
    return absl::OkStatus();
  });
}

// jax.random.fold_in(key, data).
absl::StatusOr<Executor::CompiledOp> CompileFoldIn(const v1::Op& op, const std::vector<Tensor*>& in,
                                                   const std::vector<Tensor*>& out) {
  if (absl::Status s = OpArity(op, 2, 1); !s.ok()) return s;
  const Tensor* key = in[0];
  const Tensor* data = in[1];
  Tensor* y = out[0];
  if (absl::Status s = RequireKey(op, *key); !s.ok()) return s;
  if (y->dtype() != v1::DTYPE_U32 || y->num_elements() != 2 || data->num_elements() != 1) {
    return absl::InvalidArgumentError(
        "fold_in takes a u32[2] key and a scalar, and returns a u32[2] key");
  }
  return Executor::CompiledOp([key, data, y](const RunContext&) {
    // The data word: an integer's bits (jnp.uint32(data)); an f32 holding an integer.
    const uint32_t d = data->dtype() == v1::DTYPE_F32
                           ? static_cast<uint32_t>(static_cast<int64_t>(GetAsDouble(*data, 0)))
                       : data->dtype() == v1::DTYPE_I32
                           ? static_cast<uint32_t>(data->data<int32_t>()[0])
                           : static_cast<uint32_t>(GetAsDouble(*data, 0));
    const PRNGKey r = FoldIn(KeyOf(*key), d);
    y->data<uint32_t>()[0] = r[0];
    y->data<uint32_t>()[1] = r[1];
    return absl::OkStatus();
  });
}

// Word op.dim of jax's threefry2x32 primitive over (key words, counts), broadcasting scalars.
absl::StatusOr<Executor::CompiledOp> CompileThreefry2x32(const v1::Op& op,
                                                         const std::vector<Tensor*>& in,
                                                         const std::vector<Tensor*>& out) {
  if (absl::Status s = OpArity(op, 4, 1); !s.ok()) return s;
  Tensor* y = out[0];
  const int64_t n = y->num_elements();
  for (const Tensor* t : in) {
    if (t->dtype() != v1::DTYPE_U32 || (t->num_elements() != n && t->num_elements() != 1) ||
        y->dtype() != v1::DTYPE_U32) {
      return absl::InvalidArgumentError(
          absl::StrCat("threefry2x32: operand ", DTypeName(t->dtype()), DimsToString(t->dims()),
                       ", output ", DTypeName(y->dtype()), DimsToString(y->dims()),
                       "; expected u32 operands of the output's shape or one element"));
    }
  }
  if (op.dim() != 0 && op.dim() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("threefry2x32: word ", op.dim(), "; expected 0 or 1"));
  }
  const std::vector<const Tensor*> args(in.begin(), in.end());
  const int word = static_cast<int>(op.dim());
  return Executor::CompiledOp([args, y, word](const RunContext&) {
    // Each operand's words and stride (0 for a broadcast scalar), read once per run.
    const uint32_t* a[4];
    int64_t stride[4];
    for (int k = 0; k < 4; ++k) {
      a[k] = args[k]->data<uint32_t>();
      stride[k] = args[k]->num_elements() == 1 ? 0 : 1;
    }
    uint32_t* o = y->data<uint32_t>();
    const int64_t count = y->num_elements();
    for (int64_t i = 0; i < count; ++i) {
      o[i] = Threefry2x32(PRNGKey{a[0][i * stride[0]], a[1][i * stride[1]]}, a[2][i * stride[2]],
                          a[3][i * stride[3]])[word];
    }
    return absl::OkStatus();
  });
}

}  // namespace

absl::StatusOr<Executor::CompiledOp> Executor::CompileRandom(const v1::Op& op,
                                                             const std::vector<Tensor*>& in,
                                                             const std::vector<Tensor*>& out) {
  switch (op.kind()) {
    case v1::OP_RANDOM_INIT:
      return CompileRandomInit(op, in, out, options_.mesh, options_.rank);
    case v1::OP_RANDOM_BITS:
      return CompileRandomBits(op, in, out, options_.mesh, options_.rank);
    case v1::OP_DROPOUT_MASK:
      return CompileDropoutMask(op, in, out);
    case v1::OP_FOLD_IN:
      return CompileFoldIn(op, in, out);
    case v1::OP_THREEFRY2X32:
      return CompileThreefry2x32(op, in, out);
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("not a random op: ", v1::OpKind_Name(op.kind())));
  }
}

}  // namespace meshrun
