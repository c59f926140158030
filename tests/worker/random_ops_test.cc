// JAX's PRNG ops on a worker: a device's block of a global draw equals that block of the whole
// draw, whatever the layout, and bitcasts keep bits.
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/random/threefry.h"
#include "core/sharding/mesh.h"
#include "gtest/gtest.h"
#include "worker/executor.h"

namespace meshrun {
namespace {

// A program drawing u32 `out` = jax.random.bits(key, global) with `fn`, laid out as `spec`
// (text proto entries) over `out_dims` (the block).
v1::StepProgram DrawProgram(const std::string& fn, const std::vector<int64_t>& global,
                            const std::string& spec, const std::vector<int64_t>& out_dims) {
  v1::StepProgram p;
  auto* key = p.add_buffers();
  key->set_name("key");
  key->set_dtype(v1::DTYPE_U32);
  key->mutable_shape()->add_dims(2);
  auto* out = p.add_buffers();
  out->set_name("out");
  out->set_dtype(v1::DTYPE_U32);
  for (int64_t d : out_dims) out->mutable_shape()->add_dims(d);
  auto* op = p.add_functions()->add_ops();
  p.mutable_functions(0)->set_name("main");
  op->set_kind(v1::OP_RANDOM_BITS);
  op->set_fn(fn);
  op->add_inputs("key");
  op->add_outputs("out");
  if (!spec.empty() || !global.empty()) {
    for (int64_t d : global) op->add_dims(d);
    for (const char c : spec)
      op->mutable_spec()->add_entries()->add_axis_names(c == 'd'   ? "data"
                                                        : c == 'm' ? "model"
                                                                   : "");
    for (auto& e : *op->mutable_spec()->mutable_entries())
      if (e.axis_names(0).empty()) e.clear_axis_names();
  }
  return p;
}

std::vector<uint32_t> Draw(const v1::StepProgram& p, const Mesh* mesh, int rank) {
  Executor::Options o;
  o.mesh = mesh;
  o.rank = rank;
  absl::StatusOr<std::unique_ptr<Executor>> ex = Executor::Create(p, o);
  EXPECT_TRUE(ex.ok()) << ex.status();
  if (!ex.ok()) return {};
  Tensor key(v1::DTYPE_U32, {2});
  key.data<uint32_t>()[0] = 0;
  key.data<uint32_t>()[1] = 42;
  EXPECT_TRUE((*ex)->BindInput("key", key).ok());
  EXPECT_TRUE((*ex)->Run("main", RunContext{}).ok());
  const Tensor* out = (*ex)->buffer("out");
  return std::vector<uint32_t>(out->data<uint32_t>(), out->data<uint32_t>() + out->num_elements());
}

// On a data=2,model=2 mesh, [R, C] laid out (data, model): rank r holds rows R/2 (r / 2) .. + R/2,
// columns C/2 (r % 2) .. + C/2 of the whole draw, for each fn; [4, 6], and [6, 70], whose rows
// are longer than a vector's lanes.
TEST(RandomOpsTest, EachDeviceDrawsItsBlockOfTheWholeDraw) {
  absl::StatusOr<Mesh> mesh = Mesh::Parse("data=2,model=2");
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{4, 6}, {6, 70}}) {
    const int64_t h = rows / 2, w = cols / 2;
    for (const std::string fn : {"partitionable", "legacy"}) {
      const std::vector<uint32_t> whole = Draw(DrawProgram(fn, {}, "", {rows, cols}), nullptr, 0);
      ASSERT_EQ(whole.size(), static_cast<size_t>(rows * cols));
      for (int r = 0; r < 4; ++r) {
        const std::vector<uint32_t> block =
            Draw(DrawProgram(fn, {rows, cols}, "dm", {h, w}), &*mesh, r);
        ASSERT_EQ(block.size(), static_cast<size_t>(h * w));
        for (int64_t i = 0; i < h; ++i)
          for (int64_t j = 0; j < w; ++j)
            ASSERT_EQ(block[i * w + j], whole[(h * (r / 2) + i) * cols + w * (r % 2) + j])
                << fn << " [" << rows << ", " << cols << "] rank " << r << " (" << i << ", " << j
                << ")";
      }
    }
  }
  // Partitionable bits are JAX's: jax.random.bits(PRNGKey(42), (2, 3)).
  const std::vector<uint32_t> jax = Draw(DrawProgram("partitionable", {}, "", {2, 3}), nullptr, 0);
  EXPECT_EQ(jax, (std::vector<uint32_t>{2098992034u, 2919706841u, 2646866425u, 2409546199u,
                                        1935504149u, 2516274904u}));
  // split: jax.random.split(PRNGKey(42), 3), the keys over `model` (rank 1 holds none of row 0).
  const std::vector<uint32_t> split = Draw(DrawProgram("split", {}, "", {3, 2}), nullptr, 0);
  EXPECT_EQ(split, (std::vector<uint32_t>{1832780943u, 270669613u, 64467757u, 2916123636u,
                                          2465931498u, 255383827u}));
}

TEST(RandomOpsTest, ABlockThatIsNotTheLayoutsOrAnUnknownFnIsRefused) {
  absl::StatusOr<Mesh> mesh = Mesh::Parse("data=2,model=2");
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  Executor::Options o;
  o.mesh = &*mesh;
  absl::StatusOr<std::unique_ptr<Executor>> wrong =
      Executor::Create(DrawProgram("partitionable", {4, 6}, "dm", {4, 3}), o);
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(std::string(wrong.status().message()).find("u32[2, 3]"), std::string::npos)
      << wrong.status();
  absl::StatusOr<std::unique_ptr<Executor>> unknown =
      Executor::Create(DrawProgram("philox", {}, "", {4, 3}), o);
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(std::string(unknown.status().message()).find("philox"), std::string::npos);
  absl::StatusOr<std::unique_ptr<Executor>> odd =
      Executor::Create(DrawProgram("split", {}, "", {4, 3}), o);
  EXPECT_FALSE(odd.ok()) << "a split's shape ends in 2";
}

v1::BufferDecl* AddBuffer(v1::StepProgram& p, const std::string& name, v1::DType dtype,
                          const std::vector<int64_t>& dims) {
  v1::BufferDecl* b = p.add_buffers();
  b->set_name(name);
  b->set_dtype(dtype);
  for (int64_t d : dims) b->mutable_shape()->add_dims(d);
  return b;
}

Tensor Words(const std::vector<int64_t>& dims, uint32_t first, uint32_t step) {
  Tensor t(v1::DTYPE_U32, dims);
  for (int64_t i = 0; i < t.num_elements(); ++i)
    t.data<uint32_t>()[i] = first + static_cast<uint32_t>(i) * step;
  return t;
}

// flax's Dropout mask and jax's threefry2x32 primitive, element by element, over a count that is
// no multiple of a vector's lanes, with a scalar operand broadcast beside full ones.
TEST(RandomOpsTest, ADropoutMaskAndAThreefryOpGiveEachElementItsOwnWord) {
  constexpr int64_t kRows = 3, kCols = 37, kN = kRows * kCols;
  v1::StepProgram p;
  p.add_functions()->set_name("main");
  AddBuffer(p, "key", v1::DTYPE_U32, {2});
  AddBuffer(p, "mask", v1::DTYPE_F32, {kRows, kCols});
  AddBuffer(p, "k0", v1::DTYPE_U32, {});
  for (const char* name : {"k1", "c0", "c1", "y"}) AddBuffer(p, name, v1::DTYPE_U32, {kN});
  v1::Op* dropout = p.mutable_functions(0)->add_ops();
  dropout->set_kind(v1::OP_DROPOUT_MASK);
  dropout->set_rate(0.3f);
  dropout->add_inputs("key");
  dropout->add_outputs("mask");
  v1::Op* threefry = p.mutable_functions(0)->add_ops();
  threefry->set_kind(v1::OP_THREEFRY2X32);
  threefry->set_dim(1);
  for (const char* name : {"k0", "k1", "c0", "c1"}) threefry->add_inputs(name);
  threefry->add_outputs("y");
  absl::StatusOr<std::unique_ptr<Executor>> ex = Executor::Create(p, Executor::Options{});
  ASSERT_TRUE(ex.ok()) << ex.status();
  const std::map<std::string, Tensor> args = {
      {"key", Words({2}, 0, 42)}, {"k0", Words({}, 7, 0)},          {"k1", Words({kN}, 11, 977)},
      {"c0", Words({kN}, 0, 1)},  {"c1", Words({kN}, 1u << 31, 3)},
  };
  for (const auto& [name, t] : args) ASSERT_TRUE((*ex)->BindInput(name, t).ok()) << name;
  for (int run = 0; run < 2; ++run) {  // the second run reuses the op's buffers
    ASSERT_TRUE((*ex)->Run("main", RunContext{}).ok());
    const std::vector<uint32_t> bits = RandomBits(MakePRNGKey(42), kN);
    const float* mask = (*ex)->buffer("mask")->data<float>();
    const uint32_t* y = (*ex)->buffer("y")->data<uint32_t>();
    int64_t dropped = 0;
    for (int64_t i = 0; i < kN; ++i) {
      const float want = BitsToUnitFloat(bits[i]) < 0.7f ? 1.0f / 0.7f : 0.0f;
      ASSERT_EQ(mask[i], want) << "mask element " << i;
      dropped += want == 0.0f;
      const uint32_t word =
          Threefry2x32({7, 11 + static_cast<uint32_t>(i) * 977}, static_cast<uint32_t>(i),
                       (1u << 31) + static_cast<uint32_t>(i) * 3)[1];
      ASSERT_EQ(y[i], word) << "threefry element " << i;
    }
    EXPECT_GT(dropped, 0);
    EXPECT_LT(dropped, kN);
  }
}

}  // namespace
}  // namespace meshrun
