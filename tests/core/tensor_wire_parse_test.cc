// ParseWithTensor: a message's Tensor field read straight into a Tensor must agree with
// protobuf's parse followed by Tensor::FromProto, for every way the wire format allows the bytes
// to come, and refuse what protobuf refuses.
#include <string>
#include <vector>

#include "core/tensor.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "gtest/gtest.h"
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

}  // namespace
}  // namespace meshrun
