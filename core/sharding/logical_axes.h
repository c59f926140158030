// Logical axis names and the rules that map them onto mesh axes, and the FSDP layout rule.
//
// A model annotates each parameter dim with a logical name ('embed', 'hidden', 'layer', 'batch')
// once; a job's rules decide which mesh axis each name lands on, so the same model runs data
// parallel, FSDP, tensor parallel or 2-D by changing the rules, not the model. Mirrors
// flax.linen.logical_to_mesh_axes and nn.LogicallyPartitioned (shared/seeds/000, 002), and
// shard_params of shared/seeds/001 (FSDP / ZeRO-3).
//
// Thread-safety: free functions over values; safe to call concurrently.
#ifndef MESHRUN_CORE_SHARDING_LOGICAL_AXES_H_
#define MESHRUN_CORE_SHARDING_LOGICAL_AXES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/sharding/mesh.h"
#include "core/sharding/partition_spec.h"

namespace meshrun {

// ('hidden', 'model'): logical axis `logical` goes to the mesh axis `mesh_axes[0]`, or to the
// product of several (('batch', ('data', 'model'))), or nowhere (empty: replicated; a rule that
// pins a name to None, as Flax allows).
struct LogicalAxisRule {
  std::string logical;
  PartitionSpec::Entry mesh_axes;
  bool operator==(const LogicalAxisRule& o) const {
    return logical == o.logical && mesh_axes == o.mesh_axes;
  }
};
// In priority order: earlier rules win (Flax's semantics).
using LogicalAxisRules = std::vector<LogicalAxisRule>;

// Parses "batch=data,hidden=model,embed=" ('embed' pinned to None) or "batch=data+model" (a tuple
// of mesh axes). Errors: InvalidArgument naming the malformed rule.
absl::StatusOr<LogicalAxisRules> ParseLogicalAxisRules(absl::string_view text);
// "(('batch', 'data'), ('hidden', 'model'))", as the seeds write the rules.
std::string LogicalAxisRulesToString(const LogicalAxisRules& rules);

// Every mesh axis a rule names exists in `mesh`. Errors: InvalidArgument naming the rule and the
// mesh's axes.
absl::Status ValidateLogicalAxisRules(const LogicalAxisRules& rules, const Mesh& mesh);

// The PartitionSpec of an array whose dims carry `logical_names` (one per dim; "" = unannotated).
// Mirrors flax.linen.logical_to_mesh_axes exactly: rules are visited in order; a rule applies to
// the dim carrying its logical name if that dim is still unassigned and none of the rule's mesh
// axes is already used by this spec; dims left unassigned (no rule, or every matching rule's
// mesh axis taken) are None. So with (('batch','data'), ('embed','data')) an array named
// ('batch', 'embed') gets P('data', None): 'data' may shard only one dim.
// Errors: InvalidArgument when a logical name occurs on two dims.
absl::StatusOr<PartitionSpec> LogicalToMesh(const std::vector<std::string>& logical_names,
                                            const LogicalAxisRules& rules);

// The FSDP layout of one parameter, as the seed's shard_params decides it.
struct FsdpLayout {
  PartitionSpec spec;  // the input spec, or it with `axis` on dim `dim`
  int dim = -1;        // the dim sharded over `axis`; -1 when left as it was
  std::string reason;  // why it was left as it was (empty when sharded)
};

// Mirrors shard_params(params, axis_name, min_weight_size) of shared/seeds/001: a parameter of
// `shape` (row-major) already sharded as `spec` is left alone if `spec` already uses `axis`, or
// if it has <= min_weight_size elements (replicated: cheap to keep whole); otherwise it is
// sharded over `axis` along its largest dim that is divisible by the axis size and not sharded
// yet, ties going to the later dim (numpy's argsort(shape)[::-1]). A parameter with no such dim
// stays as it was. Errors: InvalidArgument when `axis` is not a mesh axis.
absl::StatusOr<FsdpLayout> FsdpShard(const std::vector<int64_t>& shape, const PartitionSpec& spec,
                                     const Mesh& mesh, absl::string_view axis,
                                     int64_t min_weight_size = int64_t{1} << 18);

}  // namespace meshrun

#endif  // MESHRUN_CORE_SHARDING_LOGICAL_AXES_H_
