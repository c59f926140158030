#include "core/collectives/transport.h"

#include "absl/strings/str_cat.h"

namespace meshrun {

absl::Status WrongMessageSize(int peer, uint64_t tag, size_t got, size_t expected) {
  return absl::InternalError(absl::StrCat("rank ", peer, " sent ", got, " bytes (tag ", tag,
                                          "); expected ", expected,
                                          " (blocks of different sizes?)"));
}

absl::Status Transport::CheckPeer(absl::string_view what, int peer) const {
  if (peer >= 0 && peer < world_size()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(what, " rank ", peer, "; world size is ", world_size()));
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
