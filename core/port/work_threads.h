// Threads for work that must leave the thread that starts it (a gRPC callback handler whose work
// blocks or copies much: gRPC's callback threads also carry other calls' events), each joined by
// the owner: finished ones on a later Start, the rest when the WorkThreads is destroyed, so
// nothing they use is destroyed under them (a detached thread could still be running when the
// process's static destructors start).
#ifndef MESHRUN_CORE_PORT_WORK_THREADS_H_
#define MESHRUN_CORE_PORT_WORK_THREADS_H_

#include <functional>
#include <list>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace meshrun {

// Thread-safe. One thread per Start (work that waits on peers must not queue behind other work).
class WorkThreads {
 public:
  WorkThreads() = default;
  WorkThreads(const WorkThreads&) = delete;
  WorkThreads& operator=(const WorkThreads&) = delete;
  // Waits for every thread's work to end. REQUIRES: no Start from now on.
  ~WorkThreads();

  // Runs `work` on a new thread.
  void Start(std::function<void()> work);

 private:
  using Threads = std::list<std::thread>;
  absl::Mutex mu_;
  Threads threads_ ABSL_GUARDED_BY(mu_);
  std::vector<Threads::iterator> finished_ ABSL_GUARDED_BY(mu_);  // to be joined
};

}  // namespace meshrun

#endif  // MESHRUN_CORE_PORT_WORK_THREADS_H_
