#include "worker/grpc_transport.h"

#include <grpc/slice.h>
#include <grpcpp/completion_queue.h>
#include <grpcpp/support/async_stream.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
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
// Sending side: one stream per peer, written by the caller's thread, which waits for each write
// on the stream's own completion queue up to the write's deadline.

namespace {

// Tags of a stream's operations on its completion queue.
void* const kWriteTag = reinterpret_cast<void*>(1);
void* const kWritesDoneTag = reinterpret_cast<void*>(2);
void* const kFinishTag = reinterpret_cast<void*>(3);

// How often a waiting sender looks whether Abort cancelled its write.
constexpr absl::Duration kCancelPoll = absl::Milliseconds(100);

}  // namespace

// The gRPC objects of one client stream. A stream whose operation did not come back by its
// deadline (a peer that stopped reading, with the socket full) is abandoned: a detached thread
// keeps it until gRPC returns the operation (the socket drains or the connection closes) and
// then frees it, so no sender waits on it.
struct GrpcTransport::Stream {
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  grpc::ByteBuffer response;
  grpc::Status status;
  // Allocated in the call's arena: destroyed before ctx, which frees the call.
  std::unique_ptr<grpc::ClientAsyncWriter<grpc::ByteBuffer>> writer;
  int pending = 0;  // operations posted whose tags have not come back

  enum class Wait { kOk, kFailed, kTimedOut, kCancelled };

  // Posts a write of `frame` (one at a time: the last one's tag must be back first).
  void StartWrite(const grpc::ByteBuffer& frame) {
    writer->Write(frame, kWriteTag);
    ++pending;
  }

  // Writes `frame` and waits for the write until `deadline`, or until `cancelled` is set.
  Wait Write(const grpc::ByteBuffer& frame, absl::Time deadline,
             const std::atomic<bool>* cancelled) {
    StartWrite(frame);
    return Await(kWriteTag, deadline, cancelled);
  }

  // Half-closes the stream and waits until `deadline` for the peer's status.
  void Finish(absl::Time deadline) {
    writer->WritesDone(kWritesDoneTag);
    writer->Finish(&status, kFinishTag);
    pending += 2;
    // Both come back in either order; Await counts the other one as it goes by.
    if (Await(kFinishTag, deadline, nullptr) == Wait::kTimedOut) return;
    if (pending > 0) Await(kWritesDoneTag, deadline, nullptr);
  }

  // Waits for `tag` until `deadline`, or until `cancelled` is set (checked every kCancelPoll).
  // Counts every operation that comes back, `tag`'s or another's.
  Wait Await(void* tag, absl::Time deadline, const std::atomic<bool>* cancelled) {
    for (;;) {
      const absl::Time until = std::min(deadline, absl::Now() + kCancelPoll);
      void* got = nullptr;
      bool ok = false;
      switch (cq.AsyncNext(&got, &ok, absl::ToChronoTime(until))) {
        case grpc::CompletionQueue::GOT_EVENT:
          --pending;
          if (got == tag) return ok ? Wait::kOk : Wait::kFailed;
          break;  // another operation of this stream (Close waits for two)
        case grpc::CompletionQueue::TIMEOUT:
          if (absl::Now() >= deadline) return Wait::kTimedOut;
          if (cancelled != nullptr && cancelled->load()) return Wait::kCancelled;
          break;
        case grpc::CompletionQueue::SHUTDOWN:
          return Wait::kFailed;
      }
    }
  }

  // Frees the stream once every posted operation is back, without waiting for them here.
  static void Release(std::unique_ptr<Stream> stream) {
    stream->ctx.TryCancel();  // a no-op for a call that finished
    stream->cq.Shutdown();
    auto drain = [](std::unique_ptr<Stream> s) {
      void* tag;
      bool ok;
      while (s->cq.Next(&tag, &ok)) {
      }
    };
    if (stream->pending == 0) {
      drain(std::move(stream));
    } else {
      std::thread(drain, std::move(stream)).detach();
    }
  }
};

class GrpcTransport::PeerLink {
 public:
  PeerLink(int self, int peer, int lane, const std::string& address, const std::string& cluster_id,
           size_t eager_send_bytes)
      : self_(self),
        peer_(peer),
        lane_(lane),
        address_(address),
        cluster_id_(cluster_id),
        eager_send_bytes_(eager_send_bytes),
        channel_(CreateChannel(address)),
        method_(kTransferMethod, grpc::internal::RpcMethod::CLIENT_STREAMING, channel_) {}

  ~PeerLink() { Close(); }

  // Sends goodbye (so the peer knows the close is deliberate) and ends the stream, waiting at
  // most 2 s for each (and for a small write still posted); a stream with a write still out is
  // abandoned (Stream::Release).
  void Close() {
    absl::MutexLock lock(&mu_);
    if (stream_ == nullptr) return;
    if (posted_ && failed_.ok() && !cancelled_.load()) {
      AwaitWrite(absl::Now() + absl::Seconds(2)).IgnoreError();
    }
    if (failed_.ok() && !cancelled_.load() && stream_->pending == 0) SayGoodbye();
    Stream::Release(std::move(stream_));
  }

  // `stripes`: on lane 0, how many lanes carry this message (this is piece 0); otherwise 1.
  // `payload`: the message's (or this lane's piece's) bytes, in order.
  absl::Status Send(uint64_t epoch, uint64_t tag, int stripes, std::vector<grpc::Slice> payload,
                    absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    if (!failed_.ok()) return failed_;
    // The last small write is waited for now, before this one is posted.
    if (posted_) {
      if (absl::Status s = AwaitWrite(deadline); !s.ok()) return s;
    }
    const bool first = stream_ == nullptr;
    if (first) Open();
    FrameHeader h;
    h.src_rank = self_;
    h.lane = lane_;
    h.stripes = stripes;
    h.epoch = epoch;
    h.tag = tag;
    if (first) h.cluster_id = cluster_id_;
    size_t size = 0;
    for (const grpc::Slice& slice : payload) size += slice.size();
    payload.insert(payload.begin(), grpc::Slice(EncodeFrameHeader(h)));
    const grpc::ByteBuffer frame(payload.data(), payload.size());
    stream_->StartWrite(frame);
    posted_ = true;
    // A small write is left to complete while the caller goes on (it holds its own copy of the
    // payload); the next Send on this link, or Close, waits for it. The first write also opens
    // the stream, which waits for the connection (wait_for_ready): it is waited for here, so
    // the deadline bounds that wait.
    if (!first && size <= eager_send_bytes_) return absl::OkStatus();
    return AwaitWrite(deadline);
  }

  // Whether the link is broken; a small write posted and failed since counts.
  bool failed() {
    if (cancelled_.load()) return true;
    absl::MutexLock lock(&mu_);
    if (posted_ && failed_.ok()) {
      // A deadline already here: only an outcome that is back is taken.
      const Stream::Wait outcome = stream_->Await(kWriteTag, absl::Now(), nullptr);
      if (outcome != Stream::Wait::kTimedOut) Completed(outcome).IgnoreError();  // kept in failed_
    }
    return !failed_.ok();
  }

  // Cancels the stream if a sender waits for its write (its Send returns at once, or within
  // kCancelPoll when the write is stuck in a full socket); the link then counts as failed, so
  // Reset() replaces it. Idle links, and links whose last small write was posted but not yet
  // waited for, are left alone: cancelling them would show peers a disconnect instead of the
  // abort (such a write stuck at a stopped peer fails the link's next Send at its deadline).
  void CancelWrite() {
    absl::MutexLock lock(&cancel_mu_);
    if (writing_ == nullptr) return;
    cancelled_.store(true);
    writing_->TryCancel();
  }

 private:
  // Waits for the posted write until `deadline`; a write not back by then, or failed, fails the
  // link.
  absl::Status AwaitWrite(absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    {
      absl::MutexLock cancel_lock(&cancel_mu_);
      writing_ = &stream_->ctx;
    }
    const Stream::Wait outcome = stream_->Await(kWriteTag, deadline, &cancelled_);
    {
      absl::MutexLock cancel_lock(&cancel_mu_);
      writing_ = nullptr;
    }
    return Completed(outcome);
  }

  // Takes the posted write's outcome; a write that failed or timed out fails the link.
  absl::Status Completed(Stream::Wait outcome) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    posted_ = false;
    if (outcome == Stream::Wait::kOk) return absl::OkStatus();
    stream_->ctx.TryCancel();
    failed_ = outcome == Stream::Wait::kTimedOut
                  ? absl::DeadlineExceededError(
                        absl::StrCat("send to rank ", peer_, " at ", address_, " (lane ", lane_,
                                     ") timed out (peer not reading or unreachable)"))
                  : absl::UnavailableError(absl::StrCat("ring link to rank ", peer_, " at ",
                                                        address_, " (lane ", lane_,
                                                        ") is broken (peer died or unreachable)"));
    return failed_;
  }

  void Open() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    stream_ = std::make_unique<Stream>();
    stream_->ctx.set_wait_for_ready(true);  // the peer may still be starting
    // The stream's headers go out with its first frame (one operation to wait for).
    stream_->ctx.set_initial_metadata_corked(true);
    // What the generated stub's AsyncTransfer does, with raw frames for messages.
    stream_->writer.reset(grpc::internal::ClientAsyncWriterFactory<grpc::ByteBuffer>::Create(
        channel_.get(), &stream_->cq, method_, &stream_->ctx, &stream_->response,
        /*start=*/true, /*tag=*/nullptr));
  }

  void SayGoodbye() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    FrameHeader bye;
    bye.src_rank = self_;
    bye.flags = kGoodbye;
    bye.lane = lane_;
    grpc::Slice header(EncodeFrameHeader(bye));
    if (stream_->Write(grpc::ByteBuffer(&header, 1), absl::Now() + absl::Seconds(2), nullptr) ==
        Stream::Wait::kOk) {
      stream_->Finish(absl::Now() + absl::Seconds(2));
    }
  }

  const int self_, peer_, lane_;
  const std::string address_, cluster_id_;
  const size_t eager_send_bytes_;
  const std::shared_ptr<grpc::Channel> channel_;
  const grpc::internal::RpcMethod method_;
  absl::Mutex mu_;  // one writer at a time
  std::unique_ptr<Stream> stream_ ABSL_GUARDED_BY(mu_);
  // A write was posted whose tag has not been taken back yet (a small one left to complete).
  bool posted_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
  absl::Mutex cancel_mu_;
  // The context of the write in flight, for CancelWrite; cleared before Send lets go of mu_.
  grpc::ClientContext* writing_ ABSL_GUARDED_BY(cancel_mu_) = nullptr;
  std::atomic<bool> cancelled_{false};
};

GrpcTransport::GrpcTransport(int rank, std::vector<std::string> addresses, std::string cluster_id,
                             Mailbox* mailbox, GrpcStripeOptions stripes, size_t eager_send_bytes)
    : rank_(rank),
      addresses_(std::move(addresses)),
      cluster_id_(std::move(cluster_id)),
      mailbox_(mailbox),
      stripes_(stripes),
      eager_send_bytes_(eager_send_bytes),
      lanes_(std::clamp(stripes.max_stripes, 1, kMaxLanes)),
      links_(addresses_.size() * lanes_) {}

GrpcTransport::~GrpcTransport() {
  std::vector<std::unique_ptr<PeerLink>> links;
  {
    absl::MutexLock lock(&mu_);
    links.swap(links_);
  }
  links.clear();  // each closes its stream, sending goodbye
}

absl::StatusOr<GrpcTransport::PeerLink*> GrpcTransport::Link(int peer, int lane) {
  if (peer < 0 || peer >= world_size() || peer == rank_) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank_, " cannot send to rank ", peer,
                                                   " (world size ", world_size(), ")"));
  }
  absl::MutexLock lock(&mu_);
  if (!aborted_.ok()) return aborted_;
  std::unique_ptr<PeerLink>& link = links_[peer * lanes_ + lane];
  if (!link) {
    link = std::make_unique<PeerLink>(rank_, peer, lane, addresses_[peer], cluster_id_,
                                      eager_send_bytes_);
  }
  return link.get();
}

int GrpcTransport::StripesFor(size_t bytes) const {
  const size_t stripes = bytes / std::max<size_t>(stripes_.stripe_bytes, 1);
  return static_cast<int>(std::clamp<size_t>(stripes, 1, lanes_));
}

absl::Status GrpcTransport::Send(int peer, uint64_t tag, absl::string_view data,
                                 absl::Time deadline) {
  // The payload's one copy on this side (see the header for why it is not a slice that points
  // at the caller's memory).
  return SendFilled(peer, tag, data.size(), deadline, [&](char* dst) {
    std::memcpy(dst, data.data(), data.size());
    return absl::OkStatus();
  });
}

absl::Status GrpcTransport::SendFilled(int peer, uint64_t tag, size_t size, absl::Time deadline,
                                       SendFill fill) {
  // The peer is checked (and an abort seen) before `fill` runs, which may consume a receive.
  if (absl::StatusOr<PeerLink*> link = Link(peer, 0); !link.ok()) return link.status();
  // Filled where gRPC will send it from: one slice of gRPC's, which each lane's piece refers to.
  grpc_slice raw = grpc_slice_malloc(size);
  if (absl::Status s = fill(reinterpret_cast<char*>(GRPC_SLICE_START_PTR(raw))); !s.ok()) {
    grpc_slice_unref(raw);
    return s;
  }
  std::vector<grpc::Slice> payload;
  payload.emplace_back(raw, grpc::Slice::STEAL_REF);
  return SendPayload(peer, tag, payload, size, deadline);
}

namespace {

// The bytes [begin, end) of the message that `payload` holds, as slices that refer to its own
// (sub-slices where a piece starts or ends inside one).
std::vector<grpc::Slice> Piece(const std::vector<grpc::Slice>& payload, size_t begin, size_t end) {
  std::vector<grpc::Slice> out;
  size_t at = 0;
  for (const grpc::Slice& slice : payload) {
    const size_t lo = std::max(begin, at), hi = std::min(end, at + slice.size());
    if (lo < hi) {
      out.push_back(lo == at && hi == at + slice.size() ? slice : slice.sub(lo - at, hi - at));
    }
    at += slice.size();
  }
  return out;
}

void DeleteCordRef(void* ref) { delete static_cast<std::shared_ptr<const absl::Cord>*>(ref); }

// Slices over `cord`'s chunks, where they lie; each holds a reference to the Cord, so gRPC may
// keep them as long as it likes.
std::vector<grpc::Slice> SlicesOver(const std::shared_ptr<const absl::Cord>& cord) {
  std::vector<grpc::Slice> out;
  for (absl::string_view chunk : cord->Chunks()) {
    if (chunk.empty()) continue;
    grpc_slice slice =
        grpc_slice_new_with_user_data(const_cast<char*>(chunk.data()), chunk.size(), &DeleteCordRef,
                                      new std::shared_ptr<const absl::Cord>(cord));
    out.emplace_back(slice, grpc::Slice::STEAL_REF);
  }
  return out;
}

}  // namespace

absl::Status GrpcTransport::SendPayload(int peer, uint64_t tag,
                                        const std::vector<grpc::Slice>& payload, size_t size,
                                        absl::Time deadline) {
  const uint64_t epoch = mailbox_->epoch();
  const int stripes = StripesFor(size);
  // Pieces of whole 8-byte words (RecvSink's promise holds across them), written one lane after
  // the other: each write returns once its bytes are in the connection, so the lanes' sockets
  // and the receiver's threads that read them work side by side.
  const size_t piece = stripes == 1 ? size : (size / stripes + 7) / 8 * 8;
  absl::Status s;
  for (int lane = 0; lane < stripes && s.ok(); ++lane) {
    absl::StatusOr<PeerLink*> link = Link(peer, lane);
    if (!link.ok()) return link.status();
    const size_t begin = std::min(size, lane * piece);
    const size_t end = lane + 1 == stripes ? size : std::min(size, begin + piece);
    s = (*link)->Send(epoch, tag, lane == 0 ? stripes : 1,
                      stripes == 1 ? payload : Piece(payload, begin, end), deadline);
  }
  if (!s.ok()) {
    // A send cut short by Abort reports the abort's reason, not the cancelled link.
    absl::MutexLock lock(&mu_);
    if (!aborted_.ok()) return aborted_;
  }
  return s;
}

absl::Status GrpcTransport::Forward(int prev, uint64_t tag, char* dst, size_t size, int next,
                                    uint64_t next_tag, absl::Time deadline) {
  if (absl::Status s = CheckPeer("recv from", prev); !s.ok()) return s;
  // `next` is checked before the message is taken.
  if (absl::StatusOr<PeerLink*> link = Link(next, 0); !link.ok()) return link.status();
  absl::StatusOr<absl::Cord> message = mailbox_->TakeCord(prev, tag, deadline);
  if (!message.ok()) return message.status();
  if (message->size() != size) return WrongMessageSize(prev, tag, message->size(), size);
  // Sent on from gRPC's received slices (the Cord's chunks), then copied into dst.
  const auto cord = std::make_shared<const absl::Cord>(*std::move(message));
  absl::Status sent = SendPayload(next, next_tag, SlicesOver(cord), size, deadline);
  size_t offset = 0;
  for (absl::string_view chunk : cord->Chunks()) {
    std::memcpy(dst + offset, chunk.data(), chunk.size());
    offset += chunk.size();
  }
  return sent;
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
  broken.clear();  // outside the lock: each closes its stream
  mailbox_->Reset(epoch);
}

}  // namespace meshrun
