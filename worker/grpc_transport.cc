#include "worker/grpc_transport.h"

#include <algorithm>
#include <atomic>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "net/grpc_util.h"
#include "worker/ring_frame.h"

namespace meshrun {
namespace {

// The method's full name, as the generated code names it ("/package.Service/Method").
constexpr char kTransferMethod[] = "/meshrun.v1.Ring/Transfer";

}  // namespace

// ---------------------------------------------------------------------------------------------
// Receiving side: one reactor per incoming stream.

class RingService::Reactor : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  Reactor(grpc::CallbackServerContext* ctx, Mailbox* mailbox, std::shared_ptr<StripeJoiner> joiner,
          int world_size, std::string cluster_id)
      : ctx_(ctx),
        mailbox_(mailbox),
        stream_(std::move(joiner), world_size, std::move(cluster_id)) {
    StartRead(&frame_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      if (stream_.src() >= 0 && !stream_.goodbye()) {
        LOG(WARNING) << "ring stream from rank " << stream_.src() << " ended without goodbye ("
                     << ctx_->peer() << ")";
        mailbox_->MarkPeerFailed(
            stream_.src(),
            absl::UnavailableError(
                absl::StrCat("rank ", stream_.src(),
                             " disconnected: its ring stream ended unexpectedly (process died?)")));
      }
      Finish(grpc::Status::OK);
      return;
    }
    std::vector<grpc::Slice> slices;
    absl::Status s = FromGrpcStatus(frame_.Dump(&slices));
    frame_.Clear();
    if (s.ok()) s = stream_.Receive(std::move(slices));
    if (!s.ok()) {
      Finish(ToGrpcStatus(s));
      return;
    }
    StartRead(&frame_);
  }

  void OnDone() override { delete this; }

 private:
  grpc::CallbackServerContext* ctx_;
  Mailbox* mailbox_;
  RingStreamReceiver stream_;
  grpc::ByteBuffer frame_;
};

void RingService::Attach(Mailbox* mailbox, int world_size, std::string cluster_id) {
  absl::MutexLock lock(&mu_);
  mailbox_ = mailbox;
  joiner_ = std::make_shared<StripeJoiner>(mailbox, world_size);
  world_size_ = world_size;
  cluster_id_ = std::move(cluster_id);
}

grpc::ServerReadReactor<grpc::ByteBuffer>* RingService::Transfer(
    grpc::CallbackServerContext* context, grpc::ByteBuffer* response) {
  // The empty response, as a valid (zero-length) message: gRPC refuses to send a ByteBuffer that
  // holds no buffer at all.
  grpc::Slice empty;
  *response = grpc::ByteBuffer(&empty, 1);
  absl::MutexLock lock(&mu_);
  if (mailbox_ == nullptr) {
    class Reject : public grpc::ServerReadReactor<grpc::ByteBuffer> {
     public:
      Reject() {
        Finish(grpc::Status(grpc::FAILED_PRECONDITION, "this worker has not joined a cluster yet"));
      }
      void OnDone() override { delete this; }
    };
    return new Reject();
  }
  return new Reactor(context, mailbox_, joiner_, world_size_, cluster_id_);
}

// ---------------------------------------------------------------------------------------------
// Sending side: one stream per peer, written by the caller's thread.

class GrpcTransport::PeerLink {
 public:
  PeerLink(int self, int peer, int lane, const std::string& address, const std::string& cluster_id)
      : self_(self),
        peer_(peer),
        lane_(lane),
        address_(address),
        cluster_id_(cluster_id),
        channel_(CreateChannel(address)),
        method_(kTransferMethod, grpc::internal::RpcMethod::CLIENT_STREAMING, channel_) {}

  // Sends goodbye (so the peer knows the close is deliberate) and ends the stream. Each write is
  // bounded by a 2 s deadline that the transport's watchdog enforces.
  void Close() {
    absl::MutexLock lock(&mu_);
    if (writer_ == nullptr) return;
    if (failed_.ok()) {
      SetWriteDeadline(absl::Now() + absl::Seconds(2));
      FrameHeader bye;
      bye.src_rank = self_;
      bye.flags = kGoodbye;
      bye.lane = lane_;
      grpc::Slice header(EncodeFrameHeader(bye));
      grpc::ByteBuffer frame(&header, 1);
      if (writer_->Write(frame)) writer_->WritesDone();
    }
    SetWriteDeadline(absl::Now() + absl::Seconds(2));
    writer_->Finish();
    writer_.reset();
  }

  // `stripes`: on lane 0, how many lanes carry this message (this is piece 0); otherwise 1.
  absl::Status Send(uint64_t epoch, uint64_t tag, int stripes, absl::string_view data,
                    absl::Time deadline) {
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
      // What the generated stub's Transfer does, with raw frames for messages.
      writer_.reset(grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(
          channel_.get(), method_, &ctx_, &response_));
    }
    FrameHeader h;
    h.src_rank = self_;
    h.lane = lane_;
    h.stripes = stripes;
    h.epoch = epoch;
    h.tag = tag;
    if (first) h.cluster_id = cluster_id_;
    // The payload's one copy on this side (see the header for why it is not a slice that points
    // at the caller's memory).
    grpc::Slice slices[2] = {grpc::Slice(EncodeFrameHeader(h)),
                             grpc::Slice(data.data(), data.size())};
    grpc::ByteBuffer frame(slices, data.empty() ? 1 : 2);
    const bool ok = writer_->Write(frame);
    in_write_.store(false);
    SetWriteDeadline(absl::InfiniteFuture());
    if (!ok) {
      failed_ = cancelled_for_deadline_
                    ? absl::DeadlineExceededError(
                          absl::StrCat("send to rank ", peer_, " at ", address_, " (lane ", lane_,
                                       ") timed out (peer not reading or unreachable)"))
                    : absl::UnavailableError(
                          absl::StrCat("ring link to rank ", peer_, " at ", address_, " (lane ",
                                       lane_, ") is broken (peer died or unreachable)"));
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

  const int self_, peer_, lane_;
  const std::string address_, cluster_id_;
  const std::shared_ptr<grpc::Channel> channel_;
  const grpc::internal::RpcMethod method_;
  absl::Mutex mu_;  // one writer at a time
  grpc::ClientContext ctx_;
  grpc::ByteBuffer response_;
  std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer_ ABSL_GUARDED_BY(mu_);
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
  absl::Mutex deadline_mu_;
  absl::Time write_deadline_ ABSL_GUARDED_BY(deadline_mu_) = absl::InfiniteFuture();
  bool cancelled_for_deadline_ = false;  // written under deadline_mu_, read after the write fails
  std::atomic<bool> cancelled_{false};
  std::atomic<bool> in_write_{false};
};

GrpcTransport::GrpcTransport(int rank, std::vector<std::string> addresses, std::string cluster_id,
                             Mailbox* mailbox, GrpcStripeOptions stripes)
    : rank_(rank),
      addresses_(std::move(addresses)),
      cluster_id_(std::move(cluster_id)),
      mailbox_(mailbox),
      stripes_(stripes),
      lanes_(std::clamp(stripes.max_stripes, 1, kMaxLanes)),
      links_(addresses_.size() * lanes_) {
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

absl::StatusOr<GrpcTransport::PeerLink*> GrpcTransport::Link(int peer, int lane) {
  if (peer < 0 || peer >= world_size() || peer == rank_) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank_, " cannot send to rank ", peer,
                                                   " (world size ", world_size(), ")"));
  }
  absl::MutexLock lock(&mu_);
  if (!aborted_.ok()) return aborted_;
  std::unique_ptr<PeerLink>& link = links_[peer * lanes_ + lane];
  if (!link) link = std::make_unique<PeerLink>(rank_, peer, lane, addresses_[peer], cluster_id_);
  return link.get();
}

int GrpcTransport::StripesFor(size_t bytes) const {
  const size_t stripes = bytes / std::max<size_t>(stripes_.stripe_bytes, 1);
  return static_cast<int>(std::clamp<size_t>(stripes, 1, lanes_));
}

absl::Status GrpcTransport::Send(int peer, uint64_t tag, absl::string_view data,
                                 absl::Time deadline) {
  const uint64_t epoch = mailbox_->epoch();
  const int stripes = StripesFor(data.size());
  // Pieces of whole 8-byte words (RecvSink's promise holds across them), written one lane after
  // the other: each write returns once its bytes are in the connection, so the lanes' sockets
  // and the receiver's threads that read them work side by side.
  const size_t piece = stripes == 1 ? data.size() : (data.size() / stripes + 7) / 8 * 8;
  absl::Status s;
  for (int lane = 0; lane < stripes && s.ok(); ++lane) {
    absl::StatusOr<PeerLink*> link = Link(peer, lane);
    if (!link.ok()) return link.status();
    const size_t begin = std::min(data.size(), lane * piece);
    const size_t size =
        lane + 1 == stripes ? data.size() - begin : std::min(piece, data.size() - begin);
    s = (*link)->Send(epoch, tag, lane == 0 ? stripes : 1, data.substr(begin, size), deadline);
  }
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
