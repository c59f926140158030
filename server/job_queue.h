// One job at a time per cluster: SubmitJob calls take a place in a first-come, first-served queue
// and run in turn, as a batch scheduler's jobs do (Slurm's one-node partition, Ray Train's
// placement wait). A job config may ask to be refused instead (train.when_busy: refuse).
#ifndef MESHRUN_SERVER_JOB_QUEUE_H_
#define MESHRUN_SERVER_JOB_QUEUE_H_

#include <cstdint>
#include <deque>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace meshrun {

// Thread-safe. A ticket is a job's place: Join() hands it out, WaitTurn() returns true once it is
// the ticket's turn to run (it then counts as running until Done()), Leave() gives up a place.
class JobQueue {
 public:
  // Takes the place at the back. `*ahead` gets how many jobs run or wait before this one (0: it
  // may run at once; WaitTurn returns true without waiting).
  uint64_t Join(int* ahead);

  // Waits up to `timeout` for the ticket's turn: the running job has ended and every ticket
  // before it has run or left. true: the ticket now runs. false: not yet (call again, or Leave).
  bool WaitTurn(uint64_t ticket, absl::Duration timeout);

  // Gives up a waiting ticket's place (a client that went away, or one refused for waiting).
  void Leave(uint64_t ticket);

  // The running ticket ends; the next in line may run.
  void Done(uint64_t ticket);

 private:
  absl::Mutex mu_;
  uint64_t next_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t running_ ABSL_GUARDED_BY(mu_) = 0;  // 0: none
  std::deque<uint64_t> waiting_ ABSL_GUARDED_BY(mu_);
};

}  // namespace meshrun

#endif  // MESHRUN_SERVER_JOB_QUEUE_H_
