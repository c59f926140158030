#include "core/data/input_pipeline.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace meshrun {
namespace {

using ::testing::HasSubstr;

// Writes a .npy file (format 1.0) as numpy.save does.
void WriteNpy(const std::string& path, const std::string& descr, const Dims& dims, const void* data,
              size_t bytes, bool fortran = false) {
  std::string shape = "(";
  for (int64_t d : dims) absl::StrAppend(&shape, d, ", ");
  if (dims.size() > 1) shape.resize(shape.size() - 2);
  shape += ")";
  std::string header =
      absl::StrCat("{'descr': '", descr, "', 'fortran_order': ", fortran ? "True" : "False",
                   ", 'shape': ", shape, ", }");
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::ofstream f(path, std::ios::binary);
  f.write("\x93NUMPY\x01\x00", 8);
  const uint16_t len = static_cast<uint16_t>(header.size());
  f.write(reinterpret_cast<const char*>(&len), 2);
  f << header;
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
}

// A dataset of n examples: "x" f32 [6] with x[e][j] = 100 e + j, "y" i32 [] = e.
std::string MakeDataset(const std::string& name, int64_t n) {
  const std::string dir = ::testing::TempDir() + "/" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::vector<float> x(n * 6);
  std::vector<int32_t> y(n);
  for (int64_t e = 0; e < n; ++e) {
    y[e] = static_cast<int32_t>(e);
    for (int j = 0; j < 6; ++j) x[e * 6 + j] = static_cast<float>(100 * e + j);
  }
  WriteNpy(dir + "/x.npy", "<f4", {n, 6}, x.data(), x.size() * 4);
  WriteNpy(dir + "/y.npy", "<i4", {n}, y.data(), y.size() * 4);
  return dir;
}

std::shared_ptr<const Dataset> Open(const std::string& dir) {
  absl::StatusOr<std::unique_ptr<Dataset>> ds = Dataset::Open("npy", dir, "");
  EXPECT_TRUE(ds.ok()) << ds.status();
  return ds.ok() ? std::shared_ptr<const Dataset>(*std::move(ds)) : nullptr;
}

InputPipelineOptions Options(const std::string& mesh, int rank, int64_t batch, int k,
                             const PartitionSpec& x_spec, const PartitionSpec& y_spec) {
  InputPipelineOptions o;
  o.mesh = *Mesh::Parse(mesh);
  o.rank = rank;
  o.num_minibatches = k;
  const Dims lead = k > 1 ? Dims{k, batch / k} : Dims{batch};
  Dims xs = lead, ys = lead;
  xs.push_back(6);
  o.fields = {{"x", v1::DTYPE_F32, xs, x_spec}, {"y", v1::DTYPE_I32, ys, y_spec}};
  o.order.batch_size = batch;
  o.order.seed = 7;
  return o;
}

// The example ids of every row of a y block.
std::vector<int32_t> Ids(const Tensor& y) {
  return std::vector<int32_t>(y.data<int32_t>(), y.data<int32_t>() + y.num_elements());
}

TEST(GlobalOrderTest, ShufflesEachEpochAndDropsTheRemainder) {
  GlobalOrder order = *GlobalOrder::Create({10, 4, 3, true, true, true});
  EXPECT_EQ(order.steps_per_epoch(), 2);
  std::vector<int64_t> epoch0, epoch1;
  for (int64_t s = 0; s < 2; ++s)
    for (int r = 0; r < 4; ++r) epoch0.push_back(order.ExampleAt(s, r));
  for (int r = 0; r < 4; ++r) epoch1.push_back(order.ExampleAt(2, r));
  std::set<int64_t> distinct(epoch0.begin(), epoch0.end());
  EXPECT_EQ(distinct.size(), 8u);  // no example twice in an epoch
  EXPECT_NE(epoch0, std::vector<int64_t>({0, 1, 2, 3, 4, 5, 6, 7}));
  // Step 2 starts epoch 1, whose order differs from epoch 0's.
  EXPECT_NE(std::vector<int64_t>(epoch0.begin(), epoch0.begin() + 4), epoch1);
}

TEST(GlobalOrderTest, WithoutDropRemainderBatchesSpanEpochs) {
  GlobalOrder order = *GlobalOrder::Create({10, 4, 3, /*shuffle=*/false, false, true});
  EXPECT_DOUBLE_EQ(order.steps_per_epoch(), 2.5);
  std::vector<int64_t> step2;
  for (int r = 0; r < 4; ++r) step2.push_back(order.ExampleAt(2, r));
  EXPECT_EQ(step2, std::vector<int64_t>({8, 9, 0, 1}));
}

TEST(GlobalOrderTest, Errors) {
  EXPECT_THAT(GlobalOrder::Create({10, 0, 0, true, true, true}).status().message(),
              HasSubstr("global batch size 0"));
  EXPECT_THAT(GlobalOrder::Create({10, 16, 0, true, true, true}).status().message(),
              HasSubstr("larger than the dataset (10 examples)"));
}

TEST(InputPipelineTest, TheGlobalBatchOfAStepIsTheSameOnEveryMesh) {
  auto ds = Open(MakeDataset("same_on_every_mesh", 100));
  ASSERT_NE(ds, nullptr);
  // One worker: the block is the whole global batch.
  auto one = *InputPipeline::Create(
      ds, Options("data=1", 0, 16, 1, PartitionSpec::Of({"data"}), PartitionSpec::Of({"data"})));
  for (int n : {2, 4, 8}) {
    for (int64_t step : {0, 5, 6, 13}) {  // 6 per epoch: 13 is in the third epoch
      std::vector<int32_t> assembled;
      for (int r = 0; r < n; ++r) {
        auto p = *InputPipeline::Create(
            ds, Options(absl::StrCat("data=", n), r, 16, 1, PartitionSpec::Of({"data"}),
                        PartitionSpec::Of({"data"})));
        std::vector<Tensor> b = *p->Next(step);
        ASSERT_EQ(b[1].dims(), Dims({16 / n}));
        for (int32_t id : Ids(b[1])) assembled.push_back(id);
        // x's rows are the same examples' features.
        for (int64_t i = 0; i < 16 / n; ++i)
          EXPECT_EQ(b[0].data<float>()[i * 6 + 2], 100.0f * b[1].data<int32_t>()[i] + 2);
      }
      EXPECT_EQ(assembled, Ids((*one->Next(step))[1])) << n << " workers, step " << step;
    }
  }
}

TEST(InputPipelineTest, MinibatchesAndReplicasAndShardedFeatures) {
  auto ds = Open(MakeDataset("minibatches", 64));
  ASSERT_NE(ds, nullptr);
  // Global batch 8 in 2 minibatches of 4, rows over 'data' (2), features over 'model' (2).
  auto global =
      *InputPipeline::Create(ds, Options("data=1", 0, 8, 2, PartitionSpec(), PartitionSpec()));
  std::vector<Tensor> g = *global->Next(3);
  ASSERT_EQ(g[0].dims(), Dims({2, 4, 6}));
  for (int rank = 0; rank < 4; ++rank) {
    auto p = *InputPipeline::Create(
        ds, Options("data=2,model=2", rank, 8, 2, PartitionSpec::Of({"", "data", "model"}),
                    PartitionSpec::Of({"", "data"})));
    std::vector<Tensor> b = *p->Next(3);
    ASSERT_EQ(b[0].dims(), Dims({2, 2, 3}));
    ASSERT_EQ(b[1].dims(), Dims({2, 2}));
    const int d = rank / 2, m = rank % 2;
    for (int mb = 0; mb < 2; ++mb) {
      for (int i = 0; i < 2; ++i) {
        const int row = d * 2 + i;
        EXPECT_EQ(b[1].data<int32_t>()[mb * 2 + i], g[1].data<int32_t>()[mb * 4 + row]);
        for (int j = 0; j < 3; ++j) {
          EXPECT_EQ(b[0].data<float>()[(mb * 2 + i) * 3 + j],
                    g[0].data<float>()[(mb * 4 + row) * 6 + m * 3 + j]);
        }
      }
    }
    // Only the block's bytes are read: 12 floats and 4 ints.
    EXPECT_EQ(p->bytes_read(), 12 * 4 + 4 * 4);
  }
}

TEST(InputPipelineTest, PrefetchedAndJumpedStepsEqualDirectOnes) {
  auto ds = Open(MakeDataset("prefetch", 50));
  ASSERT_NE(ds, nullptr);
  InputPipelineOptions direct_options =
      Options("data=2", 1, 10, 1, PartitionSpec::Of({"data"}), PartitionSpec::Of({"data"}));
  direct_options.prefetch = 0;
  auto direct = *InputPipeline::Create(ds, direct_options);
  auto prefetched = *InputPipeline::Create(
      ds, Options("data=2", 1, 10, 1, PartitionSpec::Of({"data"}), PartitionSpec::Of({"data"})));
  for (int64_t step : {0, 1, 2, 3, 9, 10, 11, 4, 5, 30}) {
    EXPECT_EQ(Ids((*prefetched->Next(step))[1]), Ids((*direct->Next(step))[1])) << step;
  }
}

TEST(InputPipelineTest, OnePassPadsTheLastBatchAndMarksItInvalid) {
  auto ds = Open(MakeDataset("one_pass", 10));
  ASSERT_NE(ds, nullptr);
  InputPipelineOptions o =
      Options("data=2", 1, 4, 1, PartitionSpec::Of({"data"}), PartitionSpec::Of({"data"}));
  o.order.shuffle = false;
  o.order.drop_remainder = false;
  o.order.repeat = false;
  o.fields.push_back({":valid", v1::DTYPE_F32, {4}, PartitionSpec::Of({"data"})});
  auto p = *InputPipeline::Create(ds, o);
  EXPECT_EQ(p->num_steps(), 3);
  std::vector<Tensor> last = *p->Next(2);                 // examples 8, 9 then two padding rows
  EXPECT_EQ(Ids(last[1]), std::vector<int32_t>({0, 0}));  // rank 1 holds rows 2, 3: padding
  EXPECT_EQ(last[2].data<float>()[0], 0.0f);
  EXPECT_EQ(last[2].data<float>()[1], 0.0f);
  std::vector<Tensor> first = *p->Next(0);
  EXPECT_EQ(Ids(first[1]), std::vector<int32_t>({2, 3}));
  EXPECT_EQ(first[2].data<float>()[0], 1.0f);
  EXPECT_EQ(p->Next(3).status().code(), absl::StatusCode::kOutOfRange);
}

TEST(InputPipelineTest, BadFieldsAndLayoutsNameTheValue) {
  auto ds = Open(MakeDataset("bad_fields", 32));
  ASSERT_NE(ds, nullptr);
  auto o = Options("data=4", 0, 8, 1, PartitionSpec::Of({"data"}), PartitionSpec::Of({"data"}));
  o.fields[0].field = "image";
  EXPECT_THAT(InputPipeline::Create(ds, o).status().message(),
              HasSubstr("dataset has no field 'image'; its fields are x, y"));
  o = Options("data=4", 0, 8, 1, PartitionSpec::Of({"data"}), PartitionSpec::Of({"data"}));
  o.fields[1].dtype = v1::DTYPE_F32;
  EXPECT_THAT(InputPipeline::Create(ds, o).status().message(),
              HasSubstr("takes f32 but the dataset holds i32"));
  o = Options("data=4", 0, 8, 1, PartitionSpec::Of({"data"}), PartitionSpec::Of({"data"}));
  o.fields[0].global_shape = {8, 5};  // the batch right, the examples not
  EXPECT_THAT(InputPipeline::Create(ds, o).status().message(),
              HasSubstr("the dataset's examples have shape [6] but the program takes [5] per "
                        "example (its input is [8, 5], a global batch of 8)"));
  o.fields[0].global_shape = {4, 6};  // the batch wrong
  EXPECT_THAT(InputPipeline::Create(ds, o).status().message(),
              HasSubstr("has shape [4, 6]; expected [8] (global batch 8) followed by the field's "
                        "example shape [6]"));
  // A global batch of 6 does not divide over 4 workers along 'data'.
  o = Options("data=4", 0, 6, 1, PartitionSpec::Of({"data"}), PartitionSpec::Of({"data"}));
  absl::Status s = InputPipeline::Create(ds, o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("field 'x'"));
  EXPECT_THAT(s.message(), HasSubstr("6"));
}

TEST(DatasetTest, BadNpyFilesNameTheFile) {
  const std::string dir = ::testing::TempDir() + "/bad_npy";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  EXPECT_EQ(Dataset::Open("npy", dir + "/missing", "").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_THAT(Dataset::Open("npy", dir, "").status().message(), HasSubstr("holds no .npy files"));
  std::vector<float> v(40);
  WriteNpy(dir + "/a.npy", "<f4", {10, 4}, v.data(), 160);
  WriteNpy(dir + "/b.npy", "<f4", {8, 4}, v.data(), 128);
  EXPECT_THAT(Dataset::Open("npy", dir, "").status().message(),
              HasSubstr("field 'b' has 8 examples but field 'a' has 10"));
  std::filesystem::remove(dir + "/b.npy");
  WriteNpy(dir + "/b.npy", "<f4", {10, 4}, v.data(), 100);  // truncated
  absl::Status s = Dataset::Open("npy", dir, "").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("b.npy: truncated"));
  WriteNpy(dir + "/b.npy", "<f8", {10, 2}, v.data(), 160);
  EXPECT_THAT(Dataset::Open("npy", dir, "").status().message(),
              HasSubstr("npy dtype '<f8' is not supported"));
  WriteNpy(dir + "/b.npy", "<f4", {10, 4}, v.data(), 160, /*fortran=*/true);
  EXPECT_THAT(Dataset::Open("npy", dir, "").status().message(), HasSubstr("Fortran-ordered"));
  std::ofstream(dir + "/b.npy") << "not numpy";
  EXPECT_THAT(Dataset::Open("npy", dir, "").status().message(), HasSubstr("bad magic"));
  EXPECT_THAT(Dataset::Open("csv", dir, "").status().message(),
              HasSubstr("format 'csv': expected idx or npy"));
}

TEST(DatasetTest, IdxFashionMnistFieldsFedFlattened) {
  absl::StatusOr<std::unique_ptr<Dataset>> ds =
      Dataset::Open("idx", "/usr/share/datasets/fashion-mnist", "test");
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ((*ds)->num_examples(), 10000);
  ASSERT_EQ((*ds)->fields().size(), 2u);
  EXPECT_EQ((*ds)->fields()[0].example_dims, Dims({28, 28}));
  InputPipelineOptions o;
  o.mesh = *Mesh::Parse("data=1");
  o.fields = {{"image", v1::DTYPE_U8, {100, 784}, PartitionSpec()},
              {"label", v1::DTYPE_U8, {100}, PartitionSpec()}};
  o.order = {0, 100, 0, /*shuffle=*/false, true, false};
  auto p = *InputPipeline::Create(std::shared_ptr<const Dataset>(*std::move(ds)), o);
  std::vector<Tensor> b = *p->Next(0);
  // The first t10k labels are 9 (ankle boot) and 2 (pullover).
  EXPECT_EQ(b[1].data<uint8_t>()[0], 9);
  EXPECT_EQ(b[1].data<uint8_t>()[1], 2);
  EXPECT_EQ(Dataset::Open("idx", "/usr/share/datasets/fashion-mnist", "val").status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace meshrun
