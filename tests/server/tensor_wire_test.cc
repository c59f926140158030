// net/tensor_wire.h's field surgery on raw bytes: SoleFieldContents takes the Tensor out of a
// GetShardResponse's bytes without copying it, however its slices split them, and refuses bytes
// that are not that one field; AppendField wraps slices as a field that parses. ParseMessage
// (net/grpc_util.h) reads a message from a raw call's bytes.
#include "net/tensor_wire.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "meshrun/v1/coordinator.pb.h"
#include "meshrun/v1/worker.pb.h"
#include "net/grpc_util.h"

namespace meshrun {
namespace {

// `bytes` cut into slices at `cuts` (offsets, ascending).
grpc::ByteBuffer Split(const std::string& bytes, const std::vector<size_t>& cuts) {
  std::vector<grpc::Slice> slices;
  size_t begin = 0;
  for (size_t cut : cuts) {
    slices.emplace_back(bytes.data() + begin, cut - begin);
    begin = cut;
  }
  slices.emplace_back(bytes.data() + begin, bytes.size() - begin);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::string Join(const std::vector<grpc::Slice>& slices) {
  std::string out;
  for (const grpc::Slice& s : slices)
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

v1::Tensor Block(int elements) {
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_F32);
  t.mutable_shape()->add_dims(elements);
  std::string data(4 * elements, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 13 + 5);
  t.set_data(data);
  return t;
}

TEST(TensorWireTest, SoleFieldContentsIsTheTensorWhereverTheSlicesSplitIt) {
  for (int elements : {1, 40, 5000}) {  // field lengths of one, two and three varint bytes
    v1::GetShardResponse response;
    *response.mutable_shard() = Block(elements);
    const std::string bytes = response.SerializeAsString();
    const std::string tensor = response.shard().SerializeAsString();
    for (const std::vector<size_t>& cuts : std::vector<std::vector<size_t>>{
             {}, {1}, {2}, {1, 2}, {3}, {1, 2, 3, 4}, {bytes.size() / 2}}) {
      SCOPED_TRACE(testing::Message() << elements << " elements, " << cuts.size() << " cuts");
      absl::StatusOr<std::vector<grpc::Slice>> got = SoleFieldContents(Split(bytes, cuts), 1);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(Join(*got), tensor);
    }
  }
}

TEST(TensorWireTest, SoleFieldContentsRefusesAnythingElse) {
  v1::GetShardResponse response;
  *response.mutable_shard() = Block(8);
  const std::string bytes = response.SerializeAsString();
  EXPECT_FALSE(SoleFieldContents(Split(bytes, {}), 2).ok());               // another field
  EXPECT_FALSE(SoleFieldContents(Split(bytes + "\x10\x01", {}), 1).ok());  // more after it
  EXPECT_FALSE(SoleFieldContents(Split(bytes.substr(0, bytes.size() - 1), {}), 1).ok());
  EXPECT_FALSE(SoleFieldContents(grpc::ByteBuffer(), 1).ok());  // an empty message
  EXPECT_FALSE(SoleFieldContents(Split("\x0a", {}), 1).ok());   // a tag without a length
  const absl::Status s = SoleFieldContents(Split(bytes, {}), 3).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("field 3"), std::string::npos) << s;
}

TEST(TensorWireTest, AppendedFieldsParseAsTheMessage) {
  v1::GetArrayResponse expected;
  expected.mutable_info()->set_id("x");
  std::vector<grpc::Slice> out;
  AppendField(out, 1, {grpc::Slice(expected.info().SerializeAsString())});
  std::string ranks;
  for (int r : {0, 3, 200}) {  // 200: a two-byte varint
    *expected.add_blocks() = Block(r + 1);
    expected.add_block_ranks(r);
    const std::string tensor = expected.blocks().rbegin()->SerializeAsString();
    // The Tensor in two slices, as a worker's header and data come.
    AppendField(out, 2, {grpc::Slice(tensor.substr(0, 3)), grpc::Slice(tensor.substr(3))});
    AppendVarint(ranks, r);
  }
  AppendField(out, 3, {grpc::Slice(ranks)});
  grpc::ByteBuffer bytes(out.data(), out.size());
  v1::GetArrayResponse parsed;
  ASSERT_TRUE(ParseMessage(bytes, &parsed).ok());
  EXPECT_EQ(parsed.SerializeAsString(), expected.SerializeAsString())
      << parsed.ShortDebugString().substr(0, 300);
  // What the C++ SDK's Get reads from them: the blocks as Tensors, the rest as it was.
  v1::GetArrayResponse rest;
  std::vector<Tensor> blocks;
  ASSERT_TRUE(ParseWithTensors(bytes, 2, &rest, &blocks).ok());
  EXPECT_EQ(rest.info().id(), "x");
  EXPECT_EQ(rest.block_ranks_size(), 3);
  ASSERT_EQ(blocks.size(), 3u);
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(blocks[i].ToProto().SerializeAsString(), expected.blocks(i).SerializeAsString());
}

TEST(ParseMessageTest, ReadsTheMessageWhereverTheSlicesSplitIt) {
  v1::GetShardResponse expected;
  *expected.mutable_shard() = Block(300);
  const std::string wire = expected.SerializeAsString();
  for (const std::vector<size_t>& cuts : {std::vector<size_t>{}, {1}, {2, 3, 700}}) {
    v1::GetShardResponse got;
    const grpc::ByteBuffer bytes = Split(wire, cuts);
    ASSERT_TRUE(ParseMessage(bytes, &got).ok());
    EXPECT_EQ(got.SerializeAsString(), wire);
    EXPECT_EQ(bytes.Length(), wire.size());  // the caller's buffer is left as it was
  }
}

TEST(ParseMessageTest, BytesThatAreNotTheMessageAreInvalidArgumentNamingIt) {
  v1::GetShardResponse expected;
  *expected.mutable_shard() = Block(10);
  const std::string wire = expected.SerializeAsString();
  v1::GetShardResponse got;
  absl::Status s = ParseMessage(Split(wire.substr(0, wire.size() - 1), {5}), &got);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            absl::StrCat("the ", wire.size() - 1, " bytes are not a meshrun.v1.GetShardResponse"));
}

}  // namespace
}  // namespace meshrun
