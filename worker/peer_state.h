// The TrainState copies a worker holds for healing from peers' memory (issue 21; torchft's
// healing, Gemini's in-memory checkpoints): its own blocks and its ring predecessor's, one
// committed copy per owner rank, kept in this process's memory and passed over an exec of the
// process (the survivors restart when the cluster re-forms) through a memfd.
#ifndef MESHRUN_WORKER_PEER_STATE_H_
#define MESHRUN_WORKER_PEER_STATE_H_

#include <cstdint>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "meshrun/v1/worker.pb.h"

namespace meshrun {

// The environment variable that names the memfd holding the copies across an exec.
inline constexpr char kPeerStateFdEnv[] = "MESHRUN_PEER_STATE_FD";

// Thread-safe. A copy is built block by block under its key (Add) and replaces the owner's held
// copy only when committed, so a transfer cut short leaves the previous copy usable.
class PeerStateStore {
 public:
  // Adds `block` to the pending copy of key.owner_rank; a pending copy under another key is
  // dropped first.
  void Add(const v1::PeerStateKey& key, v1::PeerStateBlock block);
  // Makes the pending copy of `key` the owner's held one, and drops the copies of other jobs.
  // Errors: FailedPrecondition when nothing is pending under `key`.
  absl::Status Commit(const v1::PeerStateKey& key);
  // The held copies' keys and array names.
  v1::PeerStateInfoResponse Info();
  // The block `name` of the copy held under exactly `key`. Errors: NotFound naming what is
  // missing.
  absl::StatusOr<v1::PeerStateBlock> Find(const v1::PeerStateKey& key, const std::string& name);
  // Frees every copy (committed and pending) of `job`; returns the bytes freed.
  int64_t Drop(const std::string& job);
  // Bytes of tensor data held (committed and pending).
  int64_t bytes();

  // Writes the held copies into a memfd that stays open over exec and names it in
  // kPeerStateFdEnv; nothing when none is held. Errors: Internal (memfd_create, write).
  absl::Status ExportForExec();
  // Takes back the copies an ExportForExec before this process's exec left (none when
  // kPeerStateFdEnv is unset), closes the memfd and unsets the variable. Errors: DataLoss for
  // copies that do not parse (none are kept then).
  absl::Status ImportAfterExec();

 private:
  absl::Mutex mu_;
  // The owner's newest committed copy becomes held_, the one it replaces previous_: a keep that
  // a lost worker cut short leaves some ranks with the new copy and others without it, and
  // the previous step is then the newest one every rank still has.
  void HoldLocked(v1::PeerStateCopy copy) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::map<int, v1::PeerStateCopy> held_ ABSL_GUARDED_BY(mu_);      // by owner rank
  std::map<int, v1::PeerStateCopy> previous_ ABSL_GUARDED_BY(mu_);  // by owner rank
  std::map<int, v1::PeerStateCopy> pending_ ABSL_GUARDED_BY(mu_);   // by owner rank
};

// Whether two keys name the same copy (job, step, owner and mesh).
bool SamePeerStateKey(const v1::PeerStateKey& a, const v1::PeerStateKey& b);
// "job J, step S of rank R on mesh M", for messages.
std::string DescribePeerStateKey(const v1::PeerStateKey& key);

}  // namespace meshrun

#endif  // MESHRUN_WORKER_PEER_STATE_H_
