// JAX's PRNG ops on a worker: a device's block of a global draw equals that block of the whole
// draw, whatever the layout, and bitcasts keep bits.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
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

// On a data=2,model=2 mesh, [4, 6] laid out (data, model): rank r holds rows 2 (r / 2) .. + 2,
// columns 3 (r % 2) .. + 3 of the whole draw, for each fn.
TEST(RandomOpsTest, EachDeviceDrawsItsBlockOfTheWholeDraw) {
  absl::StatusOr<Mesh> mesh = Mesh::Parse("data=2,model=2");
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  for (const std::string fn : {"partitionable", "legacy"}) {
    const std::vector<uint32_t> whole = Draw(DrawProgram(fn, {}, "", {4, 6}), nullptr, 0);
    ASSERT_EQ(whole.size(), 24u);
    for (int r = 0; r < 4; ++r) {
      const std::vector<uint32_t> block = Draw(DrawProgram(fn, {4, 6}, "dm", {2, 3}), &*mesh, r);
      ASSERT_EQ(block.size(), 6u);
      for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 3; ++j)
          EXPECT_EQ(block[i * 3 + j], whole[(2 * (r / 2) + i) * 6 + 3 * (r % 2) + j])
              << fn << " rank " << r << " (" << i << ", " << j << ")";
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

}  // namespace
}  // namespace meshrun
