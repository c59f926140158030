// ArrayRegistry::ShardMap's checks of a request before anything runs: the arguments against the
// program, the results' global shapes, and the ids the kept results take.
#include <set>

#include "absl/strings/str_cat.h"
#include "core/sharding/named_sharding.h"
#include "server/array_registry.h"

namespace meshrun {

absl::StatusOr<std::vector<v1::ArrayInfo>> ArrayRegistry::ResultInfos(
    const v1::ShardMapProgram& p) const {
  const Mesh& mesh = workers_->mesh();
  // The results' buffer declarations (a program declares many more buffers than it returns).
  std::map<std::string, const v1::BufferDecl*> result_decls;
  for (const std::string& o : p.outputs()) result_decls[o] = nullptr;
  for (const auto& b : p.program().buffers()) {
    auto it = result_decls.find(b.name());
    if (it != result_decls.end()) it->second = &b;
  }
  // Global shapes of the results: each local dim times the blocks its out_spec entry names.
  std::vector<v1::ArrayInfo> outputs;
  for (int i = 0; i < p.outputs_size(); ++i) {
    const v1::BufferDecl* decl = result_decls[p.outputs(i)];
    if (decl == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("result ", i, " '", p.outputs(i), "' is not a buffer of the program"));
    }
    const Dims local(decl->shape().dims().begin(), decl->shape().dims().end());
    const PartitionSpec spec = PartitionSpec::FromProto(p.out_specs(i));
    if (spec.entries().size() > local.size()) {
      return absl::InvalidArgumentError(absl::StrCat("out_specs[", i, "] ", spec.ToString(),
                                                     " has more entries than ", "result ", i,
                                                     " has dims (", DimsToString(local), ")"));
    }
    Dims global = local;
    for (size_t d = 0; d < global.size(); ++d) {
      for (const auto& axis : spec.entry(d)) {
        absl::StatusOr<int> a = mesh.AxisIndex(axis);
        if (!a.ok())
          return absl::InvalidArgumentError(
              absl::StrCat("out_specs[", i, "]: ", a.status().message()));
        global[d] *= mesh.axis_size(*a);
      }
    }
    NamedSharding sharding(mesh, spec);
    if (absl::Status s = sharding.Validate(global); !s.ok()) return s;
    v1::ArrayInfo info;
    info.set_dtype(decl->dtype());
    for (int64_t d : global) info.mutable_shape()->add_dims(d);
    *info.mutable_sharding() = sharding.ToProto();
    info.set_bytes_per_worker(NumElements(local) * DTypeSize(info.dtype()));
    outputs.push_back(info);
  }
  return outputs;
}

absl::Status ArrayRegistry::CheckShardMapArguments(const v1::ShardMapProgram& p,
                                                   const v1::ShardMapRequest& request) {
  if (p.inputs_size() != request.input_ids_size() || p.in_specs_size() != p.inputs_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard_map takes ", p.inputs_size(), " arguments and ", p.in_specs_size(),
                     " in_specs; got ", request.input_ids_size(), " arrays"));
  }
  if (p.out_specs_size() != p.outputs_size() ||
      (request.output_ids_size() != 0 && request.output_ids_size() != p.outputs_size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard_map returns ", p.outputs_size(), " results; got ", p.out_specs_size(),
                     " out_specs and ", request.output_ids_size(), " output ids"));
  }
  if (absl::Status s = CheckFeed(request); !s.ok()) return s;
  const std::set<int> fed(request.feed().argnums().begin(), request.feed().argnums().end());
  // The arguments of run `k` (0: input_ids; then more_runs) exist and are laid out as in_specs.
  auto check_arguments = [&](const google::protobuf::RepeatedPtrField<std::string>& ids,
                             int k) -> absl::Status {
    const std::string run = request.more_runs_size() > 0 ? absl::StrCat("run ", k, ": ") : "";
    if (ids.size() != p.inputs_size()) {
      return absl::InvalidArgumentError(absl::StrCat(run, "shard_map takes ", p.inputs_size(),
                                                     " arguments; got ", ids.size(), " arrays"));
    }
    for (int i = 0; i < p.inputs_size(); ++i) {
      if (fed.count(i)) continue;  // CheckFeed's
      absl::StatusOr<v1::ArrayInfo> info = Info(ids[i]);
      if (!info.ok())
        return absl::Status(info.status().code(), absl::StrCat(run, info.status().message()));
      const PartitionSpec have = PartitionSpec::FromProto(info->sharding().spec());
      const PartitionSpec want = PartitionSpec::FromProto(p.in_specs(i));
      if (have != want) {
        return absl::InvalidArgumentError(
            absl::StrCat(run, "argument ", i, " (array '", ids[i], "') is laid out as ",
                         have.ToString(), " but in_specs[", i, "] is ", want.ToString()));
      }
    }
    return absl::OkStatus();
  };
  for (int k = 0; k <= request.more_runs_size(); ++k) {
    const auto& ids = k == 0 ? request.input_ids() : request.more_runs(k - 1).input_ids();
    if (absl::Status s = check_arguments(ids, k); !s.ok()) return s;
    for (int a : request.donate_argnums()) {
      // A donated argument is carried over from run to run: the same array in every run.
      if (k > 0 && a >= 0 && a < ids.size() && ids[a] != request.input_ids(a)) {
        return absl::InvalidArgumentError(
            absl::StrCat("run ", k, ": donated argument ", a, " is array '", ids[a],
                         "'; with more runs it must be run 0's '", request.input_ids(a),
                         "' (which the previous run replaced)"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ArrayRegistry::AssignResultIds(const v1::ShardMapProgram& p,
                                            const v1::ShardMapRequest& request,
                                            std::vector<v1::ArrayInfo>& outputs,
                                            std::set<std::string>& donated,
                                            std::set<int>& fetched) {
  for (int a : request.donate_argnums()) {
    if (a < 0 || a >= request.input_ids_size()) {
      return absl::InvalidArgumentError(absl::StrCat("donate_argnums: ", a,
                                                     " is not an argument index (0..",
                                                     request.input_ids_size() - 1, ")"));
    }
    donated.insert(request.input_ids(a));
  }
  for (int o : request.fetch_outputs()) {
    if (o < 0 || o >= p.outputs_size() || !fetched.insert(o).second) {
      return absl::InvalidArgumentError(absl::StrCat("fetch_outputs: ", o,
                                                     " is not a result index (0..",
                                                     p.outputs_size() - 1, ") or is given twice"));
    }
  }
  {
    absl::MutexLock lock(&mu_);
    for (int i = 0; i < p.outputs_size(); ++i) {
      if (fetched.count(i)) continue;  // returned, never registered
      std::string id = request.output_ids_size() ? request.output_ids(i) : "";
      if (id.empty()) id = NewIdLocked();  // an empty id: ours to pick
      if (arrays_.count(id) && !donated.count(id)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "array id '", id, "' is in use (only a donated argument's id ", "may be reused)"));
      }
      if (request.more_runs_size() > 0 && !donated.count(id)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "result ", i, " (id '", id, "') would be overwritten by the next ",
            "run: with more runs every kept result must take a donated ", "argument's id"));
      }
      outputs[i].set_id(id);
    }
  }
  return absl::OkStatus();
}

}  // namespace meshrun
