// GrpcTransport against a peer that stops reading: one that dies in the middle of a large write
// (the send fails naming it, within bounded time), and one that stays stopped with the write
// stuck in a full socket (the send fails at its deadline, or at once when aborted), or stuck in
// gRPC behind a flow-control window the peer never opens (small sends are eager: the one whose
// write is stuck returns, and the next fails at its deadline).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/collectives/mailbox.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "net/credentials.h"
#include "net/grpc_util.h"
#include "worker/grpc_transport.h"

namespace meshrun {
namespace {

using ::testing::HasSubstr;

// A peer that speaks just enough HTTP/2 for the client to send (a SETTINGS frame and a
// WINDOW_UPDATE that open the flow-control windows to 2 GiB), then never reads again, as a
// stopped process (SIGSTOP) does: a large write fills the socket and blocks there.
class StoppedPeer {
 public:
  // `dies_mid_write`: once a sender's bytes fill its receive queue (64 KiB unread), the peer
  // closes its end unread (the kernel resets the connection), as a killed process does.
  // Otherwise it stays stopped. It accepts one connection; later ones are refused.
  // `open_windows`: false, and the connection's window stays at HTTP/2's initial 65,535 bytes
  // (only the streams' are opened): gRPC writes no more than that and holds the rest.
  explicit StoppedPeer(bool dies_mid_write = false, bool open_windows = true) {
    listener_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(bind(listener_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(listen(listener_, 4), 0);
    socklen_t len = sizeof(addr);
    getsockname(listener_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    acceptor_ = std::thread([this, dies_mid_write, open_windows] {
      const int fd = accept(listener_, nullptr, nullptr);
      shutdown(listener_, SHUT_RDWR);
      if (fd < 0) return;
      connection_ = fd;
      const std::string frames = open_windows ? Settings() + WindowUpdate() : Settings();
      EXPECT_EQ(write(fd, frames.data(), frames.size()), static_cast<ssize_t>(frames.size()));
      if (!dies_mid_write) return;
      int unread = 0;
      const absl::Time give_up = absl::Now() + absl::Seconds(30);
      while (ioctl(fd, FIONREAD, &unread) == 0 && unread < (64 << 10) && absl::Now() < give_up) {
        absl::SleepFor(absl::Milliseconds(5));
      }
      EXPECT_GE(unread, 64 << 10);
      close(connection_.exchange(-1));
    });
  }
  ~StoppedPeer() {
    shutdown(listener_, SHUT_RDWR);  // ends a pending accept
    acceptor_.join();
    if (connection_ >= 0) close(connection_);
    close(listener_);
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

 private:
  static std::string Frame(uint8_t type, const std::string& payload) {
    std::string f = {0, 0, static_cast<char>(payload.size()), static_cast<char>(type), 0, 0, 0,
                     0, 0};
    return f + payload;
  }
  // SETTINGS_INITIAL_WINDOW_SIZE (4) = 2^31 - 1.
  static std::string Settings() { return Frame(0x4, std::string("\x00\x04\x7f\xff\xff\xff", 6)); }
  // The connection's window grows by 2^31 - 65536.
  static std::string WindowUpdate() { return Frame(0x8, std::string("\x7f\xff\x00\x00", 4)); }

  int listener_ = -1;
  std::atomic<int> connection_{-1};
  int port_ = 0;
  std::thread acceptor_;
};

// 64 MiB: far more than loopback's socket buffers hold.
constexpr size_t kStuckBytes = size_t{64} << 20;

// Rank 0 of a world of two whose rank 1 is the StoppedPeer.
class GrpcStoppedPeerTest : public ::testing::Test {
 protected:
  GrpcStoppedPeerTest() {
    SetProcessCredentials(Credentials::Insecure());  // the peer speaks plaintext HTTP/2
  }
  std::unique_ptr<GrpcTransport> TransportTo(
      const StoppedPeer& peer, size_t eager_send_bytes = GrpcTransport::kEagerSendBytes) {
    return std::make_unique<GrpcTransport>(0,
                                           std::vector<std::string>{"127.0.0.1:1", peer.address()},
                                           "c", &mailbox_, GrpcStripeOptions(), eager_send_bytes);
  }

  GrpcLifetime grpc_;  // as the worker holds it (else the last channel's close shuts gRPC down)
  Mailbox mailbox_{2};
  const std::string payload_ = std::string(kStuckBytes, 'p');
};

TEST_F(GrpcStoppedPeerTest, SendToAPeerThatDiesMidWriteFailsNamingIt) {
  StoppedPeer peer(/*dies_mid_write=*/true);
  auto t = TransportTo(peer);
  const absl::Time start = absl::Now();
  // gRPC may count the write as done before the reset comes (Send promises delivery to the
  // connection, not to the peer); the next send on the link fails, naming the peer.
  absl::Status s = t->Send(1, 1, payload_, start + absl::Seconds(60));
  if (s.ok()) s = t->Send(1, 2, payload_, absl::Now() + absl::Seconds(60));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("rank 1"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

// The write fills the socket of a peer that never reads again: gRPC 1.51 would complete it only
// when the socket drains or the connection closes, so the send must give up on it at its
// deadline, name the peer, and keep failing on that link without writing again.
TEST_F(GrpcStoppedPeerTest, SendStuckAtAStoppedPeerFailsAtItsDeadline) {
  StoppedPeer peer;
  auto t = TransportTo(peer);
  const absl::Time start = absl::Now();
  const absl::Status s = t->Send(1, 1, payload_, start + absl::Milliseconds(500));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(), HasSubstr("rank 1"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  const absl::Status again = t->Send(1, 2, "x", absl::Now() + absl::Seconds(60));
  EXPECT_EQ(again, s);
}

// Abort ends a send stuck in a full socket long before its deadline, with the abort's reason.
TEST_F(GrpcStoppedPeerTest, AbortEndsASendStuckAtAStoppedPeer) {
  StoppedPeer peer;
  auto t = TransportTo(peer);
  const absl::Status reason = absl::AbortedError("rank 3 failed its step");
  std::thread aborter([&] {
    absl::SleepFor(absl::Milliseconds(500));
    t->Abort(reason);
  });
  const absl::Time start = absl::Now();
  const absl::Status s = t->Send(1, 1, payload_, start + absl::Seconds(60));
  aborter.join();
  EXPECT_EQ(s, reason);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

// Sends 32 KiB messages (each with a 1 s deadline) to a peer that leaves the connection's
// window at 65,535 bytes, until one fails: the first message fits the window, and the second's
// write never completes (gRPC completes a write once all of it is sent). Returns how many sends
// returned OK and the failure, which must come at its deadline.
struct UntilStuck {
  int ok = 0;
  absl::Status failure;
};
UntilStuck SendUntilStuck(GrpcTransport& t) {
  const std::string chunk(32 << 10, 'c');
  UntilStuck out;
  for (uint64_t tag = 1; tag < 100000; ++tag) {
    const absl::Time start = absl::Now();
    absl::Status s = t.Send(1, tag, chunk, start + absl::Seconds(1));
    if (!s.ok()) {
      EXPECT_GE(absl::Now() - start, absl::Milliseconds(900)) << "failed before its deadline";
      EXPECT_LT(absl::Now() - start, absl::Seconds(5));
      out.failure = s;
      return out;
    }
    ++out.ok;
  }
  ADD_FAILURE() << "no send got stuck";
  return out;
}

// A small send returns once its write is posted: the send whose write is the first that can
// never complete returns OK (a waiting send would fail there), and the next send, which waits for
// it first, fails at its own deadline naming the peer; the link then keeps failing.
TEST_F(GrpcStoppedPeerTest, ASmallSendReturnsBeforeItsWriteCompletesAndTheNextWaitsForIt) {
  StoppedPeer waiting_peer(/*dies_mid_write=*/false, /*open_windows=*/false);
  auto waiting = TransportTo(waiting_peer, /*eager_send_bytes=*/0);
  const UntilStuck waited = SendUntilStuck(*waiting);
  StoppedPeer eager_peer(/*dies_mid_write=*/false, /*open_windows=*/false);
  auto eager = TransportTo(eager_peer);
  const UntilStuck eagerly = SendUntilStuck(*eager);

  EXPECT_EQ(waited.ok, 1);   // the second send waits for its own write, and fails
  EXPECT_EQ(eagerly.ok, 2);  // the second returns; the third waits for the second's write
  for (const absl::Status& s : {waited.failure, eagerly.failure}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_THAT(s.message(), HasSubstr("rank 1"));
  }
  EXPECT_EQ(eager->Send(1, 0, "x", absl::Now() + absl::Seconds(60)), eagerly.failure);
}

}  // namespace
}  // namespace meshrun
