#include "worker/grpc_transport.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "net/grpc_util.h"

namespace meshrun {

// ---------------------------------------------------------------------------------------------
// The frame: what one message of Ring.Transfer carries (raw bytes, not a protobuf message).

namespace {

// The method's full name, as the generated code names it ("/package.Service/Method").
constexpr char kTransferMethod[] = "/meshrun.v1.Ring/Transfer";
constexpr size_t kFrameHeaderBytes = 24;
constexpr uint16_t kGoodbye = 1;  // the sender closes the stream on purpose; no payload

void Put(char* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
uint64_t Get(const char* in, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i)
    v |= static_cast<uint64_t>(static_cast<uint8_t>(in[i])) << (8 * i);
  return v;
}

// The header and cluster id of a frame; the payload is the rest of the message.
struct FrameHeader {
  int src_rank = 0;
  uint16_t flags = 0;
  uint64_t epoch = 0;
  uint64_t tag = 0;
  std::string cluster_id;  // only on a stream's first frame
};

std::string EncodeHeader(const FrameHeader& h) {
  std::string out(kFrameHeaderBytes + h.cluster_id.size(), '\0');
  Put(&out[0], static_cast<uint32_t>(h.src_rank), 4);
  Put(&out[4], h.flags, 2);
  Put(&out[6], h.cluster_id.size(), 2);
  Put(&out[8], h.epoch, 8);
  Put(&out[16], h.tag, 8);
  std::copy(h.cluster_id.begin(), h.cluster_id.end(), out.begin() + kFrameHeaderBytes);
  return out;
}

// Reads a received frame where gRPC's slices hold it: the header is copied out (it may straddle
// slices), the payload is passed on piece by piece.
class FrameReader {
 public:
  explicit FrameReader(std::vector<grpc::Slice> slices) : slices_(std::move(slices)) {
    for (const grpc::Slice& s : slices_) remaining_ += s.size();
  }
  size_t remaining() const { return remaining_; }

  absl::StatusOr<FrameHeader> ReadHeader() {
    char fixed[kFrameHeaderBytes];
    if (!Read(fixed, kFrameHeaderBytes)) {
      return absl::InvalidArgumentError(absl::StrCat("ring frame of ", remaining_,
                                                     " bytes is shorter than its ",
                                                     kFrameHeaderBytes, "-byte header"));
    }
    FrameHeader h;
    h.src_rank = static_cast<int32_t>(Get(&fixed[0], 4));
    h.flags = static_cast<uint16_t>(Get(&fixed[4], 2));
    const size_t id_bytes = Get(&fixed[6], 2);
    h.epoch = Get(&fixed[8], 8);
    h.tag = Get(&fixed[16], 8);
    h.cluster_id.resize(id_bytes);
    if (!Read(h.cluster_id.data(), id_bytes)) {
      return absl::InvalidArgumentError(
          absl::StrCat("ring frame declares a ", id_bytes, "-byte cluster id but ends first"));
    }
    return h;
  }

  // Passes the unread bytes to `sink` where gRPC's slices hold them (SinkStitcher keeps
  // RecvSink's promise of whole 8-byte words across slice boundaries).
  void ForEachPiece(RecvSink sink) {
    SinkStitcher stitcher(sink);
    for (; slice_ < slices_.size(); ++slice_, pos_ = 0) {
      const grpc::Slice& s = slices_[slice_];
      stitcher.Add(reinterpret_cast<const char*>(s.begin()) + pos_, s.size() - pos_);
    }
    stitcher.Finish();
    remaining_ = 0;
  }

  // The unread bytes as a Cord over gRPC's slices (each holds a reference to its slice): no copy.
  absl::Cord Rest() {
    absl::Cord rest;
    for (; slice_ < slices_.size(); ++slice_, pos_ = 0) {
      const grpc::Slice& s = slices_[slice_];
      if (s.size() == pos_) continue;
      const absl::string_view piece(reinterpret_cast<const char*>(s.begin()) + pos_,
                                    s.size() - pos_);
      rest.Append(absl::MakeCordFromExternal(piece, [keep = s](absl::string_view) {}));
    }
    remaining_ = 0;
    return rest;
  }

 private:
  bool Read(char* out, size_t n) {
    if (n > remaining_) return false;
    remaining_ -= n;
    while (n > 0) {
      const grpc::Slice& s = slices_[slice_];
      const size_t take = std::min(n, s.size() - pos_);
      std::memcpy(out, s.begin() + pos_, take);
      out += take;
      n -= take;
      pos_ += take;
      if (pos_ == s.size()) {
        ++slice_;
        pos_ = 0;
      }
    }
    return true;
  }

  std::vector<grpc::Slice> slices_;
  size_t slice_ = 0, pos_ = 0, remaining_ = 0;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Receiving side: one reactor per incoming stream.

class RingService::Reactor : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  Reactor(grpc::CallbackServerContext* ctx, Mailbox* mailbox, int world_size,
          std::string cluster_id)
      : ctx_(ctx), mailbox_(mailbox), world_size_(world_size), cluster_id_(std::move(cluster_id)) {
    StartRead(&frame_);
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
    if (absl::Status s = Receive(); !s.ok()) {
      Finish(ToGrpcStatus(s));
      return;
    }
    StartRead(&frame_);
  }

  void OnDone() override { delete this; }

 private:
  absl::Status Receive() {
    std::vector<grpc::Slice> slices;
    if (grpc::Status s = frame_.Dump(&slices); !s.ok()) return FromGrpcStatus(s);
    frame_.Clear();
    FrameReader reader(std::move(slices));
    absl::StatusOr<FrameHeader> h = reader.ReadHeader();
    if (!h.ok()) return h.status();
    if (src_ < 0) {
      if (h->src_rank < 0 || h->src_rank >= world_size_) {
        return absl::InvalidArgumentError(
            absl::StrCat("ring frame from rank ", h->src_rank, "; world size is ", world_size_));
      }
      if (h->cluster_id != cluster_id_) {
        return absl::FailedPreconditionError(absl::StrCat(
            "ring stream from cluster '", h->cluster_id, "'; this is '", cluster_id_, "'"));
      }
      src_ = h->src_rank;
    } else if (h->src_rank != src_) {
      return absl::InvalidArgumentError(
          absl::StrCat("ring frame from rank ", h->src_rank, " on rank ", src_, "'s stream"));
    }
    if (h->flags & kGoodbye) {
      goodbye_ = true;
      return absl::OkStatus();
    }
    // No copy either way: the sink reduces or copies straight out of gRPC's slices, now if the
    // collective has posted this receive, or when it takes the queued slices.
    const size_t size = reader.remaining();
    if (const RecvSink* sink = mailbox_->BeginInPlace(src_, h->epoch, h->tag, size)) {
      reader.ForEachPiece(*sink);
      mailbox_->EndInPlace(src_);
      return absl::OkStatus();
    }
    mailbox_->Deliver(src_, h->epoch, h->tag, reader.Rest());
    return absl::OkStatus();
  }

  grpc::CallbackServerContext* ctx_;
  Mailbox* mailbox_;
  const int world_size_;
  const std::string cluster_id_;
  grpc::ByteBuffer frame_;
  int src_ = -1;
  bool goodbye_ = false;
};

void RingService::Attach(Mailbox* mailbox, int world_size, std::string cluster_id) {
  absl::MutexLock lock(&mu_);
  mailbox_ = mailbox;
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
      grpc::Slice header(EncodeHeader(bye));
      grpc::ByteBuffer frame(&header, 1);
      if (writer_->Write(frame)) writer_->WritesDone();
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
      // What the generated stub's Transfer does, with raw frames for messages.
      writer_.reset(grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(
          channel_.get(), method_, &ctx_, &response_));
    }
    FrameHeader h;
    h.src_rank = self_;
    h.epoch = epoch;
    h.tag = tag;
    if (first) h.cluster_id = cluster_id_;
    // The payload's one copy on this side (see the header for why it is not a slice that points
    // at the caller's memory).
    grpc::Slice slices[2] = {grpc::Slice(EncodeHeader(h)), grpc::Slice(data.data(), data.size())};
    grpc::ByteBuffer frame(slices, data.empty() ? 1 : 2);
    const bool ok = writer_->Write(frame);
    in_write_.store(false);
    SetWriteDeadline(absl::InfiniteFuture());
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
