#include "tests/testutil/transport_set.h"

#include <thread>

#include "absl/strings/str_cat.h"
#include "core/collectives/in_process_transport.h"
#include "core/collectives/mailbox.h"
#include "grpcpp/grpcpp.h"
#include "net/grpc_util.h"
#include "worker/grpc_transport.h"

namespace meshrun::testing {

std::string KindName(TransportKind kind) { return kind == TransportKind::kGrpc ? "Grpc" : "InProcess"; }

struct TransportSet::Impl {
  std::vector<std::unique_ptr<RingService>> rings;
  std::vector<std::unique_ptr<grpc::Server>> servers;
  std::vector<std::unique_ptr<Mailbox>> mailboxes;
  std::vector<std::unique_ptr<Transport>> transports;
};

TransportSet::TransportSet(TransportKind kind, int n) : n_(n), impl_(new Impl) {
  if (kind == TransportKind::kInProcess) {
    impl_->transports = CreateInProcessTransports(n);
    return;
  }
  std::vector<std::string> addresses;
  for (int r = 0; r < n; ++r) {
    impl_->rings.push_back(std::make_unique<RingService>());
    grpc::ServerBuilder b;
    ConfigureServerBuilder(b);
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(impl_->rings.back().get());
    impl_->servers.push_back(b.BuildAndStart());
    addresses.push_back(absl::StrCat("127.0.0.1:", port));
  }
  for (int r = 0; r < n; ++r) {
    impl_->mailboxes.push_back(std::make_unique<Mailbox>(n));
    impl_->rings[r]->Attach(impl_->mailboxes[r].get(), n, "test-cluster");
    impl_->transports.push_back(
        std::make_unique<GrpcTransport>(r, addresses, "test-cluster", impl_->mailboxes[r].get()));
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
