// The data-movement kernels (transpose, slice, broadcast) against an element-by-element
// reference, over every permutation of a 3-D array and slices and broadcasts of every kind of
// dim, in f32 and bf16 (4- and 2-byte elements).
#include "core/array_ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "gtest/gtest.h"

namespace meshrun {
namespace {

Tensor Iota(DType dtype, const Dims& dims) {
  Tensor t(dtype, dims);
  for (int64_t i = 0; i < t.num_elements(); ++i) SetFromDouble(t, i, static_cast<double>(i % 251));
  return t;
}

// Row-major coordinates of flat index i.
std::vector<int64_t> Coords(int64_t i, const Dims& dims) {
  std::vector<int64_t> c(dims.size());
  for (int d = static_cast<int>(dims.size()) - 1; d >= 0; --d) {
    c[d] = i % dims[d];
    i /= dims[d];
  }
  return c;
}

int64_t Flat(const std::vector<int64_t>& c, const Dims& dims) {
  int64_t f = 0;
  for (size_t d = 0; d < dims.size(); ++d) f = f * dims[d] + c[d];
  return f;
}

// Transposes an iota of `dims` by every permutation and checks each element against the
// reference: out[c] = x[c permuted back].
void ExpectEveryTransposeMatches(DType dtype, const Dims& dims) {
  const Tensor x = Iota(dtype, dims);
  const size_t rank = dims.size();
  std::vector<int64_t> perm(rank);
  std::iota(perm.begin(), perm.end(), 0);
  do {
    Dims out_dims;
    for (int64_t p : perm) out_dims.push_back(dims[p]);
    Tensor out(dtype, out_dims);
    Transpose(x, perm, out);
    for (int64_t i = 0; i < out.num_elements(); ++i) {
      const std::vector<int64_t> oc = Coords(i, out_dims);
      std::vector<int64_t> xc(rank);
      for (size_t d = 0; d < rank; ++d) xc[perm[d]] = oc[d];
      ASSERT_EQ(GetAsDouble(out, i), GetAsDouble(x, Flat(xc, dims)))
          << "perm " << ::testing::PrintToString(perm) << " element " << i;
    }
  } while (std::next_permutation(perm.begin(), perm.end()));
}

TEST(ArrayOpsTest, TransposeMatchesTheReferenceForEveryPermutation) {
  for (DType dtype : {v1::DTYPE_F32, v1::DTYPE_BF16}) {
    ExpectEveryTransposeMatches(dtype, {5, 37, 70});  // not multiples of the 32-element tiles
  }
}

// jax.lax.rev over every subset of a 3-D array's dims, in f32, bf16 and u8 (4-, 2- and 1-byte
// elements): out[c] = x[c with each reversed coordinate k replaced by size - 1 - k].
TEST(ArrayOpsTest, ReverseMatchesTheReferenceForEverySetOfDims) {
  for (DType dtype : {v1::DTYPE_F32, v1::DTYPE_BF16, v1::DTYPE_U8}) {
    const Dims dims = {3, 1, 7};
    const Tensor x = Iota(dtype, dims);
    for (int mask = 0; mask < 8; ++mask) {
      std::vector<int64_t> rev;
      for (int64_t d = 0; d < 3; ++d)
        if (mask & (1 << d)) rev.push_back(d);
      Tensor out(dtype, dims);
      Reverse(x, rev, out);
      for (int64_t i = 0; i < out.num_elements(); ++i) {
        std::vector<int64_t> c = Coords(i, dims);
        for (int64_t d : rev) c[d] = dims[d] - 1 - c[d];
        ASSERT_EQ(GetAsDouble(out, i), GetAsDouble(x, Flat(c, dims)))
            << "mask " << mask << " element " << i;
      }
    }
  }
  Tensor empty(v1::DTYPE_F32, {0, 4}), out(v1::DTYPE_F32, {0, 4});
  Reverse(empty, {0, 1}, out);  // nothing to move, nothing read
}

// dynamic_update_slice's copy: the block at `starts` is the update's, the rest x's, in f32 and
// bf16 (4- and 2-byte elements), and for a scalar.
// f32 -> i32 / u32 / u8 as XLA converts (jnp.astype): truncated toward zero, saturated at the
// integer's range, NaN to 0 (a plain C++ cast is undefined there; x86 gives INT_MIN).
TEST(ArrayOpsTest, FloatToIntegerConversionTruncatesAndSaturatesAsXla) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> in = {std::nanf(""), inf,   -inf, 3e9f,  -3e9f,
                                 5e9f,          -1.0f, 4.7f, -4.7f, 300.0f};
  Tensor x(v1::DTYPE_F32, {static_cast<int64_t>(in.size())});
  std::copy(in.begin(), in.end(), x.data<float>());
  Tensor i(v1::DTYPE_I32, x.dims()), u(v1::DTYPE_U32, x.dims()), b(v1::DTYPE_U8, x.dims());
  Convert(x, i);
  Convert(x, u);
  Convert(x, b);
  const int32_t kMax = std::numeric_limits<int32_t>::max(),
                kMin = std::numeric_limits<int32_t>::min();
  const std::vector<int32_t> want_i = {0, kMax, kMin, kMax, kMin, kMax, -1, 4, -4, 300};
  const std::vector<uint32_t> want_u = {0,           4294967295u, 0, 3000000000u, 0,
                                        4294967295u, 0,           4, 0,           300};
  const std::vector<uint8_t> want_b = {0, 255, 0, 255, 0, 255, 0, 4, 0, 255};
  for (size_t k = 0; k < in.size(); ++k) {
    EXPECT_EQ(i.data<int32_t>()[k], want_i[k]) << in[k];
    EXPECT_EQ(u.data<uint32_t>()[k], want_u[k]) << in[k];
    EXPECT_EQ(b.data<uint8_t>()[k], want_b[k]) << in[k];
  }
}

// Integer to integer as XLA converts: modulo 2^bits, either way between i32 and u32, and to u8.
TEST(ArrayOpsTest, IntegerConversionsWrapModuloTheirWidth) {
  Tensor u(v1::DTYPE_U32, {4}), i(v1::DTYPE_I32, {4}), back(v1::DTYPE_U32, {4}),
      b(v1::DTYPE_U8, {4});
  const uint32_t uv[] = {4294967289u, 2147483648u, 7u, 300u};
  std::copy(uv, uv + 4, u.data<uint32_t>());
  Convert(u, i);
  Convert(i, back);
  Convert(i, b);
  const int32_t want_i[] = {-7, std::numeric_limits<int32_t>::min(), 7, 300};
  const uint8_t want_b[] = {249, 0, 7, 44};
  for (int k = 0; k < 4; ++k) {
    EXPECT_EQ(i.data<int32_t>()[k], want_i[k]) << uv[k];
    EXPECT_EQ(back.data<uint32_t>()[k], uv[k]);
    EXPECT_EQ(b.data<uint8_t>()[k], want_b[k]) << uv[k];
  }
}

TEST(ArrayOpsTest, UpdateSliceWritesTheBlockAndKeepsTheRest) {
  const Dims dims = {4, 6, 5};
  for (DType dtype : {v1::DTYPE_F32, v1::DTYPE_BF16}) {
    for (const auto& [starts, sizes] : std::vector<std::pair<std::vector<int64_t>, Dims>>{
             {{1, 0, 0}, {1, 6, 5}}, {{0, 2, 1}, {4, 3, 3}}, {{3, 5, 4}, {1, 1, 1}}}) {
      Tensor out = Iota(dtype, dims);
      Tensor update(dtype, sizes);
      for (int64_t i = 0; i < update.num_elements(); ++i) SetFromDouble(update, i, -1.0 - i);
      UpdateSlice(update, starts, out);
      for (int64_t i = 0; i < out.num_elements(); ++i) {
        const std::vector<int64_t> c = Coords(i, dims);
        bool inside = true;
        std::vector<int64_t> in(c.size());
        for (size_t d = 0; d < c.size(); ++d) {
          in[d] = c[d] - starts[d];
          inside = inside && in[d] >= 0 && in[d] < sizes[d];
        }
        const double want = inside ? -1.0 - Flat(in, sizes) : static_cast<double>(i % 251);
        ASSERT_EQ(GetAsDouble(out, i), want) << "element " << i;
      }
    }
  }
  Tensor scalar(v1::DTYPE_F32, {}), one(v1::DTYPE_F32, {});
  one.data<float>()[0] = 7.0f;
  UpdateSlice(one, {}, scalar);
  EXPECT_EQ(scalar.data<float>()[0], 7.0f);
}

TEST(ArrayOpsTest, SliceAndBroadcastMatchTheReference) {
  const Dims dims = {4, 6, 33};
  const Tensor x = Iota(v1::DTYPE_F32, dims);
  for (const auto& [starts, sizes] : std::vector<std::pair<std::vector<int64_t>, Dims>>{
           {{1, 0, 0}, {1, 6, 33}},  // one row of a stacked array: one contiguous run
           {{0, 2, 5}, {4, 3, 20}},  // a block inside every dim
           {{3, 5, 32}, {1, 1, 1}}}) {
    Tensor out(v1::DTYPE_F32, sizes);
    Slice(x, starts, out);
    for (int64_t i = 0; i < out.num_elements(); ++i) {
      std::vector<int64_t> c = Coords(i, sizes);
      for (size_t d = 0; d < c.size(); ++d) c[d] += starts[d];
      ASSERT_EQ(out.data<float>()[i], x.data<float>()[Flat(c, dims)]) << "element " << i;
    }
  }
  // (bf16 and i32 too: each element width's copy, a fill along a broadcast last dim among them)
  for (const DType dtype : {v1::DTYPE_F32, v1::DTYPE_BF16, v1::DTYPE_I32}) {
    for (const Dims& from : std::vector<Dims>{{1, 6, 33}, {4, 1, 33}, {4, 6, 1}, {1, 1, 1}}) {
      const Tensor small = Iota(dtype, from);
      Tensor out(dtype, dims);
      Broadcast(small, out);
      for (int64_t i = 0; i < out.num_elements(); ++i) {
        std::vector<int64_t> c = Coords(i, dims);
        for (size_t d = 0; d < c.size(); ++d) c[d] = from[d] == 1 ? 0 : c[d];
        ASSERT_EQ(GetAsDouble(out, i), GetAsDouble(small, Flat(c, from)))
            << DTypeName(dtype) << DimsToString(from) << " element " << i;
      }
    }
  }
}

// Dims of size 1 and dims that walk the source as one are merged before copying (a channel-last
// image with one channel is copied in rows, not element by element): every permutation of a 4-D
// array with a unit dim, slices of it, and concatenations along short and long trailing rows,
// in f32 and bf16.
TEST(ArrayOpsTest, CopiesWithUnitAndMergeableDimsMatchTheReference) {
  for (DType dtype : {v1::DTYPE_F32, v1::DTYPE_BF16}) {
    ExpectEveryTransposeMatches(dtype, {3, 5, 1, 7});
    const Dims image = {2, 6, 5, 1};  // [n, h, w, c]: a window's slice keeps rows of w
    const Tensor img = Iota(dtype, image);
    Tensor cut(dtype, {2, 4, 3, 1});
    Slice(img, {0, 1, 2, 0}, cut);
    for (int64_t i = 0; i < cut.num_elements(); ++i) {
      std::vector<int64_t> c = Coords(i, cut.dims());
      c[1] += 1;
      c[2] += 2;
      ASSERT_EQ(GetAsDouble(cut, i), GetAsDouble(img, Flat(c, image))) << "element " << i;
    }
    for (int64_t wide : {1, 3, 40}) {  // rows of 1, 3 and 40 elements beside rows of 2
      const Tensor a = Iota(dtype, {4, 3, wide});
      Tensor b(dtype, {4, 3, 2});
      for (int64_t i = 0; i < b.num_elements(); ++i) SetFromDouble(b, i, 1000.0 + i);
      Tensor out(dtype, {4, 3, wide + 2});
      Concatenate({&a, &b}, 2, out);
      for (int64_t i = 0; i < out.num_elements(); ++i) {
        const std::vector<int64_t> c = Coords(i, out.dims());
        const double want = c[2] < wide ? GetAsDouble(a, (c[0] * 3 + c[1]) * wide + c[2])
                                        : GetAsDouble(b, (c[0] * 3 + c[1]) * 2 + c[2] - wide);
        ASSERT_EQ(GetAsDouble(out, i), want) << "wide " << wide << " element " << i;
      }
    }
  }
}

// FillFromDouble sets exactly its run, to what SetFromDouble stores, in each element width:
// runs of 0, 1, a power of two and not, at the start, the middle and the end.
TEST(ArrayOpsTest, FillFromDoubleSetsItsRunAndNothingElse) {
  for (const DType dtype : {v1::DTYPE_F32, v1::DTYPE_BF16, v1::DTYPE_I32, v1::DTYPE_U8}) {
    for (const auto& [begin, count] : std::vector<std::pair<int64_t, int64_t>>{
             {0, 0}, {0, 1}, {3, 16}, {5, 37}, {0, 100}, {61, 39}}) {
      Tensor x = Iota(dtype, {100});
      Tensor one(dtype, {1});
      SetFromDouble(one, 0, 7.25);
      FillFromDouble(x, begin, count, 7.25);
      for (int64_t i = 0; i < 100; ++i) {
        const bool inside = i >= begin && i < begin + count;
        ASSERT_EQ(GetAsDouble(x, i), inside ? GetAsDouble(one, 0) : static_cast<double>(i))
            << DTypeName(dtype) << " run " << begin << "+" << count << " element " << i;
      }
    }
  }
}

}  // namespace
}  // namespace meshrun
