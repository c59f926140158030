// The blocks of sharded arrays that this worker holds, keyed by array id.
#ifndef MESHRUN_WORKER_SHARD_STORE_H_
#define MESHRUN_WORKER_SHARD_STORE_H_

#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/tensor.h"

namespace meshrun {

// Thread-safe. Shards are immutable once stored; Get hands out shared references.
class ShardStore {
 public:
  // Stores (or replaces) the shard of `id`.
  void Put(const std::string& id, Tensor shard);
  // Errors: NotFound naming the id.
  absl::StatusOr<std::shared_ptr<const Tensor>> Get(const std::string& id);
  // Removes the shard of `id` and returns it. Errors: NotFound naming the id.
  absl::StatusOr<std::shared_ptr<const Tensor>> Take(const std::string& id);
  // Errors: NotFound naming the id.
  absl::Status Delete(const std::string& id);
  // The bytes of every shard, with their bf16 copies (Tensor::bf16_copy).
  int64_t TotalBytes();

 private:
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<const Tensor>> shards_ ABSL_GUARDED_BY(mu_);
};

}  // namespace meshrun

#endif  // MESHRUN_WORKER_SHARD_STORE_H_
