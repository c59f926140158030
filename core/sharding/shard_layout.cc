#include "core/sharding/shard_layout.h"

#include <algorithm>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace meshrun {
namespace {

// Copies the block at `offsets` with shape `block` between a row-major array of `dims` and a
// dense block buffer, in the direction given by `to_block`.
void CopyBlock(const Dims& dims, const std::vector<int64_t>& offsets, const Dims& block,
               size_t elem, char* array, char* dense, bool to_block) {
  const size_t rank = dims.size();
  if (rank == 0) {
    if (to_block)
      std::memcpy(dense, array, elem);
    else
      std::memcpy(array, dense, elem);
    return;
  }
  std::vector<int64_t> strides(rank, 1);
  for (int i = static_cast<int>(rank) - 2; i >= 0; --i) strides[i] = strides[i + 1] * dims[i + 1];
  const int64_t row = block[rank - 1] * static_cast<int64_t>(elem);
  const int64_t rows = NumElements(block) / std::max<int64_t>(1, block[rank - 1]);
  std::vector<int64_t> idx(rank, 0);
  for (int64_t r = 0; r < rows && row > 0; ++r) {
    int64_t flat = 0;
    for (size_t d = 0; d < rank; ++d) flat += (offsets[d] + idx[d]) * strides[d];
    char* a = array + flat * static_cast<int64_t>(elem);
    char* b = dense + r * row;
    if (to_block)
      std::memcpy(b, a, row);
    else
      std::memcpy(a, b, row);
    for (int d = static_cast<int>(rank) - 2; d >= 0; --d) {  // next row of the block
      if (++idx[d] < block[d]) break;
      idx[d] = 0;
    }
  }
}

}  // namespace

absl::StatusOr<Tensor> ExtractShard(const Tensor& global, const NamedSharding& sharding, int rank) {
  if (absl::Status s = sharding.Validate(global.dims()); !s.ok()) return s;
  // Every byte is written by the copy: no zero-fill first.
  Tensor shard = Tensor::Uninitialized(global.dtype(), sharding.ShardDims(global.dims()));
  ExtractShardInto(global, sharding, rank, static_cast<char*>(shard.raw()));
  return shard;
}

void ExtractShardInto(const Tensor& global, const NamedSharding& sharding, int rank, char* out) {
  CopyBlock(global.dims(), sharding.ShardOffsets(global.dims(), rank),
            sharding.ShardDims(global.dims()), DTypeSize(global.dtype()),
            const_cast<char*>(static_cast<const char*>(global.raw())), out, true);
}

absl::Status InsertShard(const Tensor& shard, const NamedSharding& sharding, int rank,
                         Tensor& global) {
  if (absl::Status s = sharding.Validate(global.dims()); !s.ok()) return s;
  const Dims block = sharding.ShardDims(global.dims());
  if (shard.dims() != block || shard.dtype() != global.dtype()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shard of rank ", rank, " is ", DTypeName(shard.dtype()), DimsToString(shard.dims()),
        "; expected ", DTypeName(global.dtype()), DimsToString(block)));
  }
  CopyBlock(global.dims(), sharding.ShardOffsets(global.dims(), rank), block,
            DTypeSize(global.dtype()), static_cast<char*>(global.raw()),
            const_cast<char*>(static_cast<const char*>(shard.raw())), false);
  return absl::OkStatus();
}

std::vector<std::vector<int>> BlockHolders(const Dims& global_dims, const NamedSharding& sharding) {
  std::map<std::vector<int64_t>, std::vector<int>> by_offsets;
  for (int r = 0; r < sharding.mesh().size(); ++r)
    by_offsets[sharding.ShardOffsets(global_dims, r)].push_back(r);
  std::vector<std::vector<int>> out;
  for (auto& [offsets, ranks] : by_offsets)
    out.push_back(ranks);  // map order = row-major block order
  return out;
}

absl::StatusOr<std::string> VisualizeSharding(const Dims& global_dims,
                                              const NamedSharding& sharding) {
  if (global_dims.empty() || global_dims.size() > 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "visualize_sharding supports 1-D and 2-D arrays; got shape ", DimsToString(global_dims)));
  }
  if (absl::Status s = sharding.Validate(global_dims); !s.ok()) return s;
  const Dims block = sharding.ShardDims(global_dims);
  const int64_t rows = global_dims.size() == 2 ? global_dims[0] / block[0] : 1;
  const int64_t cols = global_dims.back() / block.back();
  std::vector<std::vector<std::string>> cells(rows, std::vector<std::string>(cols));
  std::vector<std::vector<std::vector<int>>> holders(rows, std::vector<std::vector<int>>(cols));
  for (int r = 0; r < sharding.mesh().size(); ++r) {
    std::vector<int64_t> off = sharding.ShardOffsets(global_dims, r);
    const int64_t i = global_dims.size() == 2 ? off[0] / block[0] : 0;
    const int64_t j = off.back() / block.back();
    holders[i][j].push_back(r);
  }
  size_t width = 0;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      cells[i][j] = absl::StrCat("CPU ", absl::StrJoin(holders[i][j], ","));
      width = std::max(width, cells[i][j].size());
    }
  }
  std::string border = "+";
  for (int64_t j = 0; j < cols; ++j) absl::StrAppend(&border, std::string(width + 2, '-'), "+");
  std::string out = border + "\n";
  for (int64_t i = 0; i < rows; ++i) {
    std::string line = "|";
    for (int64_t j = 0; j < cols; ++j) {
      const size_t pad = width - cells[i][j].size();
      absl::StrAppend(&line, " ", std::string(pad / 2, ' '), cells[i][j],
                      std::string(pad - pad / 2, ' '), " |");
    }
    absl::StrAppend(&out, line, "\n", border, "\n");
  }
  return out;
}

}  // namespace meshrun
