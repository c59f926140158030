#include "core/collectives/in_process_transport.h"

#include <cstdint>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace meshrun {
namespace {

// Ranks are threads of one process: every buffer is reachable, and a handle is its address.
class SameProcessMemory : public PeerMemory {
 public:
  bool CanReach(int peer) const override { return true; }
  std::string Export(const void* data, size_t size) override {
    return absl::StrCat(reinterpret_cast<uintptr_t>(data));
  }
  absl::StatusOr<void*> Import(int peer, absl::string_view handle) override {
    uint64_t address = 0;
    if (!absl::SimpleAtoi(handle, &address)) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", peer, " sent a malformed memory handle '", handle, "'"));
    }
    return reinterpret_cast<void*>(static_cast<uintptr_t>(address));
  }
};

struct Hub {
  explicit Hub(int n) {
    for (int i = 0; i < n; ++i) mailboxes.push_back(std::make_unique<Mailbox>(n));
  }
  std::vector<std::unique_ptr<Mailbox>> mailboxes;
};

class InProcessTransport : public Transport {
 public:
  InProcessTransport(std::shared_ptr<Hub> hub, int rank) : hub_(std::move(hub)), rank_(rank) {}

  int rank() const override { return rank_; }
  int world_size() const override { return static_cast<int>(hub_->mailboxes.size()); }

  absl::Status Send(int peer, uint64_t tag, absl::string_view data, absl::Time deadline) override {
    if (absl::Status s = CheckPeer("send to", peer); !s.ok()) return s;
    // A receive the peer has posted takes the bytes straight from the sender's buffer.
    Mailbox& mailbox = *hub_->mailboxes[peer];
    const uint64_t e = epoch();
    if (const RecvSink* sink = mailbox.BeginInPlace(rank_, e, tag, data.size())) {
      if (!data.empty()) (*sink)(0, data.data(), data.size());
      mailbox.EndInPlace(rank_);
      return absl::OkStatus();
    }
    mailbox.Deliver(rank_, e, tag, std::string(data));
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> Recv(int peer, uint64_t tag, absl::Time deadline) override {
    if (absl::Status s = CheckPeer("recv from", peer); !s.ok()) return s;
    return hub_->mailboxes[rank_]->Take(peer, tag, deadline);
  }

  absl::Status RecvInto(int peer, uint64_t tag, size_t size, absl::Time deadline,
                        RecvSink sink) override {
    if (absl::Status s = CheckPeer("recv from", peer); !s.ok()) return s;
    return hub_->mailboxes[rank_]->TakeInto(peer, tag, size, deadline, sink);
  }

  PeerMemory* peer_memory() override { return &memory_; }

  void Abort(const absl::Status& reason) override { hub_->mailboxes[rank_]->Abort(reason); }
  void Reset(uint64_t epoch) override { hub_->mailboxes[rank_]->Reset(epoch); }
  uint64_t epoch() const override { return hub_->mailboxes[rank_]->epoch(); }

 private:
  std::shared_ptr<Hub> hub_;
  int rank_;
  SameProcessMemory memory_;
};

}  // namespace

std::vector<std::unique_ptr<Transport>> CreateInProcessTransports(int world_size) {
  auto hub = std::make_shared<Hub>(world_size);
  std::vector<std::unique_ptr<Transport>> out;
  for (int r = 0; r < world_size; ++r) out.push_back(std::make_unique<InProcessTransport>(hub, r));
  return out;
}

}  // namespace meshrun
