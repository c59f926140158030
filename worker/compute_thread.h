// The one thread a worker runs its programs on.
#ifndef MESHRUN_WORKER_COMPUTE_THREAD_H_
#define MESHRUN_WORKER_COMPUTE_THREAD_H_

#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace meshrun {

// Runs functions, one at a time, on one long-lived thread. oneDNN's OpenMP team belongs to the
// thread that starts a parallel region: runs from gRPC's handler threads (a different one per
// call) would each start on another team while the last one's threads still hold the cores,
// which made every step after a worker's first call up to 1.7x slower (the main job on one
// worker: 52,000 samples/s in one call, 31,000 over several). Thread-safe.
class ComputeThread {
 public:
  ComputeThread();
  ~ComputeThread();
  ComputeThread(const ComputeThread&) = delete;
  ComputeThread& operator=(const ComputeThread&) = delete;

  // Runs `fn` on the thread and returns when it has returned. Callers are served in turn.
  void Run(const std::function<void()>& fn);

 private:
  void Loop();
  absl::Mutex mu_;
  const std::function<void()>* pending_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool done_ ABSL_GUARDED_BY(mu_) = false;  // pending_ has run
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::Mutex run_mu_;  // one caller at a time
  std::thread thread_;
};

}  // namespace meshrun

#endif  // MESHRUN_WORKER_COMPUTE_THREAD_H_
