#include "worker/compute_thread.h"

namespace meshrun {

ComputeThread::ComputeThread() : thread_([this] { Loop(); }) {}

ComputeThread::~ComputeThread() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void ComputeThread::Run(const std::function<void()>& fn) {
  absl::MutexLock caller(&run_mu_);
  absl::MutexLock lock(&mu_);
  pending_ = &fn;
  done_ = false;
  mu_.Await(absl::Condition(&done_));
}

void ComputeThread::Loop() {
  absl::MutexLock lock(&mu_);
  while (true) {
    auto ready = [this]()
                     ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || pending_ != nullptr; };
    mu_.Await(absl::Condition(&ready));
    if (stop_) return;
    const std::function<void()>* fn = pending_;
    pending_ = nullptr;
    mu_.Unlock();
    (*fn)();
    mu_.Lock();
    done_ = true;
  }
}

}  // namespace meshrun
