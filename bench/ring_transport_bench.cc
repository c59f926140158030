// Google Benchmark: ping-pong latency of the gRPC ring transport between two ranks (two gRPC
// servers on loopback, one process), beside the floors under it in the same run (issue 20's
// "where does the time per gRPC message go"):
//   - BM_TcpPingPong: the same bytes over a loopback TCP connection, TCP_NODELAY, with blocking
//     reads (spin:0: each side sleeps until its bytes come, as gRPC's pollers do) or with
//     non-blocking reads retried at once (spin:1: how Open MPI's btl tcp waits): the kernel's
//     share, and what a thread's wake-up costs on this machine.
//   - BM_GrpcEcho: a bidi gRPC stream echoed by a callback-API reactor (cq_thread:0, how
//     RingService receives) or by an async generic service that one thread of its own drives
//     through its completion queue (cq_thread:1); a sync client writes and reads (how PeerLink
//     sends): gRPC's own share, with none of meshrun's framing, mailbox or threads.
//   - BM_GrpcSpinPair: two servers, each side writing on a sync client stream and reading the
//     reply from its own server's completion queue, blocking (spin:0) or polling it with a zero
//     deadline (spin:1): gRPC's floor when the receiving thread polls as MPI's does.
// Run: build/bin/ring_transport_bench --benchmark_filter=4096 (README, Collectives, has a run)
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <thread>

#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "grpcpp/generic/async_generic_service.h"
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

// Reads or writes exactly `n` bytes (on a non-blocking socket, retrying at once while it would
// block); false on error or end of stream.
bool FullIo(int fd, char* buf, size_t n, bool write) {
  while (n > 0) {
    const ssize_t r = write ? ::write(fd, buf, n) : ::read(fd, buf, n);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (r <= 0) return false;
    buf += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

void BM_TcpPingPong(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (bind(listener, reinterpret_cast<sockaddr*>(&addr), len) != 0 || listen(listener, 1) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    state.SkipWithError("listen");
    close(listener);
    return;
  }
  const int client = socket(AF_INET, SOCK_STREAM, 0);
  const int one = 1;
  if (connect(client, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    state.SkipWithError("connect");
    close(client);
    close(listener);
    return;
  }
  const int server = accept(listener, nullptr, nullptr);
  for (int fd : {client, server}) {
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (state.range(1) == 1) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  }
  std::thread echo([&] {
    std::string buf(n, '\0');
    while (FullIo(server, buf.data(), n, false) && FullIo(server, buf.data(), n, true)) {
    }
  });
  std::string msg(n, 'x');
  for (auto _ : state) {
    if (!FullIo(client, msg.data(), n, true) || !FullIo(client, msg.data(), n, false))
      state.SkipWithError("echo");
  }
  shutdown(client, SHUT_RDWR);
  echo.join();
  for (int fd : {client, server, listener}) close(fd);
  state.SetBytesProcessed(state.iterations() * n * 2);
}
BENCHMARK(BM_TcpPingPong)
    ->ArgNames({"bytes", "spin"})
    ->Args({4096, 0})
    ->Args({4096, 1})
    ->UseRealTime();

// Echoes every message of a bidi stream back on it (the callback API's reactor).
class EchoReactor : public grpc::ServerGenericBidiReactor {
 public:
  EchoReactor() { StartRead(&msg_); }
  void OnReadDone(bool ok) override {
    if (ok) {
      StartWrite(&msg_);
    } else {
      Finish(grpc::Status::OK);
    }
  }
  void OnWriteDone(bool ok) override {
    if (ok) {
      StartRead(&msg_);
    } else {
      Finish(grpc::Status::OK);
    }
  }
  void OnDone() override { delete this; }

 private:
  grpc::ByteBuffer msg_;
};

class EchoCallbackService : public grpc::CallbackGenericService {
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    return new EchoReactor();
  }
};

// Shuts `cq` down and takes its remaining events, as gRPC requires before it is destroyed (after
// its server's Shutdown).
void ShutdownAndDrain(grpc::CompletionQueue* cq) {
  cq->Shutdown();
  void* tag;
  bool ok;
  while (cq->Next(&tag, &ok)) {
  }
}

// The same echo on an async generic service, driven by one thread of its own (one stream).
void ServeEchoOnQueue(grpc::AsyncGenericService* service, grpc::ServerCompletionQueue* cq) {
  grpc::GenericServerContext ctx;
  grpc::GenericServerAsyncReaderWriter stream(&ctx);
  grpc::ByteBuffer msg;
  void* tag = nullptr;
  bool ok = false;
  service->RequestCall(&ctx, &stream, cq, cq, &ctx);
  if (!cq->Next(&tag, &ok) || !ok) return;
  bool finished = false;
  while (!finished) {
    stream.Read(&msg, &msg);
    if (!cq->Next(&tag, &ok)) return;
    if (ok) {
      stream.Write(msg, &stream);
      if (!cq->Next(&tag, &ok)) return;
    }
    if (!ok) {
      stream.Finish(grpc::Status::OK, &stream);
      cq->Next(&tag, &ok);
      finished = true;
    }
  }
}

void BM_GrpcEcho(benchmark::State& state) {
  SetProcessCredentials(Credentials::Insecure());
  const bool cq_thread = state.range(1) == 1;
  EchoCallbackService callback_service;
  grpc::AsyncGenericService async_service;
  grpc::ServerBuilder b;
  ConfigureServerBuilder(b);
  int port = 0;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  std::unique_ptr<grpc::ServerCompletionQueue> cq;
  if (cq_thread) {
    b.RegisterAsyncGenericService(&async_service);
    cq = b.AddCompletionQueue();
  } else {
    b.RegisterCallbackGenericService(&callback_service);
  }
  std::unique_ptr<grpc::Server> server = b.BuildAndStart();
  std::thread serve;
  if (cq_thread) serve = std::thread([&] { ServeEchoOnQueue(&async_service, cq.get()); });
  {
    std::shared_ptr<grpc::Channel> channel = CreateChannel(absl::StrCat("127.0.0.1:", port));
    const grpc::internal::RpcMethod method("/bench.Echo/Echo",
                                           grpc::internal::RpcMethod::BIDI_STREAMING, channel);
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream(
        grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
            channel.get(), method, &ctx));
    const std::string bytes(state.range(0), 'x');
    grpc::Slice slice(bytes.data(), bytes.size());
    const grpc::ByteBuffer msg(&slice, 1);
    grpc::ByteBuffer reply;
    for (auto _ : state) {
      if (!stream->Write(msg) || !stream->Read(&reply)) state.SkipWithError("echo");
    }
    stream->WritesDone();
    stream->Finish().IgnoreError();
  }
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  if (cq_thread) {
    serve.join();
    ShutdownAndDrain(cq.get());
  }
  state.SetBytesProcessed(state.iterations() * state.range(0) * 2);
}
BENCHMARK(BM_GrpcEcho)
    ->ArgNames({"bytes", "cq_thread"})
    ->Args({4096, 0})
    ->Args({4096, 1})
    ->UseRealTime();

// One side of BM_GrpcSpinPair: a server receiving one client stream on an async generic service,
// whose completion queue the side's own thread drives.
struct SpinSide {
  grpc::AsyncGenericService service;
  std::unique_ptr<grpc::ServerCompletionQueue> cq;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  grpc::GenericServerContext ctx;
  std::unique_ptr<grpc::GenericServerAsyncReaderWriter> stream;
  grpc::ByteBuffer msg;
  bool spin = true;
  void Start() {
    grpc::ServerBuilder b;
    ConfigureServerBuilder(b);
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterAsyncGenericService(&service);
    cq = b.AddCompletionQueue();
    server = b.BuildAndStart();
    stream = std::make_unique<grpc::GenericServerAsyncReaderWriter>(&ctx);
    service.RequestCall(&ctx, stream.get(), cq.get(), cq.get(), &ctx);
  }
  // The next event of cq (one operation is outstanding at a time): true when it succeeded.
  bool Wait() {
    void* tag;
    bool ok;
    if (!spin) return cq->Next(&tag, &ok) && ok;
    for (;;) {
      auto r = cq->AsyncNext(&tag, &ok, gpr_time_0(GPR_CLOCK_MONOTONIC));
      if (r == grpc::CompletionQueue::GOT_EVENT) return ok;
      if (r == grpc::CompletionQueue::SHUTDOWN) return false;
    }
  }
  bool Recv() {
    stream->Read(&msg, &msg);
    return Wait();
  }
};

void BM_GrpcSpinPair(benchmark::State& state) {
  SetProcessCredentials(Credentials::Insecure());
  SpinSide sides[2];
  for (auto& s : sides) {
    s.spin = state.range(1) == 1;
    s.Start();
  }
  std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writers[2];
  std::shared_ptr<grpc::Channel> channels[2];
  grpc::ClientContext ctxs[2];
  grpc::ByteBuffer responses[2];
  const std::string bytes(state.range(0), 'x');
  grpc::Slice slice(bytes.data(), bytes.size());
  const grpc::ByteBuffer msg(&slice, 1);
  for (int r = 0; r < 2; ++r) {
    channels[r] = CreateChannel(absl::StrCat("127.0.0.1:", sides[1 - r].port));
    const grpc::internal::RpcMethod method(
        "/bench.Echo/Push", grpc::internal::RpcMethod::CLIENT_STREAMING, channels[r]);
    writers[r].reset(grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(
        channels[r].get(), method, &ctxs[r], &responses[r]));
    writers[r]->Write(msg);
  }
  for (auto& s : sides) s.Wait();  // the accepted call
  for (auto& s : sides) s.Recv();  // the first message
  std::atomic<bool> stop{false};
  std::thread echo([&] {
    while (!stop.load()) {
      if (!sides[1].Recv()) return;
      if (!writers[1]->Write(msg)) return;
    }
  });
  for (auto _ : state) {
    if (!writers[0]->Write(msg) || !sides[0].Recv()) state.SkipWithError("echo");
  }
  stop.store(true);
  writers[0]->Write(msg);
  echo.join();
  for (auto& s : sides) {
    s.server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Milliseconds(100)));
    ShutdownAndDrain(s.cq.get());
  }
  for (auto& w : writers) w.reset();
  state.SetBytesProcessed(state.iterations() * state.range(0) * 2);
}
BENCHMARK(BM_GrpcSpinPair)
    ->ArgNames({"bytes", "spin"})
    ->Args({4096, 0})
    ->Args({4096, 1})
    ->UseRealTime();

}  // namespace
}  // namespace meshrun

BENCHMARK_MAIN();
