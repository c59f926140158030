// Client's calls on the cluster's arrays (device_put, device_get, ListArrays, input pipelines,
// shard_map and jit programs over them). PutArray and GetArray go out raw: the array's bytes are
// sent from the caller's memory and the blocks read straight from the response's slices.
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/sharding/shard_layout.h"
#include "meshrun/client.h"
#include "net/grpc_util.h"
#include "net/tensor_wire.h"

namespace meshrun {

absl::StatusOr<v1::ArrayInfo> Client::Put(const Tensor& host, const PartitionSpec& spec,
                                          const std::string& id) {
  if (static_cast<int64_t>(host.size_bytes()) > kMaxArrayMessageBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Put: the array's ", host.size_bytes(), " bytes (", DimsToString(host.dims()),
        ") exceed the ", kMaxArrayMessageBytes,
        " bytes one PutArray message carries (protobuf's 2 GiB limit); put it in pieces, or ",
        "read it on the workers through an input (OpenInput)"));
  }
  grpc::ClientContext ctx;
  Prepare(ctx, absl::Seconds(120));
  // PutArrayRequest{array, spec, id} as its wire bytes: the other fields, then the array's field
  // header, then its data as a slice over `host`'s memory (not copied; the alias keeps it alive
  // for as long as gRPC holds the slice). The coordinator reads the fields in any order.
  v1::PutArrayRequest rest;
  *rest.mutable_spec() = spec.ToProto();
  rest.set_id(id);
  auto data = std::make_shared<const Tensor>(host.Alias());
  const grpc::Slice slices[] = {
      grpc::Slice(rest.SerializeAsString()),
      grpc::Slice(TensorFieldPrefix(/*array*/ 1, host.dtype(), host.dims(), host.size_bytes())),
      BorrowedSlice(data, data->raw(), host.size_bytes())};
  const grpc::ByteBuffer request(slices, host.size_bytes() > 0 ? 3 : 2);
  grpc::ByteBuffer response;
  if (grpc::Status s =
          RawUnaryCall(channel_, &ctx, MethodPath(v1::Coordinator::service_full_name(), "PutArray"),
                       request, &response);
      !s.ok()) {
    return FromGrpcStatus(s);
  }
  v1::PutArrayResponse resp;
  if (absl::Status s = ParseMessage(response, &resp); !s.ok()) {
    return absl::InternalError(absl::StrCat("PutArray's response: ", s.message()));
  }
  return resp.info();
}

namespace {

// The global array of `info` from one replica of each of its blocks, `blocks[i]` from rank
// `ranks[i]` (device_get's assembly). A block that is the whole array is returned as it is.
absl::StatusOr<Tensor> Assemble(const v1::ArrayInfo& info,
                                const google::protobuf::RepeatedField<int32_t>& ranks,
                                std::vector<Tensor> blocks) {
  absl::StatusOr<NamedSharding> sharding = NamedSharding::FromProto(info.sharding());
  if (!sharding.ok()) return sharding.status();
  if (static_cast<int>(blocks.size()) != ranks.size()) {
    return absl::InternalError(
        absl::StrCat("GetArray: ", blocks.size(), " blocks from ", ranks.size(), " ranks"));
  }
  const Dims dims(info.shape().dims().begin(), info.shape().dims().end());
  if (blocks.size() == 1 && blocks[0].dtype() == info.dtype() && blocks[0].dims() == dims) {
    return std::move(blocks[0]);
  }
  Tensor global(info.dtype(), dims);
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (absl::Status s = InsertShard(blocks[i], *sharding, ranks[static_cast<int>(i)], global);
        !s.ok()) {
      return s;
    }
  }
  return global;
}

absl::StatusOr<Tensor> Assemble(const v1::GetArrayResponse& resp) {
  std::vector<Tensor> blocks;
  for (const v1::Tensor& proto : resp.blocks()) {
    absl::StatusOr<Tensor> block = Tensor::FromProto(proto);
    if (!block.ok()) return block.status();
    blocks.push_back(*std::move(block));
  }
  return Assemble(resp.info(), resp.block_ranks(), std::move(blocks));
}

}  // namespace

absl::StatusOr<Tensor> Client::Get(const std::string& id) {
  grpc::ClientContext ctx;
  Prepare(ctx, absl::Seconds(120));
  v1::GetArrayRequest req;
  req.set_id(id);
  const grpc::Slice request_bytes(req.SerializeAsString());
  grpc::ByteBuffer response;
  if (grpc::Status s =
          RawUnaryCall(channel_, &ctx, MethodPath(v1::Coordinator::service_full_name(), "GetArray"),
                       grpc::ByteBuffer(&request_bytes, 1), &response);
      !s.ok()) {
    return FromGrpcStatus(s);
  }
  // Each block read straight from the response's slices into its Tensor.
  v1::GetArrayResponse rest;
  std::vector<Tensor> blocks;
  if (absl::Status s = ParseWithTensors(response, /*blocks*/ 2, &rest, &blocks); !s.ok()) {
    return absl::InternalError(absl::StrCat("GetArray's response: ", s.message()));
  }
  return Assemble(rest.info(), rest.block_ranks(), std::move(blocks));
}

absl::Status Client::Delete(absl::Span<const std::string> ids) {
  grpc::ClientContext ctx;
  Prepare(ctx, absl::Seconds(30));
  v1::DeleteArrayRequest req;
  *req.mutable_ids() = {ids.begin(), ids.end()};
  v1::DeleteArrayResponse resp;
  return FromGrpcStatus(stub_->DeleteArray(&ctx, req, &resp));
}

absl::StatusOr<v1::InputInfo> Client::OpenInput(const v1::InputSpec& spec, const std::string& id) {
  grpc::ClientContext ctx;
  Prepare(ctx, absl::Seconds(120));
  v1::OpenInputRequest req;
  *req.mutable_spec() = spec;
  req.set_id(id);
  v1::OpenInputResponse resp;
  if (grpc::Status s = stub_->OpenInput(&ctx, req, &resp); !s.ok()) return FromGrpcStatus(s);
  return resp.info();
}

absl::Status Client::CloseInput(const std::string& id) {
  grpc::ClientContext ctx;
  Prepare(ctx, absl::Seconds(30));
  v1::CloseInputRequest req;
  req.set_id(id);
  v1::CloseInputResponse resp;
  return FromGrpcStatus(stub_->CloseInput(&ctx, req, &resp));
}

absl::StatusOr<std::vector<v1::ArrayInfo>> Client::ListArrays() {
  grpc::ClientContext ctx;
  Prepare(ctx, absl::Seconds(10));
  v1::ListArraysResponse resp;
  if (grpc::Status s = stub_->ListArrays(&ctx, v1::ListArraysRequest(), &resp); !s.ok())
    return FromGrpcStatus(s);
  return std::vector<v1::ArrayInfo>(resp.arrays().begin(), resp.arrays().end());
}

absl::StatusOr<std::string> Client::VisualizeSharding(const std::string& id) {
  absl::StatusOr<std::vector<v1::ArrayInfo>> arrays = ListArrays();
  if (!arrays.ok()) return arrays.status();
  for (const auto& info : *arrays) {
    if (info.id() != id) continue;
    absl::StatusOr<NamedSharding> sharding = NamedSharding::FromProto(info.sharding());
    if (!sharding.ok()) return sharding.status();
    return meshrun::VisualizeSharding(Dims(info.shape().dims().begin(), info.shape().dims().end()),
                                      *sharding);
  }
  return absl::NotFoundError(absl::StrCat("no array '", id, "' on the cluster at ", address_));
}

namespace {

// The arguments ShardMapRequest and JitRequest share.
template <typename Request>
void SetCall(const std::vector<std::string>& input_ids, const std::vector<std::string>& output_ids,
             absl::Duration collective_timeout, const std::vector<int>& donate_argnums,
             Request& req) {
  for (const auto& id : input_ids) req.add_input_ids(id);
  for (const auto& id : output_ids) req.add_output_ids(id);
  for (int a : donate_argnums) req.add_donate_argnums(a);
  req.set_collective_timeout_seconds(absl::ToDoubleSeconds(collective_timeout));
}

}  // namespace

absl::StatusOr<std::vector<v1::ArrayInfo>> Client::ShardMap(
    const v1::ShardMapProgram& program, const std::vector<std::string>& input_ids,
    const std::vector<std::string>& output_ids, absl::Duration collective_timeout,
    const std::vector<int>& donate_argnums) {
  grpc::ClientContext ctx;
  Prepare(ctx, collective_timeout * 4 + absl::Seconds(60));
  v1::ShardMapRequest req;
  *req.mutable_program() = program;
  SetCall(input_ids, output_ids, collective_timeout, donate_argnums, req);
  v1::ShardMapResponse resp;
  if (grpc::Status s = stub_->ShardMap(&ctx, req, &resp); !s.ok()) return FromGrpcStatus(s);
  return std::vector<v1::ArrayInfo>(resp.outputs().begin(), resp.outputs().end());
}

absl::StatusOr<Client::JitResult> Client::Jit(
    const v1::GlobalProgram& program, const std::vector<std::string>& input_ids,
    const std::vector<std::string>& output_ids, absl::Duration collective_timeout,
    const std::vector<int>& donate_argnums, const std::vector<int>& fetch_outputs,
    const std::vector<std::vector<std::string>>& more_runs) {
  grpc::ClientContext ctx;
  Prepare(ctx, (collective_timeout * 4 + absl::Seconds(60)) *
                   static_cast<int64_t>(1 + more_runs.size()));
  v1::JitRequest req;
  *req.mutable_program() = program;
  SetCall(input_ids, output_ids, collective_timeout, donate_argnums, req);
  for (int f : fetch_outputs) req.add_fetch_outputs(f);
  for (const std::vector<std::string>& ids : more_runs) {
    v1::ArgumentIds* run = req.add_more_runs();
    for (const std::string& id : ids) run->add_input_ids(id);
  }
  v1::JitResponse resp;
  if (grpc::Status s = stub_->Jit(&ctx, req, &resp); !s.ok()) return FromGrpcStatus(s);
  JitResult r;
  r.outputs.assign(resp.outputs().begin(), resp.outputs().end());
  r.collectives.assign(resp.collectives().begin(), resp.collectives().end());
  r.cache_hit = resp.cache_hit();
  for (const v1::GetArrayResponse& got : resp.fetched()) {
    absl::StatusOr<Tensor> t = Assemble(got);
    if (!t.ok()) return t.status();
    r.fetched.push_back(*std::move(t));
  }
  return r;
}

}  // namespace meshrun
