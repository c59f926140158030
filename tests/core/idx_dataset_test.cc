#include "core/data/idx_dataset.h"

#include <zlib.h>

#include <cstdio>

#include "core/data/dataset.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace meshrun {
namespace {

using ::testing::HasSubstr;

TEST(IdxDatasetTest, LoadsFashionMnistFromTheDebianPackage) {
  absl::StatusOr<std::unique_ptr<Dataset>> test =
      Dataset::Open("idx", "/usr/share/datasets/fashion-mnist", "test");
  ASSERT_TRUE(test.ok()) << test.status();
  EXPECT_EQ((*test)->num_examples(), 10000);
  EXPECT_EQ((*test)->fields()[0].example_dims, Dims({28, 28}));
  // The first t10k label is 9 (ankle boot), the second 2 (pullover); 1000 of each class.
  int counts[10] = {};
  for (int64_t e = 0; e < 10000; ++e) {
    uint8_t label = 0;
    (*test)->CopyElements(1, e, 0, 1, &label);
    if (e == 0) {
      EXPECT_EQ(label, 9);
    }
    if (e == 1) {
      EXPECT_EQ(label, 2);
    }
    ASSERT_LT(label, 10);
    counts[label]++;
  }
  for (int c : counts) EXPECT_EQ(c, 1000);
}

TEST(IdxDatasetTest, MissingPathIsNotFoundNamingIt) {
  absl::StatusOr<std::unique_ptr<Dataset>> ds = Dataset::Open("idx", "/no/such/dir", "train");
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
