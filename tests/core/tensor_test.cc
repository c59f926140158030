#include "core/tensor.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace meshrun {
namespace {

using ::testing::HasSubstr;

TEST(CheckedByteSizeTest, SizesAreCheckedForOverflowNegativesAndTheLimit) {
  EXPECT_EQ(*CheckedByteSize(v1::DTYPE_F32, {128, 784}), 128 * 784 * 4);
  EXPECT_EQ(*CheckedByteSize(v1::DTYPE_BF16, {}), 2) << "a scalar";
  EXPECT_EQ(*CheckedByteSize(v1::DTYPE_I32, {int64_t{1} << 62, 0}), 0) << "an empty array is empty";
  absl::StatusOr<int64_t> overflow = CheckedByteSize(v1::DTYPE_I32, {int64_t{1} << 62, 4});
  EXPECT_EQ(overflow.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(overflow.status().message(),
              HasSubstr("i32[4611686018427387904, 4] is larger than the limit"));
  EXPECT_FALSE(CheckedByteSize(v1::DTYPE_F32, {int64_t{1} << 45}).ok()) << "2^47 bytes";
  EXPECT_TRUE(CheckedByteSize(v1::DTYPE_F32, {int64_t{1} << 44}).ok()) << "2^46 bytes: the limit";
  absl::StatusOr<int64_t> negative = CheckedByteSize(v1::DTYPE_F32, {3, -1});
  EXPECT_THAT(negative.status().message(), HasSubstr("negative dim -1 in shape f32[3, -1]"));
  EXPECT_THAT(CheckedByteSize(v1::DTYPE_UNSPECIFIED, {2}).status().message(),
              HasSubstr("has no dtype"));
}

// The byte count is checked before anything is allocated: a request that declares a huge shape
// and sends no data costs nothing.
TEST(TensorTest, FromProtoChecksTheDeclaredBytesBeforeAllocating) {
  v1::Tensor proto;
  proto.set_dtype(v1::DTYPE_F32);
  proto.mutable_shape()->add_dims(int64_t{1} << 40);
  absl::StatusOr<Tensor> t = Tensor::FromProto(proto);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(),
              HasSubstr("f32[1099511627776] needs 4398046511104 bytes, got 0"));
  proto.mutable_shape()->set_dims(0, 2);
  proto.set_data(std::string(8, '\0'));
  ASSERT_TRUE(Tensor::FromProto(proto).ok());
}

}  // namespace
}  // namespace meshrun
