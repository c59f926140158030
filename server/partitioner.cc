#include "server/partitioner.h"

#include "core/spmd/jit.h"

namespace meshrun {

absl::StatusOr<std::shared_ptr<const Partitioner::Partitioned>> Partitioner::Partition(
    const v1::GlobalProgram& program, bool* cache_hit) {
  const Mesh mesh = mesh_();
  std::string key;
  if (!program.SerializeToString(&key))
    return absl::InvalidArgumentError("unserialisable global program");
  key += "|" + mesh.ToString();
  {
    absl::MutexLock lock(&mu_);
    for (auto it = cache_.begin(); it != cache_.end(); ++it) {
      if (it->first != key) continue;
      cache_.splice(cache_.begin(), cache_, it);
      if (cache_hit != nullptr) *cache_hit = true;
      return cache_.front().second;
    }
  }
  if (cache_hit != nullptr) *cache_hit = false;
  absl::StatusOr<std::unique_ptr<JitBuilder>> jit = JitBuilder::FromGlobalProgram(mesh, program);
  if (!jit.ok()) return jit.status();
  absl::StatusOr<v1::ShardMapProgram> built = (*jit)->Build();
  if (!built.ok()) return built.status();
  auto out = std::make_shared<Partitioned>();
  out->program = *std::move(built);
  if (!out->program.SerializeToString(&out->serialized))
    return absl::InternalError("the partitioned program does not serialize");
  for (const JitBuilder::Collective& c : (*jit)->collectives())
    out->collectives.push_back(c.Short());
  absl::MutexLock lock(&mu_);
  cache_.emplace_front(std::move(key), out);
  if (cache_.size() > capacity_) cache_.pop_back();
  return out;
}

}  // namespace meshrun
