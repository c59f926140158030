// WorkerService's raw shard RPCs: PutShardBytes stores what a request's bytes hold, however they
// are laid out, and refuses bad ones; GetShardBytes' response (a header, then a slice over the
// stored shard's memory) parses as the GetShardResponse that protobuf builds, and stays valid
// after the shard is deleted or replaced.
#include <cstdint>
#include <string>

#include "grpcpp/support/proto_buffer_reader.h"
#include "gtest/gtest.h"
#include "worker/worker_service.h"

namespace meshrun {
namespace {

v1::Tensor Arange(v1::DType dtype, const std::vector<int64_t>& dims, int seed) {
  Tensor t(dtype, Dims(dims.begin(), dims.end()));
  auto* bytes = static_cast<unsigned char*>(t.raw());
  for (size_t i = 0; i < t.size_bytes(); ++i) bytes[i] = static_cast<unsigned char>(i * 7 + seed);
  return t.ToProto();
}

class ShardBytesTest : public ::testing::Test {
 protected:
  void Put(const std::string& id, const v1::Tensor& shard) {
    v1::PutShardRequest req;
    req.set_array_id(id);
    *req.mutable_shard() = shard;
    const grpc::Slice bytes(req.SerializeAsString());
    absl::Status s = service_.PutShardBytes(grpc::ByteBuffer(&bytes, 1));
    ASSERT_TRUE(s.ok()) << s;
  }
  absl::StatusOr<grpc::ByteBuffer> Get(const std::string& id) {
    v1::GetShardRequest req;
    req.set_array_id(id);
    return service_.GetShardBytes(req);
  }
  static void ExpectParsesAs(grpc::ByteBuffer bytes, const v1::Tensor& shard) {
    const size_t length = bytes.Length();
    grpc::ProtoBufferReader reader(&bytes);
    v1::GetShardResponse parsed;
    ASSERT_TRUE(parsed.ParseFromZeroCopyStream(&reader));
    v1::GetShardResponse expected;
    *expected.mutable_shard() = shard;
    EXPECT_EQ(parsed.SerializeAsString(), expected.SerializeAsString())
        << parsed.ShortDebugString().substr(0, 300);
    EXPECT_EQ(length, expected.ByteSizeLong());
  }
  WorkerService service_{1, nullptr, nullptr, int64_t{64} << 20, "/tmp"};
};

TEST_F(ShardBytesTest, ParsesAsTheResponseProtobufBuilds) {
  const std::vector<std::pair<std::string, v1::Tensor>> cases = {
      {"scalar", Arange(v1::DTYPE_F32, {}, 1)},
      {"zero-size", Arange(v1::DTYPE_F32, {0, 3}, 1)},
      {"bf16", Arange(v1::DTYPE_BF16, {5, 7}, 2)},
      {"u8", Arange(v1::DTYPE_U8, {3}, 3)},
      // Lengths past one varint byte: a 240 KiB block.
      {"i32", Arange(v1::DTYPE_I32, {64, 960}, 4)},
  };
  for (const auto& [id, shard] : cases) {
    SCOPED_TRACE(id);
    Put(id, shard);
    absl::StatusOr<grpc::ByteBuffer> got = Get(id);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectParsesAs(*std::move(got), shard);
  }
}

TEST_F(ShardBytesTest, TheBytesOutliveTheShardsDeletionAndReplacement) {
  const v1::Tensor first = Arange(v1::DTYPE_F32, {256, 256}, 5);
  Put("x", first);
  absl::StatusOr<grpc::ByteBuffer> before_delete = Get("x");
  ASSERT_TRUE(before_delete.ok()) << before_delete.status();
  v1::DeleteShardRequest del;
  del.add_array_ids("x");
  v1::DeleteShardResponse deleted;
  grpc::ServerContext ctx;
  ASSERT_TRUE(service_.DeleteShard(&ctx, &del, &deleted).ok());
  EXPECT_EQ(Get("x").status().code(), absl::StatusCode::kNotFound);
  Put("x", first);
  absl::StatusOr<grpc::ByteBuffer> before_replace = Get("x");
  ASSERT_TRUE(before_replace.ok()) << before_replace.status();
  Put("x", Arange(v1::DTYPE_F32, {256, 256}, 9));  // the same size: its memory could be reused
  Put("y", Arange(v1::DTYPE_F32, {256, 256}, 11));
  ExpectParsesAs(*std::move(before_delete), first);
  ExpectParsesAs(*std::move(before_replace), first);
}

TEST_F(ShardBytesTest, AnUnknownIdIsNotFoundNamingIt) {
  absl::StatusOr<grpc::ByteBuffer> got = Get("nope");
  EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(got.status().message().find("nope"), std::string::npos) << got.status();
}

TEST_F(ShardBytesTest, PutShardBytesStoresASplitTensorAndRefusesBadRequests) {
  // As the Python SDK lays a Tensor out: dtype and shape, then the data, in two occurrences.
  const v1::Tensor shard = Arange(v1::DTYPE_BF16, {9, 3}, 6);
  v1::PutShardRequest head;
  head.set_array_id("split");
  v1::PutShardRequest meta;
  *meta.mutable_shard() = shard;
  meta.mutable_shard()->clear_data();
  v1::PutShardRequest data;
  data.mutable_shard()->set_data(shard.data());
  const std::string wire =
      head.SerializeAsString() + meta.SerializeAsString() + data.SerializeAsString();
  grpc::Slice slices[3] = {grpc::Slice(wire.substr(0, 5)), grpc::Slice(wire.substr(5, 20)),
                           grpc::Slice(wire.substr(25))};
  ASSERT_TRUE(service_.PutShardBytes(grpc::ByteBuffer(slices, 3)).ok());
  absl::StatusOr<grpc::ByteBuffer> got = Get("split");
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectParsesAs(*std::move(got), shard);

  auto put = [&](const std::string& bytes) {
    const grpc::Slice slice(bytes);
    return service_.PutShardBytes(grpc::ByteBuffer(&slice, 1));
  };
  v1::PutShardRequest no_id;
  *no_id.mutable_shard() = shard;
  EXPECT_EQ(put(no_id.SerializeAsString()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(put("\x12\x7f").code(), absl::StatusCode::kInvalidArgument);  // truncated
  v1::PutShardRequest huge;
  huge.set_array_id("huge");
  *huge.mutable_shard() = Arange(v1::DTYPE_U8, {int64_t{65} << 20}, 1);  // past the 64 MiB budget
  const absl::Status s = put(huge.SerializeAsString());
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(Get("huge").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace meshrun
