#include "core/collectives/transport.h"

#include "absl/strings/str_cat.h"

namespace meshrun {

absl::Status WrongMessageSize(int peer, uint64_t tag, size_t got, size_t expected) {
  return absl::InternalError(absl::StrCat("rank ", peer, " sent ", got, " bytes (tag ", tag,
                                          "); expected ", expected,
                                          " (blocks of different sizes?)"));
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
