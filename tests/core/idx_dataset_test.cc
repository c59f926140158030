#include "core/data/idx_dataset.h"

#include <zlib.h>

#include <cstdio>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace meshrun {
namespace {

using ::testing::HasSubstr;

TEST(IdxDatasetTest, LoadsFashionMnistFromTheDebianPackage) {
  absl::StatusOr<ImageDataset> test = LoadFashionMnist("/usr/share/datasets/fashion-mnist", "test");
  ASSERT_TRUE(test.ok()) << test.status();
  EXPECT_EQ(test->num_examples, 10000);
  EXPECT_EQ(test->image_size, 784);
  ASSERT_EQ(test->labels.size(), 10000u);
  // The first t10k label is 9 (ankle boot), the second 2 (pullover).
  EXPECT_EQ(test->labels[0], 9);
  EXPECT_EQ(test->labels[1], 2);
  int counts[10] = {};
  for (uint8_t l : test->labels) counts[l]++;
  for (int c : counts) EXPECT_EQ(c, 1000);
}

TEST(IdxDatasetTest, MissingPathIsNotFoundNamingIt) {
  absl::StatusOr<ImageDataset> ds = LoadFashionMnist("/no/such/dir", "train");
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(ds.status().message(), HasSubstr("/no/such/dir/train-images-idx3-ubyte.gz"));
}

TEST(IdxDatasetTest, TruncatedFileIsDataLoss) {
  std::string path = ::testing::TempDir() + "/trunc-idx.gz";
  gzFile f = gzopen(path.c_str(), "wb");
  const unsigned char header[] = {0, 0, 8, 1, 0, 0, 0, 100, 1, 2, 3};
  gzwrite(f, header, sizeof(header));
  gzclose(f);
  absl::StatusOr<IdxArray> a = ReadIdxFile(path);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(a.status().message(), HasSubstr("ends early"));
  std::remove(path.c_str());
}

// A header may claim anything: dims past any size are refused, and dims larger than the file are
// found out by reading, not by allocating what they claim.
TEST(IdxDatasetTest, AHeaderDeclaringHugeDimsIsAClearErrorWithNothingAllocated) {
  std::string path = ::testing::TempDir() + "/huge-idx.gz";
  for (const auto& [dims, expected] :
       std::vector<std::pair<std::vector<unsigned char>, std::string>>{
           {{0, 0, 8, 3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, 0xff, 0xff, 0xff},
            "larger than the limit"},
           {{0, 0, 8, 2, 0x00, 0x10, 0x00, 0x00, 0x00, 0x10, 0x00, 0x00, 1, 2, 3}, "ends early"}}) {
    gzFile f = gzopen(path.c_str(), "wb");
    gzwrite(f, dims.data(), dims.size());
    gzclose(f);
    absl::StatusOr<IdxArray> a = ReadIdxFile(path);
    EXPECT_EQ(a.status().code(), absl::StatusCode::kDataLoss) << a.status();
    EXPECT_THAT(a.status().message(), HasSubstr(expected));
  }
  std::remove(path.c_str());
}

}  // namespace
}  // namespace meshrun
