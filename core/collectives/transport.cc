#include "core/collectives/transport.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"

namespace meshrun {

void SinkStitcher::Add(const char* data, size_t n) {
  if (carried_ > 0) {
    const size_t take = std::min(sizeof(carry_) - carried_, n);
    std::memcpy(carry_ + carried_, data, take);
    carried_ += take;
    data += take;
    n -= take;
    if (carried_ < sizeof(carry_)) return;
    sink_(offset_, carry_, carried_);
    offset_ += carried_;
    carried_ = 0;
  }
  const size_t whole = n & ~size_t{7};
  if (whole > 0) sink_(offset_, data, whole);
  offset_ += whole;
  carried_ = n - whole;
  std::memcpy(carry_, data + whole, carried_);
}

void SinkStitcher::Finish() {
  if (carried_ > 0) sink_(offset_, carry_, carried_);
  offset_ += carried_;
  carried_ = 0;
}

absl::Status WrongMessageSize(int peer, uint64_t tag, size_t got, size_t expected) {
  return absl::InternalError(absl::StrCat("rank ", peer, " sent ", got, " bytes (tag ", tag,
                                          "); expected ", expected,
                                          " (blocks of different sizes?)"));
}

absl::Status Transport::CheckPeer(absl::string_view what, int peer) const {
  if (peer >= 0 && peer < world_size()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(what, " rank ", peer, "; world size is ", world_size()));
}

absl::Status Transport::SendFilled(int peer, uint64_t tag, size_t size, absl::Time deadline,
                                   SendFill fill) {
  if (absl::Status s = CheckPeer("send to", peer); !s.ok()) return s;  // before fill consumes
  std::unique_ptr<char[]> payload(new char[size]);  // not zeroed: fill writes every byte
  if (absl::Status s = fill(payload.get()); !s.ok()) return s;
  return Send(peer, tag, absl::string_view(payload.get(), size), deadline);
}

absl::Status Transport::Forward(int prev, uint64_t tag, char* dst, size_t size, int next,
                                uint64_t next_tag, absl::Time deadline) {
  // `next` is checked before the message is taken.
  if (absl::Status s = CheckPeer("send to", next); !s.ok()) return s;
  absl::Status received = RecvInto(
      prev, tag, size, deadline,
      [dst](size_t offset, const char* piece, size_t n) { std::memcpy(dst + offset, piece, n); });
  if (!received.ok()) return received;
  return Send(next, next_tag, absl::string_view(dst, size), deadline);
}

absl::Status Transport::RecvInto(int peer, uint64_t tag, size_t size, absl::Time deadline,
                                 RecvSink sink) {
  absl::StatusOr<std::string> message = Recv(peer, tag, deadline);
  if (!message.ok()) return message.status();
  if (message->size() != size) return WrongMessageSize(peer, tag, message->size(), size);
  if (size > 0) sink(0, message->data(), size);
  return absl::OkStatus();
}

}  // namespace meshrun
