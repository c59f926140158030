#include "tests/testutil/transport_set.h"

#include <unistd.h>

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/collectives/in_process_transport.h"
#include "core/collectives/mailbox.h"
#include "glog/logging.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "net/credentials.h"
#include "net/grpc_util.h"
#include "worker/grpc_transport.h"
#include "worker/shm_transport.h"

namespace meshrun::testing {

std::string KindName(TransportKind kind) {
  switch (kind) {
    case TransportKind::kInProcess:
      return "InProcess";
    case TransportKind::kGrpc:
      return "Grpc";
    case TransportKind::kGrpcStriped:
      return "GrpcStriped";
    case TransportKind::kShm:
      return "Shm";
  }
  return "?";
}

struct TransportSet::Impl {
  std::vector<std::unique_ptr<RingService>> rings;
  std::vector<std::unique_ptr<grpc::Server>> servers;
  std::vector<std::unique_ptr<Mailbox>> mailboxes;
  std::vector<std::unique_ptr<Transport>> transports;
};

TransportSet::TransportSet(TransportKind kind, int n, const TransportSetOptions& options)
    : n_(n), impl_(new Impl) {
  if (kind == TransportKind::kInProcess) {
    impl_->transports = CreateInProcessTransports(n);
    return;
  }
  if (!options.tls) {
    SetProcessCredentials(Credentials::Insecure());
  } else {
    static const std::string* dir = [] {
      auto* d =
          new std::string(absl::StrCat(::testing::TempDir(), "/transport-set-tls-", getpid()));
      CHECK(InitCredentials(*d).ok());
      return d;
    }();
    absl::StatusOr<Credentials> creds = NodeCredentials(*dir, false);
    CHECK(creds.ok()) << creds.status();
    SetProcessCredentials(*std::move(creds));
  }
  std::vector<std::string> addresses;
  for (int r = 0; r < n; ++r) {
    impl_->rings.push_back(std::make_unique<RingService>());
    grpc::ServerBuilder b;
    ConfigureServerBuilder(b);
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", NodeServerCredentials(ProcessCredentials(), true), &port);
    b.RegisterService(impl_->rings.back().get());
    impl_->servers.push_back(b.BuildAndStart());
    addresses.push_back(absl::StrCat("127.0.0.1:", port));
  }
  for (int r = 0; r < n; ++r) {
    impl_->mailboxes.push_back(
        std::make_unique<Mailbox>(n, absl::Seconds(2), options.receive_spin));
    impl_->rings[r]->Attach(impl_->mailboxes[r].get(), n, "test-cluster");
    const GrpcStripeOptions stripes =
        kind == TransportKind::kGrpcStriped ? GrpcStripeOptions{3, 8} : options.grpc_stripes;
    impl_->transports.push_back(std::make_unique<GrpcTransport>(
        r, addresses, "test-cluster", impl_->mailboxes[r].get(), stripes));
  }
  if (kind != TransportKind::kShm) return;
  std::vector<ShmPeer> peers(n);
  for (int r = 0; r < n; ++r) {
    peers[r].host_id =
        r < static_cast<int>(options.host_ids.size()) ? options.host_ids[r] : "test-host";
    peers[r].pid = r < static_cast<int>(options.pids.size()) ? options.pids[r] : getpid();
  }
  ShmTransport::Options so;
  so.ring_bytes = options.shm_ring_bytes;
  so.arena = options.arena;
  so.drain_poll = options.shm_drain_poll;
  for (int r = 0; r < n; ++r) {
    if (std::count(options.bare_ranks.begin(), options.bare_ranks.end(), r) > 0) continue;
    absl::StatusOr<std::unique_ptr<ShmTransport>> t = ShmTransport::Create(
        r, "test-cluster", peers, impl_->mailboxes[r].get(), std::move(impl_->transports[r]), so);
    CHECK(t.ok()) << t.status();
    impl_->transports[r] = *std::move(t);
  }
}

TransportSet::~TransportSet() {
  impl_->transports.clear();
  for (auto& s : impl_->servers) s->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
}

Transport* TransportSet::at(int rank) { return impl_->transports[rank].get(); }

void TransportSet::RunRanks(const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n_; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

}  // namespace meshrun::testing
