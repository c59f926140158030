// PartitionSpec: how each dim of an array maps onto mesh axes. Mirrors jax.sharding.PartitionSpec.
#ifndef MESHRUN_CORE_SHARDING_PARTITION_SPEC_H_
#define MESHRUN_CORE_SHARDING_PARTITION_SPEC_H_

#include <string>
#include <vector>

#include "meshrun/v1/common.pb.h"

namespace meshrun {

// One entry per array dim: empty = None (not sharded), one axis name, or several (the dim is split
// over their product, the first axis major, as P(('i', 'j'))). Trailing dims may be omitted:
// P('model') on a 2-D array equals P('model', None). Immutable value type.
class PartitionSpec {
 public:
  using Entry = std::vector<std::string>;

  PartitionSpec() = default;  // P(): fully replicated
  explicit PartitionSpec(std::vector<Entry> entries) : entries_(std::move(entries)) {}
  // P('data') / P('data', None) shorthands: an empty string is None.
  static PartitionSpec Of(std::vector<std::string> names);

  const std::vector<Entry>& entries() const { return entries_; }
  // The entry for `dim`, or None for omitted trailing dims.
  Entry entry(int dim) const;
  // One entry per dim of a rank-`rank` array: entry(0) .. entry(rank - 1).
  std::vector<Entry> Padded(size_t rank) const;

  static PartitionSpec FromProto(const v1::PartitionSpec& proto);
  v1::PartitionSpec ToProto() const;
  // "PartitionSpec('data', None)", "PartitionSpec()" as JAX prints it.
  std::string ToString() const;
  bool operator==(const PartitionSpec& o) const;
  bool operator!=(const PartitionSpec& o) const { return !(*this == o); }

 private:
  std::vector<Entry> entries_;
};

}  // namespace meshrun

#endif  // MESHRUN_CORE_SHARDING_PARTITION_SPEC_H_
