// The receiving end of one shared-memory link (worker/shm_transport.h): a thread that moves the
// messages of one peer's ShmRing into this worker's Mailbox, or straight into a receive posted
// there, as NCCL's proxy thread drains a SHM transport's FIFO. The collective's thread consumes
// too when it starts to wait (DrainNow), so a message already in the ring goes into its receive
// with no thread switch.
#ifndef MESHRUN_WORKER_SHM_RECEIVER_H_
#define MESHRUN_WORKER_SHM_RECEIVER_H_

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/collectives/mailbox.h"
#include "worker/shm_ring.h"

namespace meshrun {

// Thread-safe. The drain thread starts in the constructor and is joined by the destructor. A
// corrupt frame in the ring marks `src` failed in the mailbox (DataLoss naming the rank) and ends
// the thread.
class ShmReceiver : private ShmRing::Consumer {
 public:
  // `ring`: the peer's ring, opened as its consumer. `poll`: the longest the drain thread sleeps
  // between looks at an idle ring. REQUIRES: `mailbox` outlives this receiver.
  ShmReceiver(std::unique_ptr<ShmRing> ring, int src, Mailbox* mailbox, absl::Duration poll);
  ~ShmReceiver() override;

  // A receive from src started to wait: hands over what the ring holds on this thread, or, if
  // the drain thread is at it, makes that thread look again.
  void DrainNow();
  // Whether the sender wakes the drain thread for each message (ShmRing::SetWakeOnData).
  void SetWakeOnData(bool on) { ring_->SetWakeOnData(on); }
  void WakeDrain() { ring_->WakeConsumer(); }

 private:
  const RecvSink* BeginInPlace(uint64_t epoch, uint64_t tag, size_t size) override;
  void EndInPlace() override;
  bool Defer(uint64_t tag) override;
  void Deliver(uint64_t epoch, uint64_t tag, std::string message) override;
  void Loop();

  std::unique_ptr<ShmRing> ring_;
  const int src_;
  Mailbox* const mailbox_;
  const absl::Duration poll_;
  absl::Mutex consume_mu_;  // one consumer of the ring at a time
  std::atomic<bool> stop_{false};
  std::thread thread_;  // last: starts once the rest is set
};

}  // namespace meshrun

#endif  // MESHRUN_WORKER_SHM_RECEIVER_H_
