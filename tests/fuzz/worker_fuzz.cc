// libFuzzer target for the Worker service's handlers, in process: the fuzzer's bytes are parsed
// as one request message (bookworm has no libprotobuf-mutator), its first byte choosing the RPC.
// The worker is rank 0 of a one-device mesh, so programs run end to end (collectives over a
// group of one), with a 64 MiB memory budget, a checkpoint root under $TMPDIR and a small .npy
// dataset there that input pipelines (any layout, batch and shape) read. A crash, a
// sanitizer report, a leak or a hang (libFuzzer's -timeout) is a bug; an error Status is not.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/sharding/mesh.h"
#include "net/credentials.h"
#include "net/grpc_util.h"
#include "tests/fuzz/npy.h"
#include "worker/grpc_transport.h"
#include "worker/worker_service.h"

namespace meshrun {
namespace {

struct Worker {
  Worker() {
    SetProcessCredentials(Credentials::Insecure());
    const char* tmp = std::getenv("TMPDIR");
    root = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/meshrun-fuzz-worker-", getpid());
    std::filesystem::create_directories(root);
    service = std::make_unique<WorkerService>(1, nullptr, nullptr, int64_t{64} << 20, root);
    Membership m;
    m.rank = 0;
    m.mesh = *Mesh::Parse("i=1");
    m.addresses = {"127.0.0.1:1"};  // never dialled: a group of one sends nothing
    m.cluster_id = "fuzz";
    service->Join(std::move(m), &ring);
    // A small .npy dataset for input pipelines to read: x f32 [16, 3], y i32 [16].
    data = root + "/data";
    std::filesystem::create_directories(data);
    WriteNpy(data + "/x.npy", "<f4", "(16, 3)", std::string(16 * 3 * 4, '\1'));
    WriteNpy(data + "/y.npy", "<i4", "(16,)", std::string(16 * 4, '\2'));
    // Two shards for programs to read.
    for (const char* id : {"a", "b"}) {
      v1::PutShardRequest put;
      put.set_array_id(id);
      put.mutable_shard()->set_dtype(v1::DTYPE_F32);
      put.mutable_shard()->mutable_shape()->add_dims(4);
      put.mutable_shard()->set_data(std::string(16, '\1'));
      const grpc::Slice bytes(put.SerializeAsString());
      (void)service->PutShardBytes(grpc::ByteBuffer(&bytes, 1));
    }
  }
  std::string root, data;
  RingService ring;
  std::unique_ptr<WorkerService> service;
};

template <typename Request, typename Response, typename Handler>
void Call(const uint8_t* data, size_t size, Handler handler) {
  Request req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return;
  Response resp;
  grpc::ServerContext ctx;
  (void)handler(&ctx, &req, &resp);
}

}  // namespace
}  // namespace meshrun

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshrun;
  static Worker* w = new Worker();
  if (size == 0) return 0;
  WorkerService& s = *w->service;
  const uint8_t which = data[0] % 14;
  ++data;
  --size;
  switch (which) {
    case 0:
      Call<v1::RunShardMapRequest, v1::RunShardMapResponse>(
          data, size, [&](auto* c, auto* q, auto* r) { return s.RunShardMap(c, q, r); });
      break;
    case 1: {
      // The fuzzer's bytes as they come off the wire: PutShard is served raw, its own parse
      // (ParseWithTensor) reads them, in a few slices as gRPC hands them over.
      std::vector<grpc::Slice> slices;
      for (size_t at = 0; at < size; at += 97) {
        slices.emplace_back(data + at, std::min<size_t>(97, size - at));
      }
      (void)s.PutShardBytes(grpc::ByteBuffer(slices.data(), slices.size()));
      break;
    }
    case 2: {
      // The raw handler's bytes (served on the callback API) must parse as the response.
      v1::GetShardRequest req;
      if (!req.ParseFromArray(data, static_cast<int>(size))) break;
      absl::StatusOr<grpc::ByteBuffer> got = s.GetShardBytes(req);
      v1::GetShardResponse resp;
      if (got.ok() && !ParseMessage(*got, &resp).ok()) {
        std::abort();
      }
      break;
    }
    case 3:
      Call<v1::DeleteShardRequest, v1::DeleteShardResponse>(
          data, size, [&](auto* c, auto* q, auto* r) { return s.DeleteShard(c, q, r); });
      break;
    case 4:
      Call<v1::SaveShardsRequest, v1::SaveShardsResponse>(
          data, size, [&](auto* c, auto* q, auto* r) { return s.SaveShards(c, q, r); });
      break;
    case 5:
      Call<v1::LoadShardsRequest, v1::LoadShardsResponse>(
          data, size, [&](auto* c, auto* q, auto* r) { return s.LoadShards(c, q, r); });
      break;
    case 6: {
      // Any layout, batch and shape over the fixed dataset (never another path).
      v1::OpenInputPipelineRequest req;
      if (!req.ParseFromArray(data, static_cast<int>(size))) break;
      req.set_input_id("in");
      req.mutable_spec()->set_format("npy");
      req.mutable_spec()->set_path(w->data);
      v1::OpenInputPipelineResponse resp;
      grpc::ServerContext ctx;
      // An opened pipeline builds its first batches on its thread; the next open of "in" joins it.
      (void)s.OpenInputPipeline(&ctx, &req, &resp);
      break;
    }
    case 7:
      Call<v1::KeepPeerStateRequest, v1::KeepPeerStateResponse>(
          data, size, [&](auto* c, auto* q, auto* r) { return s.KeepPeerState(c, q, r); });
      break;
    case 8:
      Call<v1::HoldPeerStateRequest, v1::HoldPeerStateResponse>(
          data, size, [&](auto* c, auto* q, auto* r) { return s.HoldPeerState(c, q, r); });
      break;
    case 9:
      Call<v1::PeerStateInfoRequest, v1::PeerStateInfoResponse>(
          data, size, [&](auto* c, auto* q, auto* r) { return s.PeerStateInfo(c, q, r); });
      break;
    case 10:
      Call<v1::FetchPeerStateRequest, v1::FetchPeerStateResponse>(
          data, size, [&](auto* c, auto* q, auto* r) { return s.FetchPeerState(c, q, r); });
      break;
    case 11:
      Call<v1::RestorePeerStateRequest, v1::RestorePeerStateResponse>(
          data, size, [&](auto* c, auto* q, auto* r) { return s.RestorePeerState(c, q, r); });
      break;
    case 12:
      Call<v1::DropPeerStateRequest, v1::DropPeerStateResponse>(
          data, size, [&](auto* c, auto* q, auto* r) { return s.DropPeerState(c, q, r); });
      break;
    default:
      Call<v1::AbortRequest, v1::AbortResponse>(
          data, size, [&](auto* c, auto* q, auto* r) { return s.Abort(c, q, r); });
      break;
  }
  return 0;
}
