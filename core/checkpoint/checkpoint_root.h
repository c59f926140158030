// The one directory a node (a worker, the coordinator) reads and writes checkpoints under: its
// --checkpoint_root. A request naming a path outside it is refused, so that no client can make a
// node create, write or delete files elsewhere.
#ifndef MESHRUN_CORE_CHECKPOINT_CHECKPOINT_ROOT_H_
#define MESHRUN_CORE_CHECKPOINT_CHECKPOINT_ROOT_H_

#include <string>

#include "absl/status/status.h"

namespace meshrun {

// Immutable; thread-safe.
class CheckpointRoot {
 public:
  // `root` ("" : "/"), resolved once; `whose` names the node in errors ("this worker's").
  CheckpointRoot(const std::string& root, std::string whose);

  // OK when `path`, with every existing part's symbolic links resolved and ".." folded, lies
  // under the root. Errors: PermissionDenied naming the path, the root and the flag (also for a
  // path holding a NUL, which would end the path the system sees before the one checked).
  absl::Status Check(const std::string& path) const;
  const std::string& path() const { return root_; }

  // `path` with every existing part's symbolic links resolved, normalised; "" if it cannot be
  // made absolute (an empty path, say).
  static std::string Resolve(const std::string& path);

 private:
  std::string root_;  // resolved
  std::string whose_;
};

}  // namespace meshrun

#endif  // MESHRUN_CORE_CHECKPOINT_CHECKPOINT_ROOT_H_
