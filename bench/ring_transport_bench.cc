// Google Benchmark: ping-pong latency and one-way throughput of the gRPC ring transport between
// two ranks (two gRPC servers on loopback, one process). Run: build/bin/ring_transport_bench
#include <thread>

#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "grpcpp/grpcpp.h"
#include "net/credentials.h"
#include "net/grpc_util.h"
#include "worker/grpc_transport.h"

namespace meshrun {
namespace {

struct Pair {
  Pair() {
    SetProcessCredentials(Credentials::Insecure());  // the transport's own cost, without TLS
    std::vector<std::string> addresses;
    for (int r = 0; r < 2; ++r) {
      grpc::ServerBuilder b;
      ConfigureServerBuilder(b);
      int port = 0;
      b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
      b.RegisterService(&rings[r]);
      servers[r] = b.BuildAndStart();
      addresses.push_back(absl::StrCat("127.0.0.1:", port));
    }
    for (int r = 0; r < 2; ++r) {
      mailboxes[r] = std::make_unique<Mailbox>(2);
      rings[r].Attach(mailboxes[r].get(), 2, "bench");
      transports[r] = std::make_unique<GrpcTransport>(r, addresses, "bench", mailboxes[r].get());
    }
  }
  ~Pair() {
    for (auto& t : transports) t.reset();
    for (auto& s : servers) s->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  }
  RingService rings[2];
  std::unique_ptr<grpc::Server> servers[2];
  std::unique_ptr<Mailbox> mailboxes[2];
  std::unique_ptr<GrpcTransport> transports[2];
};

void BM_PingPong(benchmark::State& state) {
  Pair p;
  const std::string msg(state.range(0), 'x');
  const int64_t rounds = 1 << 30;
  std::atomic<bool> stop{false};
  std::thread echo([&] {
    for (int64_t i = 0; i < rounds && !stop.load(); ++i) {
      auto m = p.transports[1]->Recv(0, i, absl::Now() + absl::Seconds(5));
      if (!m.ok()) return;
      if (!p.transports[1]->Send(0, i, *m, absl::Now() + absl::Seconds(5)).ok()) return;
    }
  });
  int64_t i = 0;
  for (auto _ : state) {
    if (!p.transports[0]->Send(1, i, msg, absl::Now() + absl::Seconds(5)).ok())
      state.SkipWithError("send");
    if (!p.transports[0]->Recv(1, i, absl::Now() + absl::Seconds(5)).ok())
      state.SkipWithError("recv");
    ++i;
  }
  stop.store(true);
  p.transports[0]->Send(1, i, msg, absl::Now() + absl::Seconds(5)).IgnoreError();
  echo.join();
  state.SetBytesProcessed(state.iterations() * msg.size() * 2);
}
BENCHMARK(BM_PingPong)->Arg(4096)->Arg(1 << 20)->UseRealTime();

}  // namespace
}  // namespace meshrun

BENCHMARK_MAIN();
