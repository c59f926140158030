// ParseWithTensor: a message's Tensor field read straight into a Tensor must agree with
// protobuf's parse followed by Tensor::FromProto, for every way the wire format allows the bytes
// to come, and refuse what protobuf refuses.
#include <string>
#include <vector>

#include "core/tensor.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "gtest/gtest.h"
#include "meshrun/v1/coordinator.pb.h"
#include "meshrun/v1/worker.pb.h"

namespace meshrun {
namespace {

v1::Tensor Proto(DType dtype, const Dims& dims, int seed) {
  Tensor t(dtype, dims);
  auto* bytes = static_cast<unsigned char*>(t.raw());
  for (size_t i = 0; i < t.size_bytes(); ++i) bytes[i] = static_cast<unsigned char>(i * 7 + seed);
  return t.ToProto();
}

std::string Varint(uint64_t v) {
  std::string out;
  while (v >= 0x80) {
    out += static_cast<char>((v & 0x7F) | 0x80);
    v >>= 7;
  }
  return out + static_cast<char>(v);
}

std::string Field(int number, const std::string& bytes) {
  return Varint(static_cast<uint64_t>(number) << 3 | 2) + Varint(bytes.size()) + bytes;
}

// Parsed in `block`-byte pieces, as gRPC's slices hand them over.
absl::Status Parse(const std::string& wire, int block, v1::PutShardRequest* rest, Tensor* t) {
  google::protobuf::io::ArrayInputStream stream(wire.data(), static_cast<int>(wire.size()), block);
  return ParseWithTensor(&stream, static_cast<int64_t>(wire.size()), /*shard*/ 2, rest, t);
}

// Both ways of reading `wire` agree: protobuf + FromProto, and ParseWithTensor in pieces.
void ExpectAgrees(const std::string& wire, const std::string& what) {
  SCOPED_TRACE(what);
  v1::PutShardRequest expected;
  ASSERT_TRUE(expected.ParseFromString(wire));
  absl::StatusOr<Tensor> want = Tensor::FromProto(expected.shard());
  for (int block : {1, 3, 7, 4096}) {
    v1::PutShardRequest rest;
    Tensor got;
    absl::Status s = Parse(wire, block, &rest, &got);
    ASSERT_EQ(s.ok(), want.ok()) << s << " / " << want.status();
    if (!s.ok()) {
      EXPECT_EQ(s, want.status());
      continue;
    }
    EXPECT_EQ(rest.array_id(), expected.array_id());
    EXPECT_EQ(got.ToProto().SerializeAsString(), want->ToProto().SerializeAsString());
  }
}

TEST(ParseWithTensorTest, AgreesWithProtobufAndFromProto) {
  const std::vector<std::pair<DType, Dims>> cases = {{v1::DTYPE_F32, {}},
                                                     {v1::DTYPE_F32, {0, 3}},
                                                     {v1::DTYPE_BF16, {5, 7}},
                                                     {v1::DTYPE_U8, {3}},
                                                     {v1::DTYPE_I32, {64, 960}}};
  for (const auto& [dtype, dims] : cases) {
    v1::PutShardRequest req;
    req.set_array_id("w");
    *req.mutable_shard() = Proto(dtype, dims, 3);
    const v1::Tensor& t = req.shard();
    const std::string head = Field(1, "w");
    ExpectAgrees(req.SerializeAsString(), "protobuf's own bytes " + DimsToString(dims));
    // As the Python SDK sends it: dtype and shape, then the data, in two occurrences.
    v1::Tensor meta = t;
    meta.clear_data();
    v1::Tensor data;
    data.set_data(t.data());
    ExpectAgrees(head + Field(2, meta.SerializeAsString()) + Field(2, data.SerializeAsString()),
                 "split " + DimsToString(dims));
    // The data first, the id last, unknown fields inside and outside the Tensor.
    std::string inside =
        data.SerializeAsString() + Varint(9 << 3 | 0) + Varint(5) + meta.SerializeAsString();
    ExpectAgrees(Varint(7 << 3 | 0) + Varint(300) + Field(2, inside) + Field(11, "x") + head,
                 "reordered " + DimsToString(dims));
  }
}

TEST(ParseWithTensorTest, RefusesWhatFromProtoRefuses) {
  v1::PutShardRequest req;
  req.set_array_id("w");
  *req.mutable_shard() = Proto(v1::DTYPE_F32, {4, 4}, 1);
  req.mutable_shard()->mutable_data()->resize(60);  // 4 bytes short
  ExpectAgrees(req.SerializeAsString(), "short data");
  req.mutable_shard()->mutable_shape()->add_dims(-2);
  ExpectAgrees(req.SerializeAsString(), "negative dim");
  req.mutable_shard()->set_dtype(static_cast<DType>(99));
  ExpectAgrees(req.SerializeAsString(), "unknown dtype");
}

TEST(ParseWithTensorTest, BytesThatAreNoMessageAreInvalidArgumentNamingTheType) {
  v1::PutShardRequest req;
  req.set_array_id("w");
  *req.mutable_shard() = Proto(v1::DTYPE_F32, {16}, 1);
  const std::string wire = req.SerializeAsString();
  // Truncated anywhere; a data length past the message's end (nothing allocated for it); a tag
  // with wire type 7.
  std::vector<std::string> bad;
  for (size_t cut : {size_t{1}, size_t{4}, wire.size() / 2, wire.size() - 1})
    bad.push_back(wire.substr(0, cut));
  bad.push_back(Field(1, "w") + Varint(2 << 3 | 2) + Varint(6) + "\x08\x01\x1a\xff\xff\x7f");
  bad.push_back(wire + Varint(5 << 3 | 7));
  // Cut just after the Tensor field's length: nothing of the Tensor is there.
  bad.push_back(Field(1, "w") + Varint(2 << 3 | 2) + Varint(20));
  for (const std::string& b : bad) {
    v1::PutShardRequest rest;
    Tensor t;
    absl::Status s = Parse(b, 5, &rest, &t);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("meshrun.v1.PutShardRequest"), std::string::npos) << s;
  }
}

// ParseWithTensors over `wire` in pieces agrees with protobuf + FromProto of every block.
void ExpectBlocksAgree(const std::string& wire, const std::string& what) {
  SCOPED_TRACE(what);
  v1::GetArrayResponse expected;
  ASSERT_TRUE(expected.ParseFromString(wire));
  std::vector<absl::StatusOr<Tensor>> want;
  absl::Status want_status;
  for (const v1::Tensor& b : expected.blocks()) {
    want.push_back(Tensor::FromProto(b));
    if (!want.back().ok() && want_status.ok()) want_status = want.back().status();
  }
  for (int block : {1, 3, 7, 4096}) {
    google::protobuf::io::ArrayInputStream stream(wire.data(), static_cast<int>(wire.size()),
                                                  block);
    v1::GetArrayResponse rest;
    std::vector<Tensor> got;
    absl::Status s =
        ParseWithTensors(&stream, static_cast<int64_t>(wire.size()), /*blocks*/ 2, &rest, &got);
    EXPECT_EQ(s, want_status);
    if (!s.ok()) continue;
    v1::GetArrayResponse without_blocks = expected;
    without_blocks.clear_blocks();
    EXPECT_EQ(rest.SerializeAsString(), without_blocks.SerializeAsString());
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].ToProto().SerializeAsString(), want[i]->ToProto().SerializeAsString())
          << "block " << i;
    }
  }
}

TEST(ParseWithTensorsTest, EachOccurrenceIsOneTensorAsProtobufReadsARepeatedField) {
  v1::GetArrayResponse resp;
  resp.mutable_info()->set_id("a");
  resp.mutable_info()->set_dtype(v1::DTYPE_F32);
  ExpectBlocksAgree(resp.SerializeAsString(), "no blocks");
  const std::vector<std::pair<DType, Dims>> blocks = {{v1::DTYPE_F32, {3, 5}},
                                                      {v1::DTYPE_BF16, {0}},
                                                      {v1::DTYPE_I32, {64, 17}},
                                                      {v1::DTYPE_F32, {}}};
  for (size_t i = 0; i < blocks.size(); ++i) {
    *resp.add_blocks() = Proto(blocks[i].first, blocks[i].second, static_cast<int>(i));
    resp.add_block_ranks(static_cast<int>(i) * 2);
  }
  ExpectBlocksAgree(resp.SerializeAsString(), "protobuf's own bytes");
  // Blocks, unpacked ranks and info interleaved, unknown fields between them.
  v1::Tensor meta = resp.blocks(0);
  meta.clear_data();
  v1::Tensor data;
  data.set_data(resp.blocks(0).data());
  v1::GetArrayResponse info_only;
  *info_only.mutable_info() = resp.info();
  const std::string mixed = Field(2, resp.blocks(2).SerializeAsString()) + Varint(3 << 3 | 0) +
                            Varint(4) + Field(9, "zz") + info_only.SerializeAsString() +
                            Field(2, resp.blocks(0).SerializeAsString()) + Varint(3 << 3 | 0) +
                            Varint(0) + Field(2, resp.blocks(3).SerializeAsString());
  ExpectBlocksAgree(mixed, "interleaved");
  // A block sent as dtype and shape, then data, is two blocks for a repeated field (as for
  // protobuf), the first without its data: FromProto's error.
  ExpectBlocksAgree(mixed + Field(2, meta.SerializeAsString()) + Field(2, data.SerializeAsString()),
                    "a block split in two");
}

TEST(ParseWithTensorsTest, ABlockThatFromProtoRefusesIsItsError) {
  v1::GetArrayResponse resp;
  *resp.add_blocks() = Proto(v1::DTYPE_F32, {2, 2}, 1);
  *resp.add_blocks() = Proto(v1::DTYPE_F32, {4, 4}, 1);
  resp.mutable_blocks(1)->mutable_data()->resize(12);
  ExpectBlocksAgree(resp.SerializeAsString(), "short data in the second block");
  v1::GetArrayResponse rest;
  std::vector<Tensor> got;
  const std::string cut = resp.SerializeAsString().substr(0, 30);
  google::protobuf::io::ArrayInputStream stream(cut.data(), static_cast<int>(cut.size()));
  absl::Status s =
      ParseWithTensors(&stream, static_cast<int64_t>(cut.size()), /*blocks*/ 2, &rest, &got);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("meshrun.v1.GetArrayResponse"), std::string::npos) << s;
}

}  // namespace
}  // namespace meshrun
