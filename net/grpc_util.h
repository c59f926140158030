// The one place that converts between absl::Status and grpc::Status, plus channel and deadline
// helpers shared by every gRPC client in meshrun.
#ifndef MESHRUN_NET_GRPC_UTIL_H_
#define MESHRUN_NET_GRPC_UTIL_H_

#include <cstdint>
#include <limits>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "google/protobuf/message_lite.h"
#include "grpcpp/grpcpp.h"
#include "meshrun/v1/coordinator.pb.h"

namespace meshrun {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);
// FromGrpcStatus with "`what`: " before the message (e.g. "worker rank 3 at 127.0.0.1:4567").
absl::Status FromGrpcStatus(const grpc::Status& status, const std::string& what);

// The largest message a channel or server of CreateChannel / ConfigureServerBuilder carries:
// protobuf's own limit (2 GiB - 1 byte).
inline constexpr int kMaxMessageBytes = std::numeric_limits<int>::max();
// The largest array that PutArray carries whole: the message's limit less 1 MiB for the rest of
// the request (coordinator.proto's MAX_ARRAY_MESSAGE_BYTES, which the Python SDK reads too). The
// SDKs refuse a larger one up front (InvalidArgument naming its size).
inline constexpr int64_t kMaxArrayMessageBytes = v1::MAX_ARRAY_MESSAGE_BYTES;
static_assert(kMaxArrayMessageBytes == kMaxMessageBytes - (int64_t{1} << 20));

// A channel to `address` (host:port) that carries messages up to kMaxMessageBytes, with the
// process's credentials (net/credentials.h: TLS to a node, the node certificate and the bearer
// token when held; plaintext when they are insecure).
std::shared_ptr<grpc::Channel> CreateChannel(const std::string& address);
// The gRPC metadata key of a client's session (server/client_leases.h): the arrays its calls
// create belong to it, and are freed when it stops calling and sending KeepAlive.
inline constexpr char kSessionMetadataKey[] = "meshrun-session";
// The grpc.health.v1 service name a worker reports SERVING once it has joined a cluster (the
// empty name answers as soon as its server starts): a process restarted at a lost worker's
// address answers the empty name before it registers, never this one.
inline constexpr char kWorkerHealthService[] = "meshrun.v1.Worker";
// Server builder options matching CreateChannel's message size limit.
void ConfigureServerBuilder(grpc::ServerBuilder& builder);

// Sets `ctx`'s deadline to now + timeout.
void SetTimeout(grpc::ClientContext& ctx, absl::Duration timeout);

// Calls unary method `method` ("/package.Service/Method", e.g. MethodPath(v1::Worker::
// service_full_name(), "GetShard")) on `channel` with `request`'s bytes as they are, and waits for
// the response's bytes (gRPC's generic API: nothing serialised or parsed, slices shared). `ctx`
// carries the deadline and metadata. Thread-safe.
grpc::Status RawUnaryCall(const std::shared_ptr<grpc::Channel>& channel, grpc::ClientContext* ctx,
                          const std::string& method, const grpc::ByteBuffer& request,
                          grpc::ByteBuffer* response);
// "/<service>/<method>".
std::string MethodPath(const std::string& service, const std::string& method);

// Parses `bytes`, a message's wire bytes as a raw handler or RawUnaryCall gets them, into
// `message` (reading its slices in place). Errors: InvalidArgument "the N bytes are not a
// <message type>".
absl::Status ParseMessage(const grpc::ByteBuffer& bytes, google::protobuf::MessageLite* message);

// Holds the gRPC library initialised for a program's whole main(), and shuts it down, joining
// its threads, when main's objects are gone. Without it the last grpc_shutdown can come from a
// static destructor during exit(), or not at all, and gRPC's threads (timers, executor, TLS
// handshakes) then run while exit() tears down what they use (OpenSSL's and glog's state): a
// rare SIGSEGV as the process ends (grpc/grpc#22479, #23604). Declare one first in main(), so
// that it is destroyed last. Not copyable; one per process.
class GrpcLifetime {
 public:
  GrpcLifetime();
  ~GrpcLifetime();
  GrpcLifetime(const GrpcLifetime&) = delete;
  GrpcLifetime& operator=(const GrpcLifetime&) = delete;
};

}  // namespace meshrun

#endif  // MESHRUN_NET_GRPC_UTIL_H_
