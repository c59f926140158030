#include "worker/shm_receiver.h"

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace meshrun {

ShmReceiver::ShmReceiver(std::unique_ptr<ShmRing> ring, int src, Mailbox* mailbox,
                         absl::Duration poll)
    : ring_(std::move(ring)), src_(src), mailbox_(mailbox), poll_(poll), thread_([this] {
        Loop();
      }) {}

ShmReceiver::~ShmReceiver() {
  stop_.store(true);
  ring_->WakeConsumer();
  thread_.join();
}

void ShmReceiver::DrainNow() {
  if (!consume_mu_.TryLock()) {
    ring_->WakeConsumer();
    return;
  }
  bool idle = false;
  const absl::Status s = ring_->Consume(*this, &idle);
  consume_mu_.Unlock();
  if (!s.ok()) ring_->WakeConsumer();  // the drain thread meets the corrupt frame and reports it
}

const RecvSink* ShmReceiver::BeginInPlace(uint64_t epoch, uint64_t tag, size_t size) {
  return mailbox_->BeginInPlace(src_, epoch, tag, size);
}

void ShmReceiver::EndInPlace() { mailbox_->EndInPlace(src_); }

// A message no one receives yet stays in the ring, to go straight into the receive when it is
// posted (the Mailbox's wait listener calls DrainNow then).
bool ShmReceiver::Defer(uint64_t) { return !mailbox_->Waiting(src_); }

// A message of an earlier epoch is dropped there: the ring needs no flushing on Reset.
void ShmReceiver::Deliver(uint64_t epoch, uint64_t tag, std::string message) {
  mailbox_->Deliver(src_, epoch, tag, std::move(message));
}

void ShmReceiver::Loop() {
  while (!stop_.load()) {
    const uint32_t seq = ring_->DataSeq();
    bool idle = false;
    absl::Status s;
    {
      absl::MutexLock lock(&consume_mu_);
      s = ring_->Consume(*this, &idle);
    }
    if (!s.ok()) {
      LOG(ERROR) << "shared-memory link from rank " << src_ << ": " << s;
      mailbox_->MarkPeerFailed(
          src_, absl::DataLossError(absl::StrCat("shared-memory link from rank ", src_,
                                                 " is corrupt: ", s.message())));
      return;
    }
    if (idle) ring_->WaitForData(seq, poll_);
  }
}

}  // namespace meshrun
