// Reading saved blocks back (core/checkpoint/checkpoint.h): the byte range a block is said to
// occupy is checked against its file before any memory is taken for it.
#include <unistd.h>
#include <zlib.h>

#include <cstdint>
#include <filesystem>
#include <limits>

#include "absl/strings/str_cat.h"
#include "core/checkpoint/checkpoint.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace meshrun {
namespace {

using ::testing::HasSubstr;

class ReadBlockAtTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = (std::filesystem::path(::testing::TempDir()) /
             absl::StrCat("read_block_at_", getpid(), ".safetensors"))
                .string();
    Tensor t(v1::DTYPE_F32, {4});
    for (int i = 0; i < 4; ++i) t.data<float>()[i] = static_cast<float>(i + 1);
    auto offsets = checkpoint::WriteSafetensors(path_, {{"w", &t}});
    ASSERT_TRUE(offsets.ok()) << offsets.status();
    offset_ = (*offsets)[0];
    auto back = checkpoint::ReadSafetensors(path_);
    ASSERT_TRUE(back.ok()) << back.status();
  }
  void TearDown() override { std::filesystem::remove(path_); }

  std::string path_;
  int64_t offset_ = 0;
};

TEST_F(ReadBlockAtTest, ARangePastTheFilesEndIsRefusedBeforeAnythingIsAllocated) {
  // f32[2^30]: 4 GiB said to follow the real block, in a file of a few hundred bytes.
  const int64_t n = int64_t{1} << 30;
  auto t = checkpoint::ReadBlockAt(path_, "w", v1::DTYPE_F32, {n}, offset_, 4 * n, 0);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(t.status().message(), HasSubstr("the block's 4294967296 bytes at offset"));
  EXPECT_THAT(t.status().message(), HasSubstr("truncated or misplaced"));
  // A negative offset, and one whose end would overflow, are refused the same way.
  for (int64_t at : {int64_t{-8}, std::numeric_limits<int64_t>::max() - 8}) {
    auto bad = checkpoint::ReadBlockAt(path_, "w", v1::DTYPE_F32, {4}, at, 16, 0);
    ASSERT_FALSE(bad.ok()) << at;
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss) << bad.status();
  }
  auto missing = checkpoint::ReadBlockAt(path_ + ".gone", "w", v1::DTYPE_F32, {4}, 0, 16, 0);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
}

TEST_F(ReadBlockAtTest, TheSavedBlockReadsBackWhole) {
  const float want[4] = {1, 2, 3, 4};
  const uint32_t crc =
      static_cast<uint32_t>(crc32(0L, reinterpret_cast<const Bytef*>(want), sizeof(want)));
  auto t = checkpoint::ReadBlockAt(path_, "w", v1::DTYPE_F32, {4}, offset_, 16, crc);
  ASSERT_TRUE(t.ok()) << t.status();
  for (int i = 0; i < 4; ++i) EXPECT_EQ(t->data<float>()[i], want[i]);
}

}  // namespace
}  // namespace meshrun
