#include "worker/stripe_joiner.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace meshrun {
namespace {

absl::Status WrongPiece(int lane, uint64_t piece_tag, uint64_t message_tag) {
  return absl::InvalidArgumentError(absl::StrCat("ring piece on lane ", lane, " is tagged ",
                                                 piece_tag, "; the message it joins is tagged ",
                                                 message_tag));
}

}  // namespace

StripeJoiner::StripeJoiner(Mailbox* mailbox, int world_size) : mailbox_(mailbox) {
  for (int r = 0; r < world_size; ++r) sources_.push_back(std::make_unique<Source>());
}

int64_t StripeJoiner::dropped() { return dropped_.load(); }

absl::Status StripeJoiner::Receive(int src, int lane, const FrameHeader& h, FrameReader& reader) {
  Source& s = *sources_[src];
  absl::MutexLock lock(&s.mu);
  if (lane == 0) return ReceiveFirst(src, s, h, reader);
  absl::Status status = ReceivePiece(s, lane, h, reader.Rest());
  DeliverReady(src, s);
  return status;
}

absl::Status StripeJoiner::ReceiveFirst(int src, Source& s, const FrameHeader& h,
                                        FrameReader& reader) {
  // A later epoch on lane 0: whatever still waits for pieces from an earlier one never gets them.
  int64_t dropped = 0;
  for (auto it = s.pending.begin(); it != s.pending.end();) {
    const bool stale = it->epoch < h.epoch && !it->complete();
    dropped += stale;
    it = stale ? s.pending.erase(it) : it + 1;
  }
  for (std::deque<Piece>& lane : s.early) {
    while (!lane.empty() && lane.front().epoch < h.epoch) {
      lane.pop_front();
      ++dropped;
    }
  }
  dropped_ += dropped;
  DeliverReady(src, s);
  if (h.stripes == 1 && s.pending.empty()) {
    // The common case, in place: the sink reduces or copies straight out of gRPC's slices, now
    // if the collective has posted this receive, or when it takes the queued slices.
    const size_t size = reader.remaining();
    if (const RecvSink* sink = mailbox_->BeginInPlace(src, h.epoch, h.tag, size)) {
      reader.ForEachPiece(*sink);
      mailbox_->EndInPlace(src);
    } else {
      mailbox_->Deliver(src, h.epoch, h.tag, reader.Rest());
    }
    return absl::OkStatus();
  }
  Message m;
  m.epoch = h.epoch;
  m.tag = h.tag;
  m.stripes = h.stripes;
  m.pieces.resize(h.stripes);
  m.pieces[0] = reader.Rest();
  m.have = 1;
  for (int j = 1; j < m.stripes; ++j) {
    std::deque<Piece>& early = s.early[j];
    if (early.empty()) continue;
    Piece& p = early.front();  // every earlier epoch's piece is gone (above)
    if (p.epoch > m.epoch) {
      // Lane j moved on to a later epoch: this message's piece j was lost with its stream. Its
      // pieces that came early on the later lanes go with it.
      for (int k = j + 1; k < m.stripes; ++k) {
        std::deque<Piece>& later = s.early[k];
        if (!later.empty() && later.front().epoch == m.epoch && later.front().tag == m.tag) {
          later.pop_front();
        }
      }
      ++dropped_;
      return absl::OkStatus();
    }
    if (p.tag != m.tag) return WrongPiece(j, p.tag, m.tag);
    m.pieces[j] = std::move(p.data);
    m.have |= uint32_t{1} << j;
    early.pop_front();
  }
  s.pending.push_back(std::move(m));
  DeliverReady(src, s);
  return absl::OkStatus();
}

absl::Status StripeJoiner::ReceivePiece(Source& s, int lane, const FrameHeader& h,
                                        absl::Cord data) {
  const uint32_t bit = uint32_t{1} << lane;
  for (auto it = s.pending.begin(); it != s.pending.end();) {
    if (it->stripes <= lane || (it->have & bit)) {
      ++it;
      continue;
    }
    if (it->epoch < h.epoch) {
      // Lane `lane` is in a later epoch: this message's piece was lost with its stream.
      it = s.pending.erase(it);
      ++dropped_;
      continue;
    }
    if (it->epoch > h.epoch) {  // a piece of a message that was dropped
      ++dropped_;
      return absl::OkStatus();
    }
    if (it->tag != h.tag) return WrongPiece(lane, h.tag, it->tag);
    it->pieces[lane] = std::move(data);
    it->have |= bit;
    return absl::OkStatus();
  }
  // Its lane-0 frame has not come yet.
  s.early[lane].push_back(Piece{h.epoch, h.tag, std::move(data)});
  return absl::OkStatus();
}

void StripeJoiner::DeliverReady(int src, Source& s) {
  while (!s.pending.empty() && s.pending.front().complete()) {
    Message& m = s.pending.front();
    absl::Cord whole = std::move(m.pieces[0]);
    for (int j = 1; j < m.stripes; ++j) whole.Append(std::move(m.pieces[j]));
    mailbox_->Deliver(src, m.epoch, m.tag, std::move(whole));
    s.pending.pop_front();
  }
}

}  // namespace meshrun
