#include "worker/grpc_transport.h"

#include <deque>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "glog/logging.h"
#include "net/grpc_util.h"

namespace meshrun {

// ---------------------------------------------------------------------------------------------
// Receiving side.

void RingService::Attach(Mailbox* mailbox, int world_size, std::string cluster_id) {
  absl::MutexLock lock(&mu_);
  mailbox_ = mailbox;
  world_size_ = world_size;
  cluster_id_ = std::move(cluster_id);
}

grpc::Status RingService::Transfer(grpc::ServerContext* context, grpc::ServerReader<v1::Chunk>* reader,
                                   v1::TransferResponse* response) {
  Mailbox* mailbox;
  int world_size;
  std::string cluster_id;
  {
    absl::MutexLock lock(&mu_);
    mailbox = mailbox_;
    world_size = world_size_;
    cluster_id = cluster_id_;
  }
  if (mailbox == nullptr) {
    return grpc::Status(grpc::FAILED_PRECONDITION, "this worker has not joined a cluster yet");
  }
  v1::Chunk chunk;
  int src = -1;
  bool goodbye = false;
  while (reader->Read(&chunk)) {
    if (src < 0) {
      if (chunk.src_rank() < 0 || chunk.src_rank() >= world_size) {
        return grpc::Status(grpc::INVALID_ARGUMENT,
                            absl::StrCat("ring chunk from rank ", chunk.src_rank(), "; world size is ", world_size));
      }
      if (chunk.cluster_id() != cluster_id) {
        return grpc::Status(grpc::FAILED_PRECONDITION,
                            absl::StrCat("ring stream from cluster '", chunk.cluster_id(), "'; this is '", cluster_id, "'"));
      }
      src = chunk.src_rank();
    }
    if (chunk.goodbye()) {
      goodbye = true;
      break;
    }
    mailbox->Deliver(src, chunk.tag(), std::move(*chunk.mutable_data()));
  }
  if (src >= 0 && !goodbye) {
    LOG(WARNING) << "ring stream from rank " << src << " ended without goodbye (" << context->peer() << ")";
    mailbox->MarkPeerFailed(src, absl::UnavailableError(absl::StrCat(
                                     "rank ", src, " disconnected: its ring stream ended unexpectedly (process died?)")));
  }
  return grpc::Status::OK;
}

// ---------------------------------------------------------------------------------------------
// Sending side: one stream and one writer thread per peer.

class GrpcTransport::PeerLink {
 public:
  PeerLink(int self, int peer, const std::string& address, const std::string& cluster_id)
      : self_(self), peer_(peer), address_(address), cluster_id_(cluster_id),
        stub_(v1::Ring::NewStub(CreateChannel(address))) {
    ctx_.set_wait_for_ready(true);
    thread_ = std::thread([this] { Loop(); });
  }

  ~PeerLink() {
    {
      absl::MutexLock lock(&mu_);
      closing_ = true;
    }
    // A peer that never answered leaves the writer blocked in connect: cancel after a grace period.
    if (!done_.WaitForNotificationWithTimeout(absl::Seconds(2))) ctx_.TryCancel();
    thread_.join();
  }

  absl::Status Enqueue(uint64_t tag, absl::string_view data, absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    auto room = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return !failed_.ok() || queued_bytes_ < kMaxQueuedBytes;
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&room), deadline)) {
      return absl::DeadlineExceededError(absl::StrCat("send to rank ", peer_, " at ", address_,
                                                      " timed out: the link's buffer stayed full"));
    }
    if (!failed_.ok()) return failed_;
    v1::Chunk chunk;
    chunk.set_src_rank(self_);
    chunk.set_tag(tag);
    chunk.set_data(data.data(), data.size());
    queued_bytes_ += data.size();
    queue_.push_back(std::move(chunk));
    return absl::OkStatus();
  }

  bool failed() {
    absl::MutexLock lock(&mu_);
    return !failed_.ok();
  }

 private:
  static constexpr size_t kMaxQueuedBytes = size_t{256} << 20;

  void Loop() {
    writer_ = stub_->Transfer(&ctx_, &response_);
    bool first = true;
    while (true) {
      v1::Chunk chunk;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return closing_ || !queue_.empty(); };
        mu_.Await(absl::Condition(&ready));
        if (queue_.empty()) break;  // closing
        chunk = std::move(queue_.front());
        queue_.pop_front();
      }
      const size_t bytes = chunk.data().size();
      if (first) chunk.set_cluster_id(cluster_id_);
      first = false;
      const bool ok = writer_->Write(chunk);
      absl::MutexLock lock(&mu_);
      queued_bytes_ -= bytes;
      if (!ok) {
        failed_ = absl::UnavailableError(
            absl::StrCat("ring link to rank ", peer_, " at ", address_, " is broken (peer died or unreachable)"));
        queue_.clear();
        queued_bytes_ = 0;
        break;
      }
    }
    bool healthy;
    {
      absl::MutexLock lock(&mu_);
      healthy = failed_.ok();
    }
    if (healthy) {
      v1::Chunk bye;
      bye.set_src_rank(self_);
      bye.set_goodbye(true);
      if (first) bye.set_cluster_id(cluster_id_);
      writer_->Write(bye);
      writer_->WritesDone();
    }
    done_.Notify();
    grpc::Status s = writer_->Finish();
    if (!s.ok() && healthy) VLOG(1) << "ring link to rank " << peer_ << " closed: " << s.error_message();
  }

  const int self_, peer_;
  const std::string address_, cluster_id_;
  std::unique_ptr<v1::Ring::Stub> stub_;
  grpc::ClientContext ctx_;
  v1::TransferResponse response_;
  std::unique_ptr<grpc::ClientWriter<v1::Chunk>> writer_;
  std::thread thread_;
  absl::Notification done_;

  absl::Mutex mu_;
  std::deque<v1::Chunk> queue_ ABSL_GUARDED_BY(mu_);
  size_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
};

GrpcTransport::GrpcTransport(int rank, std::vector<std::string> addresses, std::string cluster_id,
                             Mailbox* mailbox)
    : rank_(rank), addresses_(std::move(addresses)), cluster_id_(std::move(cluster_id)), mailbox_(mailbox),
      links_(addresses_.size()) {}

GrpcTransport::~GrpcTransport() {
  absl::MutexLock lock(&mu_);
  links_.clear();
}

absl::StatusOr<GrpcTransport::PeerLink*> GrpcTransport::Link(int peer) {
  if (peer < 0 || peer >= world_size() || peer == rank_) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank_, " cannot send to rank ", peer,
                                                   " (world size ", world_size(), ")"));
  }
  absl::MutexLock lock(&mu_);
  if (!aborted_.ok()) return aborted_;
  if (!links_[peer]) links_[peer] = std::make_unique<PeerLink>(rank_, peer, addresses_[peer], cluster_id_);
  return links_[peer].get();
}

absl::Status GrpcTransport::Send(int peer, uint64_t tag, absl::string_view data, absl::Time deadline) {
  absl::StatusOr<PeerLink*> link = Link(peer);
  if (!link.ok()) return link.status();
  return (*link)->Enqueue(tag, data, deadline);
}

absl::StatusOr<std::string> GrpcTransport::Recv(int peer, uint64_t tag, absl::Time deadline) {
  if (peer < 0 || peer >= world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("recv from rank ", peer, "; world size is ", world_size()));
  }
  return mailbox_->Take(peer, tag, deadline);
}

void GrpcTransport::Abort(const absl::Status& reason) {
  {
    absl::MutexLock lock(&mu_);
    if (aborted_.ok()) aborted_ = reason;
  }
  mailbox_->Abort(reason);
}

void GrpcTransport::Reset() {
  std::vector<std::unique_ptr<PeerLink>> broken;
  {
    absl::MutexLock lock(&mu_);
    aborted_ = absl::OkStatus();
    for (auto& link : links_) {
      if (link && link->failed()) broken.push_back(std::move(link));
    }
  }
  broken.clear();  // joins their threads outside the lock
  mailbox_->Reset();
}

}  // namespace meshrun
