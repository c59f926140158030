// The matmul, softmax cross-entropy, convert, silu and reduce kernels: forwards against their
// definitions, backwards against central finite differences of the forward.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "core/array_ops.h"
#include "core/collectives/reduce_kernels.h"
#include "core/float_ops.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/worker/random_tensor.h"
#include "worker/kernels/kernel.h"

namespace meshrun {
namespace {

using testing::Random;

double Dot(const Tensor& a, const Tensor& b) {
  double s = 0;
  for (int64_t i = 0; i < a.num_elements(); ++i)
    s += double{a.data<float>()[i]} * b.data<float>()[i];
  return s;
}

// Checks d(loss)/d(x) == grad for loss = fn() by central differences, perturbing each element.
void ExpectGradient(Tensor& x, const Tensor& grad, const std::function<double()>& loss,
                    double tol = 2e-2) {
  ASSERT_EQ(x.num_elements(), grad.num_elements());
  const float eps = 1e-2f;
  for (int64_t i = 0; i < x.num_elements(); ++i) {
    float& v = x.data<float>()[i];
    const float saved = v;
    v = saved + eps;
    const double up = loss();
    v = saved - eps;
    const double down = loss();
    v = saved;
    const double numeric = (up - down) / (2 * eps);
    const double analytic = grad.data<float>()[i];
    ASSERT_NEAR(analytic, numeric, tol * std::max(1.0, std::abs(numeric))) << "element " << i;
  }
}

TEST(MatmulKernelTest, ForwardMatchesNaiveProduct) {
  Tensor a = Random({3, 4}, 1), b = Random({4, 5}, 2), bias = Random({5}, 3),
         c(v1::DTYPE_F32, {3, 5});
  auto k = CreateMatmul(a, b, &bias, c);
  ASSERT_TRUE(k.ok()) << k.status();
  ASSERT_TRUE((*k)->Run().ok());
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 5; ++j) {
      double s = bias.data<float>()[j];
      for (int p = 0; p < 4; ++p) s += a.data<float>()[i * 4 + p] * b.data<float>()[p * 5 + j];
      EXPECT_NEAR(c.data<float>()[i * 5 + j], s, 1e-4);
    }
  }
}

TEST(MatmulKernelTest, BackwardMatchesFiniteDifferences) {
  Tensor a = Random({3, 4}, 1), b = Random({4, 5}, 2), bias = Random({5}, 3),
         c(v1::DTYPE_F32, {3, 5});
  Tensor r = Random({3, 5}, 4);  // loss = sum(c * r), so dC = r
  auto fwd = CreateMatmul(a, b, &bias, c);
  ASSERT_TRUE(fwd.ok());
  auto loss = [&] {
    EXPECT_TRUE((*fwd)->Run().ok());
    return Dot(c, r);
  };
  Tensor da(v1::DTYPE_F32, {3, 4}), db(v1::DTYPE_F32, {4, 5}), dbias(v1::DTYPE_F32, {5});
  auto k_da = CreateMatmul(r, b, nullptr, da, {.transpose_b = true});
  auto k_db = CreateMatmul(a, r, nullptr, db, {.transpose_a = true});
  Tensor ones(v1::DTYPE_F32, {1, 3});
  std::fill_n(ones.data<float>(), 3, 1.0f);
  Tensor dbias_row(v1::DTYPE_F32, {1, 5});  // the column sums of r, as ones @ r
  auto k_dbias = CreateMatmul(ones, r, nullptr, dbias_row);
  ASSERT_TRUE(k_da.ok() && k_db.ok() && k_dbias.ok());
  ASSERT_TRUE((*k_da)->Run().ok());
  ASSERT_TRUE((*k_db)->Run().ok());
  ASSERT_TRUE((*k_dbias)->Run().ok());
  std::memcpy(dbias.raw(), dbias_row.raw(), dbias.size_bytes());
  ExpectGradient(a, da, loss);
  ExpectGradient(b, db, loss);
  ExpectGradient(bias, dbias, loss);
}

TEST(MatmulKernelTest, RejectsMismatchedShapes) {
  Tensor a(v1::DTYPE_F32, {3, 4}), b(v1::DTYPE_F32, {5, 5}), c(v1::DTYPE_F32, {3, 5});
  auto k = CreateMatmul(a, b, nullptr, c);
  EXPECT_EQ(k.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(MatmulKernelTest, AlphaAndAccumulateAreGemmAlphaAndBeta) {
  // Gradient accumulation as the step program does it: g = g + (1/4) * x^T @ dy, twice.
  Tensor x = Random({6, 3}, 12), dy = Random({6, 2}, 13), g = Random({3, 2}, 14);
  Tensor g0 = g;
  auto k =
      CreateMatmul(x, dy, nullptr, g, {.transpose_a = true, .alpha = 0.25f, .accumulate = true});
  ASSERT_TRUE(k.ok()) << k.status();
  ASSERT_TRUE((*k)->Run().ok());
  ASSERT_TRUE((*k)->Run().ok());
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 2; ++j) {
      double s = 0;
      for (int r = 0; r < 6; ++r) s += x.data<float>()[r * 3 + i] * dy.data<float>()[r * 2 + j];
      EXPECT_NEAR(g.data<float>()[i * 2 + j], g0.data<float>()[i * 2 + j] + 2 * 0.25 * s, 1e-4);
    }
  }
}

// A bf16 GEMM (mixed precision): exactly the product of the bf16-rounded operands, accumulated in
// f32, for shapes that are and are not multiples of the vector width, with transposes, a bias and
// accumulation; its f32 result within bf16 rounding of the f32 GEMM's; a bf16 result rounded once.
TEST(MatmulKernelTest, Bf16OperandsMultiplyInF32) {
  struct Case {
    int64_t m, k, n;
    bool ta, tb, bias, accumulate;
  };
  for (const Case& c :
       {Case{3, 4, 5, false, false, true, false}, Case{17, 33, 19, true, false, false, true},
        Case{32, 64, 48, false, true, true, false}, Case{7, 130, 3, true, true, false, false}}) {
    SCOPED_TRACE(absl::StrCat(c.m, "x", c.k, "x", c.n, c.ta ? " ta" : "", c.tb ? " tb" : ""));
    const Tensor a = Random(c.ta ? Dims{c.k, c.m} : Dims{c.m, c.k}, 21);
    const Tensor b = Random(c.tb ? Dims{c.n, c.k} : Dims{c.k, c.n}, 22);
    const Tensor bias = Random({c.n}, 23), c0 = Random({c.m, c.n}, 24);
    Tensor a16 = Tensor::Uninitialized(v1::DTYPE_BF16, a.dims());
    Tensor b16 = Tensor::Uninitialized(v1::DTYPE_BF16, b.dims());
    Convert(a, a16);
    Convert(b, b16);
    Tensor ar(v1::DTYPE_F32, a.dims()), br(v1::DTYPE_F32, b.dims());  // the rounded operands
    Convert(a16, ar);
    Convert(b16, br);
    const MatmulOptions o{.transpose_a = c.ta, .transpose_b = c.tb, .accumulate = c.accumulate};
    const Tensor* bias_p = c.bias ? &bias : nullptr;
    Tensor got = c0, want = c0, full = c0;
    for (auto [x, y, out] : {std::tuple<const Tensor*, const Tensor*, Tensor*>{&a16, &b16, &got},
                             {&ar, &br, &want},
                             {&a, &b, &full}}) {
      auto k = CreateMatmul(*x, *y, bias_p, *out, o);
      ASSERT_TRUE(k.ok()) << k.status();
      ASSERT_TRUE((*k)->Run().ok());
    }
    for (int64_t i = 0; i < got.num_elements(); ++i) {
      const float w = want.data<float>()[i];
      EXPECT_NEAR(got.data<float>()[i], w, 1e-5f * (1 + std::abs(w)) * c.k) << "element " << i;
      // bf16 keeps 8 significant bits: each product is off by at most 2^-7 relative.
      const float f = full.data<float>()[i];
      EXPECT_NEAR(got.data<float>()[i], f, 0.02f * std::sqrt(static_cast<float>(c.k)) + 0.02f)
          << "element " << i;
    }
    if (c.accumulate) continue;
    Tensor got16 = Tensor::Uninitialized(v1::DTYPE_BF16, {c.m, c.n});
    auto k16 = CreateMatmul(a16, b16, bias_p, got16, o);
    ASSERT_TRUE(k16.ok()) << k16.status();
    ASSERT_TRUE((*k16)->Run().ok());
    Tensor back(v1::DTYPE_F32, {c.m, c.n});
    Convert(got16, back);
    for (int64_t i = 0; i < back.num_elements(); ++i) {
      const float g = got.data<float>()[i];
      EXPECT_NEAR(back.data<float>()[i], g, std::abs(g) / 256 + 1e-30f) << "element " << i;
    }
  }
  Tensor a16 = Tensor::Uninitialized(v1::DTYPE_BF16, {2, 3}), b(v1::DTYPE_F32, {3, 2}),
         out(v1::DTYPE_F32, {2, 2});
  auto mixed = CreateMatmul(a16, b, nullptr, out);
  EXPECT_EQ(mixed.status().code(), absl::StatusCode::kInvalidArgument);
  Tensor i32(v1::DTYPE_I32, {3, 2});
  auto ints = CreateMatmul(a16, i32, nullptr, out);
  EXPECT_EQ(ints.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(ints.status().message()).find("i32"), std::string::npos) << ints.status();
}

// The fused softmax cross-entropy against logsumexp(z) - z[label], and its VJP against finite
// differences of sum(loss * g), for shapes that are and are not multiples of the vector width and
// each label dtype; a label outside [0, c) is refused at run time, naming it.
TEST(SoftmaxCrossEntropyKernelTest, LossAndGradientMatchTheDefinition) {
  for (const auto& [rows, classes] : {std::pair<int64_t, int64_t>{5, 13}, {32, 16}, {3, 1}}) {
    for (const DType dtype : {v1::DTYPE_I32, v1::DTYPE_U8, v1::DTYPE_U32, v1::DTYPE_F32}) {
      SCOPED_TRACE(absl::StrCat(rows, "x", classes, " ", DTypeName(dtype)));
      Tensor z = Random({rows, classes}, 31, 3.0f), labels(dtype, {rows}),
             loss(v1::DTYPE_F32, {rows}), g = Random({rows}, 32),
             dz(v1::DTYPE_F32, {rows, classes});
      std::vector<int64_t> y(rows);
      for (int64_t r = 0; r < rows; ++r) {
        y[r] = (r * 7 + 3) % classes;
        if (dtype == v1::DTYPE_I32) labels.data<int32_t>()[r] = static_cast<int32_t>(y[r]);
        if (dtype == v1::DTYPE_U8) labels.data<uint8_t>()[r] = static_cast<uint8_t>(y[r]);
        if (dtype == v1::DTYPE_U32) labels.data<uint32_t>()[r] = static_cast<uint32_t>(y[r]);
        if (dtype == v1::DTYPE_F32) labels.data<float>()[r] = static_cast<float>(y[r]);
      }
      auto fwd = CreateSoftmaxCrossEntropy(z, labels, loss);
      auto bwd = CreateSoftmaxCrossEntropyGrad(z, labels, g, dz);
      ASSERT_TRUE(fwd.ok()) << fwd.status();
      ASSERT_TRUE(bwd.ok()) << bwd.status();
      ASSERT_TRUE((*fwd)->Run().ok());
      for (int64_t r = 0; r < rows; ++r) {
        double sum = 0;
        for (int64_t c = 0; c < classes; ++c)
          sum += std::exp(double{z.data<float>()[r * classes + c]});
        EXPECT_NEAR(loss.data<float>()[r], std::log(sum) - z.data<float>()[r * classes + y[r]],
                    1e-5)
            << "row " << r;
      }
      ASSERT_TRUE((*bwd)->Run().ok());
      ExpectGradient(z, dz, [&] {
        EXPECT_TRUE((*fwd)->Run().ok());
        return Dot(loss, g);
      });
    }
  }
  Tensor z = Random({2, 4}, 33), labels(v1::DTYPE_I32, {2}), loss(v1::DTYPE_F32, {2});
  labels.data<int32_t>()[1] = 4;
  auto fwd = CreateSoftmaxCrossEntropy(z, labels, loss);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  absl::Status s = (*fwd)->Run();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("label 4 of row 1 is not a class in [0, 4)"),
            std::string::npos)
      << s;
  Tensor wide(v1::DTYPE_I32, {3});
  EXPECT_EQ(CreateSoftmaxCrossEntropy(z, wide, loss).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The convert kernel rounds f32 to bf16 as jnp.astype does (to nearest, ties to even), keeps
// -0.0 and infinities bit for bit (oneDNN 2.6's reorder, which it used before, wrote -0.0 as +0.0
// below AVX512), widens bf16 exactly, on a length that is not a multiple of the vector width;
// other dtypes are refused.
TEST(ConvertKernelTest, F32ToBf16AndBackAreBitExactOnEveryCpu) {
  Tensor x = Random({37}, 41, 100.0f);
  float* v = x.data<float>();
  v[0] = 1.0f + 1.0f / 256;  // a tie: to even (1.0)
  v[1] = 1.0f + 3.0f / 256;  // a tie: to even (1 + 4/256)
  v[2] = -0.0f;
  v[3] = -std::numeric_limits<float>::infinity();
  v[4] = std::numeric_limits<float>::quiet_NaN();
  v[5] = -1e-40f;                                   // a negative f32 denormal: bf16 0x8001
  v[6] = std::numeric_limits<float>::max();         // rounds up to bf16's infinity
  v[7] = -std::numeric_limits<float>::quiet_NaN();  // a NaN keeps its sign, as XLA's convert
  const uint32_t signalling = 0xFFA12345u;          // ... and is quieted, its payload dropped
  std::memcpy(&v[8], &signalling, 4);
  const uint16_t want_bits[] = {0x3F80, 0x3F82, 0x8000, 0xFF80, 0x7FC0,
                                0x8001, 0x7F80, 0xFFC0, 0xFFC0};
  Tensor got = Tensor::Uninitialized(v1::DTYPE_BF16, {37}), want = got;
  Tensor ints(v1::DTYPE_I32, {37});
  EXPECT_EQ(CreateConvert(x, ints).status().code(), absl::StatusCode::kInvalidArgument);
  auto k = CreateConvert(x, got);
  ASSERT_TRUE(k.ok()) << k.status();
  ASSERT_TRUE((*k)->Run().ok());
  for (int i = 0; i < 9; ++i)
    EXPECT_EQ(got.data<uint16_t>()[i], want_bits[i]) << "element " << i << " = " << v[i];
  for (int i = 0; i < 37; ++i)
    EXPECT_EQ(got.data<uint16_t>()[i], F32ToBf16(v[i])) << "element " << i;
  Tensor back(v1::DTYPE_F32, {37});
  auto k2 = CreateConvert(got, back);
  ASSERT_TRUE(k2.ok()) << k2.status();
  ASSERT_TRUE((*k2)->Run().ok());
  for (int i = 0; i < 37; ++i) {
    const uint32_t widened = uint32_t{got.data<uint16_t>()[i]} << 16;
    uint32_t bits;
    std::memcpy(&bits, &back.data<float>()[i], 4);
    EXPECT_EQ(bits, widened) << "element " << i;
  }
}

// A convert long enough to be shared out over the OpenMP team (kConvertParallelMin; a length
// that is not a multiple of its blocks) gives each element the per-element bits, at the blocks'
// edges too, whatever the team's size.
TEST(ConvertKernelTest, ALongConvertSharedOverThreadsGivesEachElementsBits) {
  const int64_t n = 5 * 16384 + 37;
  ASSERT_GE(n, kConvertParallelMin);
  Tensor x = Random({n}, 43, 1000.0f);
  float* v = x.data<float>();
  for (int64_t edge : {int64_t{16383}, int64_t{16384}, n - 1}) {
    v[edge] = std::numeric_limits<float>::quiet_NaN();
    v[edge - 1] = 1.0f + 1.0f / 256;  // a tie
  }
  const int threads_before = omp_get_max_threads();
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    Tensor got = Tensor::Uninitialized(v1::DTYPE_BF16, {n});
    Tensor back = Tensor::Uninitialized(v1::DTYPE_F32, {n});
    auto k = CreateConvert(x, got);
    auto k2 = CreateConvert(got, back);
    ASSERT_TRUE(k.ok() && k2.ok());
    ASSERT_TRUE((*k)->Run().ok());
    ASSERT_TRUE((*k2)->Run().ok());
    int64_t wrong = 0, first = -1;
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t b = got.data<uint16_t>()[i];
      const uint32_t widened = uint32_t{b} << 16;
      uint32_t bits;
      std::memcpy(&bits, &back.data<float>()[i], 4);
      if (b != F32ToBf16(v[i]) || bits != widened) {
        if (first < 0) first = i;
        ++wrong;
      }
    }
    EXPECT_EQ(wrong, 0) << threads << " threads; first wrong element " << first;
  }
  omp_set_num_threads(threads_before);
}

TEST(SiluKernelTest, BackwardMatchesFiniteDifferences) {
  Tensor x = Random({4, 6}, 5, 2.0f), y(v1::DTYPE_F32, {4, 6}), r = Random({4, 6}, 6),
         dx(v1::DTYPE_F32, {4, 6});
  auto fwd = CreateUnary("silu", x, y);
  auto bwd = CreateUnaryGrad("silu", x, r, dx);
  ASSERT_TRUE(fwd.ok() && bwd.ok());
  ASSERT_TRUE((*fwd)->Run().ok());
  for (int64_t i = 0; i < x.num_elements(); ++i) {
    float v = x.data<float>()[i];
    EXPECT_NEAR(y.data<float>()[i], v / (1 + std::exp(-v)), 1e-5);
  }
  ASSERT_TRUE((*bwd)->Run().ok());
  ExpectGradient(x, dx, [&] {
    EXPECT_TRUE((*fwd)->Run().ok());
    return Dot(y, r);
  });
}

TEST(ReduceKernelTest, SumsAndMeansOverLeadingDimsMatchTheDefinition) {
  // Over leading dims the reduction runs as a GEMM with a ones row (CreateLeadingSum).
  for (const char* fn : {"sum", "mean"}) {
    Tensor x = Random({4, 3, 5}, 21), out(v1::DTYPE_F32, {1, 1, 5});
    auto k = CreateReduce(fn, x, out);
    ASSERT_TRUE(k.ok()) << k.status();
    ASSERT_TRUE((*k)->Run().ok());
    for (int c = 0; c < 5; ++c) {
      double s = 0;
      for (int r = 0; r < 12; ++r) s += x.data<float>()[r * 5 + c];
      if (std::string(fn) == "mean") s /= 12;
      EXPECT_NEAR(out.data<float>()[c], s, 1e-5) << fn << " column " << c;
    }
  }
  // Over trailing dims: oneDNN's reduction for sum and mean, a loop for max and min.
  Tensor x = Random({3, 4}, 22), rows(v1::DTYPE_F32, {3, 1});
  auto k = CreateReduce("max", x, rows);
  ASSERT_TRUE(k.ok()) << k.status();
  ASSERT_TRUE((*k)->Run().ok());
  for (int r = 0; r < 3; ++r)
    EXPECT_EQ(rows.data<float>()[r],
              *std::max_element(x.data<float>() + r * 4, x.data<float>() + r * 4 + 4));
}

TEST(ReduceKernelTest, ReducingOnlyUnitDimsCopies) {
  // A block whose reduced dims are all of size 1 on this device (oneDNN refuses such a reduction).
  for (const char* fn : {"sum", "mean", "max"}) {
    Tensor x = Random({3, 1, 4}, 23), out(v1::DTYPE_F32, {3, 1, 4});
    auto k = CreateReduce(fn, x, out);
    ASSERT_TRUE(k.ok()) << fn << ": " << k.status();
    ASSERT_TRUE((*k)->Run().ok());
    for (int i = 0; i < 12; ++i) EXPECT_EQ(out.data<float>()[i], x.data<float>()[i]) << fn;
  }
}

// lax.cumlogsumexp: each prefix's log(sum(exp)) without overflow (values near 1000), -inf terms
// adding nothing, +inf and NaN carried on as jnp.logaddexp carries them; from either end.
TEST(CumulativeKernelTest, LogSumExpIsEachPrefixsLogSumExp) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<std::vector<float>> rows = {{1000.0f, 999.0f, -3.0f, 1001.5f},
                                                {-inf, -inf, 0.5f, -inf},
                                                {0.25f, inf, 2.0f, -1.0f},
                                                {-2.0f, NAN, 1.0f, 3.0f}};
  Tensor x(v1::DTYPE_F32, {4, 4}), y(v1::DTYPE_F32, {4, 4});
  for (int r = 0; r < 4; ++r) std::copy(rows[r].begin(), rows[r].end(), x.data<float>() + 4 * r);
  for (bool reverse : {false, true}) {
    auto k = CreateCumulative("logsumexp", 1, reverse, x, y);
    ASSERT_TRUE(k.ok()) << k.status();
    ASSERT_TRUE((*k)->Run().ok());
    for (int r = 0; r < 4; ++r) {
      for (int c = 0; c < 4; ++c) {
        std::vector<double> terms;  // the prefix (or suffix) ending at c
        for (int j = reverse ? 3 : 0; reverse ? j >= c : j <= c; j += reverse ? -1 : 1)
          terms.push_back(rows[r][j]);
        const double m = *std::max_element(terms.begin(), terms.end());
        double want = m;
        bool nan = false;
        for (double t : terms) nan |= std::isnan(t);
        if (nan) {
          want = NAN;
        } else if (std::isfinite(m)) {
          double sum = 0;
          for (double t : terms) sum += std::exp(t - m);
          want = m + std::log(sum);
        }
        const float got = y.data<float>()[4 * r + c];
        SCOPED_TRACE(absl::StrCat("row ", r, " col ", c, reverse ? " reverse" : ""));
        if (std::isnan(want)) {
          EXPECT_TRUE(std::isnan(got)) << got;
        } else if (std::isinf(want)) {
          EXPECT_EQ(got, static_cast<float>(want));
        } else {
          EXPECT_NEAR(got, want, 1e-6 * std::max(1.0, std::abs(want)));
        }
      }
    }
  }
  Tensor i(v1::DTYPE_I32, {4}), iy(v1::DTYPE_I32, {4});
  auto bad = CreateCumulative("logsumexp", 0, false, i, iy);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), ::testing::HasSubstr("cumulative logsumexp of i32"));
}

}  // namespace
}  // namespace meshrun
