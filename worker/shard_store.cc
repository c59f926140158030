#include "worker/shard_store.h"

#include "absl/strings/str_cat.h"

namespace meshrun {

void ShardStore::Put(const std::string& id, Tensor shard) {
  auto t = std::make_shared<const Tensor>(std::move(shard));
  absl::MutexLock lock(&mu_);
  shards_[id] = std::move(t);
}

absl::StatusOr<std::shared_ptr<const Tensor>> ShardStore::Get(const std::string& id) {
  absl::MutexLock lock(&mu_);
  auto it = shards_.find(id);
  if (it == shards_.end())
    return absl::NotFoundError(absl::StrCat("no array '", id, "' on this worker"));
  return it->second;
}

absl::StatusOr<std::shared_ptr<const Tensor>> ShardStore::Take(const std::string& id) {
  absl::MutexLock lock(&mu_);
  auto it = shards_.find(id);
  if (it == shards_.end())
    return absl::NotFoundError(absl::StrCat("no array '", id, "' on this worker"));
  std::shared_ptr<const Tensor> shard = std::move(it->second);
  shards_.erase(it);
  return shard;
}

absl::Status ShardStore::Delete(const std::string& id) {
  absl::MutexLock lock(&mu_);
  if (shards_.erase(id) == 0)
    return absl::NotFoundError(absl::StrCat("no array '", id, "' on this worker"));
  return absl::OkStatus();
}

int64_t ShardStore::TotalBytes() {
  absl::MutexLock lock(&mu_);
  int64_t total = 0;
  for (const auto& [id, t] : shards_) {
    total += t->size_bytes();
    if (t->bf16_copy() != nullptr) total += t->bf16_copy()->size_bytes();
  }
  return total;
}

}  // namespace meshrun
