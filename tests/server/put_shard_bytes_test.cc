#include <string>

#include "core/sharding/shard_layout.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "gtest/gtest.h"
#include "server/array_registry.h"

namespace meshrun {
namespace {

Tensor Arange(DType dtype, Dims dims) {
  Tensor t(dtype, std::move(dims));
  auto* bytes = static_cast<unsigned char*>(t.raw());
  for (size_t i = 0; i < t.size_bytes(); ++i) bytes[i] = static_cast<unsigned char>(i * 7 + 1);
  return t;
}

// The hand-written bytes must parse as the message they replace, built field by field.
void ExpectParsesAsTheMessage(const Tensor& global, const NamedSharding& sharding, int rank,
                              const std::string& id) {
  grpc::ByteBuffer bytes = PutShardRequestBytes(global, sharding, rank, id);
  grpc::ProtoBufferReader reader(&bytes);
  v1::PutShardRequest parsed;
  ASSERT_TRUE(parsed.ParseFromZeroCopyStream(&reader)) << id;
  v1::PutShardRequest expected;
  expected.set_array_id(id);
  absl::StatusOr<Tensor> shard = ExtractShard(global, sharding, rank);
  ASSERT_TRUE(shard.ok()) << shard.status();
  *expected.mutable_shard() = shard->ToProto();
  EXPECT_EQ(parsed.SerializeAsString(), expected.SerializeAsString())
      << id << " rank " << rank << ": " << parsed.ShortDebugString().substr(0, 300);
  EXPECT_EQ(bytes.Length(), expected.ByteSizeLong()) << id;
}

TEST(PutShardRequestBytesTest, ParseAsTheRequestBuiltFieldByField) {
  const Mesh mesh = *Mesh::Parse("i=4,j=2");
  const NamedSharding replicated(mesh, PartitionSpec());
  const NamedSharding both(mesh, PartitionSpec::Of({"i", "j"}));
  ExpectParsesAsTheMessage(Arange(v1::DTYPE_F32, {}), replicated, 3, "scalar");
  ExpectParsesAsTheMessage(Arange(v1::DTYPE_F32, {0, 8}), both, 5, "zero-size");
  ExpectParsesAsTheMessage(Arange(v1::DTYPE_F32, {1}), replicated, 0, "");  // empty id, 4 bytes
  for (int r = 0; r < mesh.size(); ++r) {
    ExpectParsesAsTheMessage(Arange(v1::DTYPE_BF16, {8, 6}), both, r, "bf16-block");
    // Lengths past one varint byte: a 200-character id, 120 KiB blocks.
    ExpectParsesAsTheMessage(Arange(v1::DTYPE_I32, {64, 960}), both, r, std::string(200, 'a'));
  }
}

}  // namespace
}  // namespace meshrun
