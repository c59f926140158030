#include "worker/grpc_transport.h"

#include <atomic>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "net/grpc_util.h"

namespace meshrun {

// ---------------------------------------------------------------------------------------------
// Receiving side: one reactor per incoming stream.

class RingService::Reactor : public grpc::ServerReadReactor<v1::Chunk> {
 public:
  Reactor(grpc::CallbackServerContext* ctx, Mailbox* mailbox, int world_size,
          std::string cluster_id)
      : ctx_(ctx), mailbox_(mailbox), world_size_(world_size), cluster_id_(std::move(cluster_id)) {
    StartRead(&chunk_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      if (src_ >= 0 && !goodbye_) {
        LOG(WARNING) << "ring stream from rank " << src_ << " ended without goodbye ("
                     << ctx_->peer() << ")";
        mailbox_->MarkPeerFailed(
            src_, absl::UnavailableError(absl::StrCat(
                      "rank ", src_,
                      " disconnected: its ring stream ended unexpectedly (process died?)")));
      }
      Finish(grpc::Status::OK);
      return;
    }
    if (src_ < 0) {
      if (chunk_.src_rank() < 0 || chunk_.src_rank() >= world_size_) {
        Finish(grpc::Status(grpc::INVALID_ARGUMENT,
                            absl::StrCat("ring chunk from rank ", chunk_.src_rank(),
                                         "; world size is ", world_size_)));
        return;
      }
      if (chunk_.cluster_id() != cluster_id_) {
        Finish(grpc::Status(grpc::FAILED_PRECONDITION,
                            absl::StrCat("ring stream from cluster '", chunk_.cluster_id(),
                                         "'; this is '", cluster_id_, "'")));
        return;
      }
      src_ = chunk_.src_rank();
    }
    if (chunk_.goodbye()) {
      goodbye_ = true;
    } else {
      mailbox_->Deliver(src_, chunk_.epoch(), chunk_.tag(), std::move(*chunk_.mutable_data()));
    }
    StartRead(&chunk_);
  }

  void OnDone() override { delete this; }

 private:
  grpc::CallbackServerContext* ctx_;
  Mailbox* mailbox_;
  const int world_size_;
  const std::string cluster_id_;
  v1::Chunk chunk_;
  int src_ = -1;
  bool goodbye_ = false;
};

void RingService::Attach(Mailbox* mailbox, int world_size, std::string cluster_id) {
  absl::MutexLock lock(&mu_);
  mailbox_ = mailbox;
  world_size_ = world_size;
  cluster_id_ = std::move(cluster_id);
}

grpc::ServerReadReactor<v1::Chunk>* RingService::Transfer(grpc::CallbackServerContext* context,
                                                          v1::TransferResponse*) {
  absl::MutexLock lock(&mu_);
  if (mailbox_ == nullptr) {
    class Reject : public grpc::ServerReadReactor<v1::Chunk> {
     public:
      Reject() {
        Finish(grpc::Status(grpc::FAILED_PRECONDITION, "this worker has not joined a cluster yet"));
      }
      void OnDone() override { delete this; }
    };
    return new Reject();
  }
  return new Reactor(context, mailbox_, world_size_, cluster_id_);
}

// ---------------------------------------------------------------------------------------------
// Sending side: one stream per peer, written by the caller's thread.

class GrpcTransport::PeerLink {
 public:
  PeerLink(int self, int peer, const std::string& address, const std::string& cluster_id)
      : self_(self),
        peer_(peer),
        address_(address),
        cluster_id_(cluster_id),
        stub_(v1::Ring::NewStub(CreateChannel(address))) {}

  // Sends goodbye (so the peer knows the close is deliberate) and ends the stream. Each write is
  // bounded by a 2 s deadline that the transport's watchdog enforces.
  void Close() {
    absl::MutexLock lock(&mu_);
    if (writer_ == nullptr) return;
    if (failed_.ok()) {
      SetWriteDeadline(absl::Now() + absl::Seconds(2));
      v1::Chunk bye;
      bye.set_src_rank(self_);
      bye.set_goodbye(true);
      if (writer_->Write(bye)) writer_->WritesDone();
    }
    SetWriteDeadline(absl::Now() + absl::Seconds(2));
    writer_->Finish();
    writer_.reset();
  }

  absl::Status Send(uint64_t epoch, uint64_t tag, absl::string_view data, absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    if (!failed_.ok()) return failed_;
    const bool first = writer_ == nullptr;
    // Armed before the stream opens: opening waits for the connection (wait_for_ready), and a
    // peer that is unreachable must fail this send at its deadline, not hang it.
    SetWriteDeadline(deadline);
    in_write_.store(true);
    if (first) {
      ctx_.set_wait_for_ready(
          true);  // the peer may still be starting; the deadline bounds the wait
      writer_ = stub_->Transfer(&ctx_, &response_);
    }
    chunk_.set_src_rank(self_);
    chunk_.set_epoch(epoch);
    chunk_.set_tag(tag);
    chunk_.set_data(data.data(), data.size());
    if (first) chunk_.set_cluster_id(cluster_id_);
    const bool ok = writer_->Write(chunk_);
    in_write_.store(false);
    SetWriteDeadline(absl::InfiniteFuture());
    if (first) chunk_.clear_cluster_id();
    if (!ok) {
      failed_ =
          cancelled_for_deadline_
              ? absl::DeadlineExceededError(
                    absl::StrCat("send to rank ", peer_, " at ", address_,
                                 " timed out (peer not reading or unreachable)"))
              : absl::UnavailableError(absl::StrCat("ring link to rank ", peer_, " at ", address_,
                                                    " is broken (peer died or unreachable)"));
      return failed_;
    }
    return absl::OkStatus();
  }

  bool failed() {
    if (cancelled_.load()) return true;
    absl::MutexLock lock(&mu_);
    return !failed_.ok();
  }

  // Cancels the stream if a write is in flight (it returns at once); the link then counts as
  // failed, so Reset() replaces it. Idle links are left alone: cancelling them would show peers
  // a disconnect instead of the abort.
  void CancelWrite() {
    if (!in_write_.load()) return;
    cancelled_.store(true);
    ctx_.TryCancel();
  }

  // Called by the transport's watchdog: cancels a write blocked past its deadline.
  void CheckDeadline(absl::Time now) {
    absl::MutexLock lock(&deadline_mu_);
    if (now > write_deadline_ && !cancelled_for_deadline_) {
      cancelled_for_deadline_ = true;
      ctx_.TryCancel();
    }
  }

 private:
  void SetWriteDeadline(absl::Time t) {
    absl::MutexLock lock(&deadline_mu_);
    write_deadline_ = t;
  }

  const int self_, peer_;
  const std::string address_, cluster_id_;
  std::unique_ptr<v1::Ring::Stub> stub_;
  absl::Mutex mu_;  // one writer at a time
  grpc::ClientContext ctx_;
  v1::TransferResponse response_;
  std::unique_ptr<grpc::ClientWriter<v1::Chunk>> writer_ ABSL_GUARDED_BY(mu_);
  v1::Chunk chunk_ ABSL_GUARDED_BY(mu_);
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
  absl::Mutex deadline_mu_;
  absl::Time write_deadline_ ABSL_GUARDED_BY(deadline_mu_) = absl::InfiniteFuture();
  bool cancelled_for_deadline_ = false;  // written under deadline_mu_, read after the write fails
  std::atomic<bool> cancelled_{false};
  std::atomic<bool> in_write_{false};
};

GrpcTransport::GrpcTransport(int rank, std::vector<std::string> addresses, std::string cluster_id,
                             Mailbox* mailbox)
    : rank_(rank),
      addresses_(std::move(addresses)),
      cluster_id_(std::move(cluster_id)),
      mailbox_(mailbox),
      links_(addresses_.size()) {
  watchdog_ = std::thread([this] { WatchdogLoop(); });
}

GrpcTransport::~GrpcTransport() {
  std::vector<PeerLink*> links;
  {
    absl::MutexLock lock(&mu_);
    for (auto& link : links_) {
      if (link) links.push_back(link.get());
    }
  }
  for (PeerLink* link : links) link->Close();  // the watchdog still guards these writes
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  watchdog_.join();
}

void GrpcTransport::WatchdogLoop() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    auto stop = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_; };
    mu_.AwaitWithTimeout(absl::Condition(&stop), absl::Milliseconds(100));
    const absl::Time now = absl::Now();
    for (auto& link : links_) {
      if (link) link->CheckDeadline(now);
    }
  }
}

absl::StatusOr<GrpcTransport::PeerLink*> GrpcTransport::Link(int peer) {
  if (peer < 0 || peer >= world_size() || peer == rank_) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank_, " cannot send to rank ", peer,
                                                   " (world size ", world_size(), ")"));
  }
  absl::MutexLock lock(&mu_);
  if (!aborted_.ok()) return aborted_;
  if (!links_[peer])
    links_[peer] = std::make_unique<PeerLink>(rank_, peer, addresses_[peer], cluster_id_);
  return links_[peer].get();
}

absl::Status GrpcTransport::Send(int peer, uint64_t tag, absl::string_view data,
                                 absl::Time deadline) {
  absl::StatusOr<PeerLink*> link = Link(peer);
  if (!link.ok()) return link.status();
  absl::Status s = (*link)->Send(mailbox_->epoch(), tag, data, deadline);
  if (!s.ok()) {
    // A send cut short by Abort reports the abort's reason, not the cancelled link.
    absl::MutexLock lock(&mu_);
    if (!aborted_.ok()) return aborted_;
  }
  return s;
}

absl::StatusOr<std::string> GrpcTransport::Recv(int peer, uint64_t tag, absl::Time deadline) {
  if (absl::Status s = CheckPeer("recv from", peer); !s.ok()) return s;
  return mailbox_->Take(peer, tag, deadline);
}

absl::Status GrpcTransport::RecvInto(int peer, uint64_t tag, size_t size, absl::Time deadline,
                                     RecvSink sink) {
  if (absl::Status s = CheckPeer("recv from", peer); !s.ok()) return s;
  return mailbox_->TakeInto(peer, tag, size, deadline, sink);
}

void GrpcTransport::Abort(const absl::Status& reason) {
  {
    absl::MutexLock lock(&mu_);
    if (aborted_.ok()) aborted_ = reason;
    // A send blocked in a write (a peer that stopped reading or never answered) returns now;
    // the cancelled links are replaced on Reset().
    for (auto& link : links_) {
      if (link) link->CancelWrite();
    }
  }
  mailbox_->Abort(reason);
}

void GrpcTransport::Reset(uint64_t epoch) {
  if (epoch <= mailbox_->epoch()) return;
  std::vector<std::unique_ptr<PeerLink>> broken;
  {
    absl::MutexLock lock(&mu_);
    aborted_ = absl::OkStatus();
    for (auto& link : links_) {
      if (link && link->failed()) broken.push_back(std::move(link));
    }
  }
  for (auto& link : broken) link->Close();  // outside the lock: the watchdog guards the close
  broken.clear();
  mailbox_->Reset(epoch);
}

}  // namespace meshrun
