#include "core/port/work_threads.h"

#include <iterator>
#include <utility>

namespace meshrun {

WorkThreads::~WorkThreads() {
  Threads all;
  {
    absl::MutexLock lock(&mu_);
    all.swap(threads_);  // (the nodes, and the iterators the threads hold, stay valid)
  }
  for (std::thread& t : all) t.join();
}

void WorkThreads::Start(std::function<void()> work) {
  absl::MutexLock lock(&mu_);
  for (Threads::iterator done : finished_) {  // their work has ended: the joins are short
    done->join();
    threads_.erase(done);
  }
  finished_.clear();
  const Threads::iterator self = threads_.emplace(threads_.end());
  *self = std::thread([this, self, work = std::move(work)] {
    work();
    absl::MutexLock lock(&mu_);
    finished_.push_back(self);
  });
}

}  // namespace meshrun
