#include "net/grpc_util.h"

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "grpc/grpc.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "net/credentials.h"

namespace meshrun {

namespace {
constexpr int kMaxFrameBytes = 4 << 20;
constexpr int kWindowBytes = 8 << 20;
}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

absl::Status FromGrpcStatus(const grpc::Status& status, const std::string& what) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat(what, ": ", status.error_message()));
}

std::shared_ptr<grpc::Channel> CreateChannel(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  // Separate channels per target even within one process, so each peer link gets its own TCP
  // connection (ring streams must not share one HTTP/2 connection's flow control).
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // Ring chunks are large: bigger HTTP/2 frames and windows cut per-frame work and stalls.
  args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, kMaxFrameBytes);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kWindowBytes);
  args.SetInt(GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE, kWindowBytes);
  const Credentials& creds = ProcessCredentials();
  // Every node's certificate is for "meshrun-node", whatever address it is dialled at.
  if (!creds.insecure) args.SetSslTargetNameOverride(kNodeName);
  return grpc::CreateCustomChannel(address, NodeChannelCredentials(creds), args);
}

void ConfigureServerBuilder(grpc::ServerBuilder& builder) {
  // A port is bound exclusively (gRPC sets SO_REUSEPORT by default on Linux, which would let a
  // second worker bind a live worker's port and take its traffic).
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, kMaxFrameBytes);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kWindowBytes);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE, kWindowBytes);
}

void SetTimeout(grpc::ClientContext& ctx, absl::Duration timeout) {
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

GrpcLifetime::GrpcLifetime() { grpc_init(); }

GrpcLifetime::~GrpcLifetime() {
  // Blocking: the clean-up runs on this thread, not on a detached one that exit() would race.
  grpc_shutdown_blocking();
  // A channel still closing holds the library; its last release, on one of gRPC's threads, runs
  // the clean-up on a detached thread. Waited for, boundedly: a leaked object must not hang exit.
  const absl::Time give_up = absl::Now() + absl::Seconds(2);
  while (grpc_is_initialized() && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(5));
}

grpc::Status RawUnaryCall(const std::shared_ptr<grpc::Channel>& channel, grpc::ClientContext* ctx,
                          const std::string& method, const grpc::ByteBuffer& request,
                          grpc::ByteBuffer* response) {
  grpc::GenericStub generic(channel);
  absl::Notification done;
  grpc::Status status;
  generic.UnaryCall(ctx, method, grpc::StubOptions(), &request, response, [&](grpc::Status s) {
    status = std::move(s);
    done.Notify();
  });
  done.WaitForNotification();
  return status;
}

std::string MethodPath(const std::string& service, const std::string& method) {
  return absl::StrCat("/", service, "/", method);
}

absl::Status ParseMessage(const grpc::ByteBuffer& bytes, google::protobuf::MessageLite* message) {
  grpc::ByteBuffer copy(bytes);  // (shares its slices: the reader consumes the buffer it reads)
  grpc::ProtoBufferReader reader(&copy);
  if (!reader.status().ok() || !message->ParseFromZeroCopyStream(&reader)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the ", bytes.Length(), " bytes are not a ", message->GetTypeName()));
  }
  return absl::OkStatus();
}

}  // namespace meshrun
