// Every kernel's backward against central finite differences of its forward.
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
#include "worker/kernels/kernel.h"

namespace meshrun {
namespace {

Tensor Random(Dims dims, uint32_t seed, float scale = 1.0f) {
  Tensor t(v1::DTYPE_F32, std::move(dims));
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  for (int64_t i = 0; i < t.num_elements(); ++i) t.data<float>()[i] = dist(rng);
  return t;
}

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
  v[5] = -1e-40f;                            // a negative f32 denormal: bf16 0x8001
  v[6] = std::numeric_limits<float>::max();  // rounds up to bf16's infinity
  const uint16_t want_bits[] = {0x3F80, 0x3F82, 0x8000, 0xFF80, 0x7FC0, 0x8001, 0x7F80};
  Tensor got = Tensor::Uninitialized(v1::DTYPE_BF16, {37}), want = got;
  Tensor ints(v1::DTYPE_I32, {37});
  EXPECT_EQ(CreateConvert(x, ints).status().code(), absl::StatusCode::kInvalidArgument);
  auto k = CreateConvert(x, got);
  ASSERT_TRUE(k.ok()) << k.status();
  ASSERT_TRUE((*k)->Run().ok());
  for (int i = 0; i < 7; ++i)
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

// lax.max / lax.min on f32 (core/float_ops.h): a NaN on either side is the result, and of two
// zeros max is +0 and min -0, whichever side each is on. std::max and the x86 max instruction
// return the other operand instead, so a NaN loss or activation would silently vanish.
TEST(FloatOpsTest, MaxAndMinPropagateNanAndOrderSignedZerosAsXla) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (const float v : {0.0f, -0.0f, 1.0f, -2.0f, inf, -inf, nan}) {
    EXPECT_TRUE(std::isnan(NanPropagatingMax(nan, v))) << v;
    EXPECT_TRUE(std::isnan(NanPropagatingMax(v, nan))) << v;
    EXPECT_TRUE(std::isnan(NanPropagatingMin(nan, v))) << v;
    EXPECT_TRUE(std::isnan(NanPropagatingMin(v, nan))) << v;
  }
  for (const auto& [a, b] : {std::pair{0.0f, -0.0f}, std::pair{-0.0f, 0.0f}}) {
    EXPECT_FALSE(std::signbit(NanPropagatingMax(a, b))) << a << " " << b;
    EXPECT_TRUE(std::signbit(NanPropagatingMin(a, b))) << a << " " << b;
  }
  EXPECT_TRUE(std::signbit(NanPropagatingMax(-0.0f, -0.0f)));
  EXPECT_EQ(NanPropagatingMax(-2.0f, 1.0f), 1.0f);
  EXPECT_EQ(NanPropagatingMax(1.0f, -inf), 1.0f);
  EXPECT_EQ(NanPropagatingMin(-2.0f, 1.0f), -2.0f);
  EXPECT_EQ(NanPropagatingMin(inf, 1.0f), 1.0f);
}

// Each comparison fn of CreateBinary over a and b (of T, one shape) against C++'s operator on
// every element: 1 where it holds, else 0.
template <typename T>
void ExpectComparisonsAsCpp(const Tensor& a, const Tensor& b) {
  const std::map<std::string, std::function<bool(T, T)>> cmps = {
      {"eq", std::equal_to<>()},   {"ne", std::not_equal_to<>()}, {"lt", std::less<>()},
      {"le", std::less_equal<>()}, {"gt", std::greater<>()},      {"ge", std::greater_equal<>()}};
  Tensor out(a.dtype(), a.dims());
  for (const auto& [fn, ref] : cmps) {
    auto k = CreateBinary(fn, a, b, out);
    ASSERT_TRUE(k.ok()) << k.status();
    ASSERT_TRUE((*k)->Run().ok());
    for (int64_t i = 0; i < a.num_elements(); ++i) {
      const T x = a.data<T>()[i], y = b.data<T>()[i];
      EXPECT_EQ(out.data<T>()[i], ref(x, y) ? T(1) : T(0)) << x << " " << fn << " " << y;
    }
  }
}

// i32 / u32 comparisons and sum / max / min reductions in their own integers, where f32 would
// make 2^24 + 1 equal 2^24: values beyond 2^24 and, for u32, beyond 2^31; sums wrapping mod 2^32.
TEST(BinaryKernelTest, IntegerComparisonsAndReductionsAreExactBeyondFloatPrecision) {
  Tensor a(v1::DTYPE_I32, {2, 3}), b(v1::DTYPE_I32, {2, 3});
  const int32_t av[] = {16777217, 2147483647, -16777217, 100000001, -2147483648, 3};
  const int32_t bv[] = {16777216, 2147483647, -16777216, 100000000, 2147483647, 3};
  std::copy(av, av + 6, a.data<int32_t>());
  std::copy(bv, bv + 6, b.data<int32_t>());
  ExpectComparisonsAsCpp<int32_t>(a, b);
  Tensor u(v1::DTYPE_U32, {1, 2}), v(v1::DTYPE_U32, {1, 2}), uo(v1::DTYPE_U32, {1, 2});
  u.data<uint32_t>()[0] = 4294967295u, u.data<uint32_t>()[1] = 2147483648u;
  v.data<uint32_t>()[0] = 4294967294u, v.data<uint32_t>()[1] = 2147483649u;
  auto gt = CreateBinary("gt", u, v, uo);
  ASSERT_TRUE(gt.ok()) << gt.status();
  ASSERT_TRUE((*gt)->Run().ok());
  EXPECT_EQ(uo.data<uint32_t>()[0], 1u);
  EXPECT_EQ(uo.data<uint32_t>()[1], 0u);
  // Over each dim and both: sum (wrapping), max, min.
  for (const Dims& od : {Dims{1, 3}, Dims{2, 1}, Dims{1, 1}}) {
    for (const char* fn : {"sum", "max", "min"}) {
      Tensor r(v1::DTYPE_I32, od);
      auto k = CreateReduce(fn, a, r);
      ASSERT_TRUE(k.ok()) << fn << ": " << k.status();
      ASSERT_TRUE((*k)->Run().ok());
      std::vector<int64_t> want(r.num_elements(), std::string(fn) == "sum"   ? 0
                                                  : std::string(fn) == "max" ? INT64_MIN
                                                                             : INT64_MAX);
      for (int i = 0; i < 6; ++i) {
        const int64_t j = (od[0] == 1 ? 0 : i / 3) * od[1] + (od[1] == 1 ? 0 : i % 3);
        want[j] = std::string(fn) == "sum"   ? want[j] + av[i]
                  : std::string(fn) == "max" ? std::max<int64_t>(want[j], av[i])
                                             : std::min<int64_t>(want[j], av[i]);
      }
      for (int64_t j = 0; j < r.num_elements(); ++j)
        EXPECT_EQ(r.data<int32_t>()[j], static_cast<int32_t>(static_cast<uint32_t>(want[j])))
            << fn << " " << DimsToString(od) << " " << j;
    }
  }
  Tensor mean(v1::DTYPE_I32, {1, 3});
  EXPECT_FALSE(CreateReduce("mean", a, mean).ok());
  Tensor scalar(v1::DTYPE_I32, {}), same(v1::DTYPE_I32, {});
  scalar.data<int32_t>()[0] = 16777217;
  auto sk = CreateReduce("sum", scalar, same);  // nothing reduced: a copy
  ASSERT_TRUE(sk.ok()) << sk.status();
  ASSERT_TRUE((*sk)->Run().ok());
  EXPECT_EQ(same.data<int32_t>()[0], 16777217);
  // cumsum along each row, wrapping: 16777217 + 2147483647 - 16777217 = 2147483647.
  Tensor scan(v1::DTYPE_I32, {2, 3});
  auto ck = CreateCumulative("sum", 1, /*reverse=*/false, a, scan);
  ASSERT_TRUE(ck.ok()) << ck.status();
  ASSERT_TRUE((*ck)->Run().ok());
  for (int r = 0; r < 2; ++r) {
    uint32_t acc = 0;
    for (int c = 0; c < 3; ++c) {
      acc += static_cast<uint32_t>(av[r * 3 + c]);
      EXPECT_EQ(scan.data<int32_t>()[r * 3 + c], static_cast<int32_t>(acc)) << r << " " << c;
    }
  }
}

// f32 comparisons are IEEE's, as lax's: with a NaN on either side only ne holds (where(x > 0,
// a, b) picks b for a NaN x, and relu's gradient there is 0); -0 equals +0. A broadcast operand.
TEST(BinaryKernelTest, FloatComparisonsWithNanAndSignedZerosAreIeee) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<std::pair<float, float>> pairs = {{nan, 0.0f},   {1.0f, nan},  {nan, nan},
                                                      {-0.0f, 0.0f}, {1.0f, 2.0f}, {2.0f, 1.0f},
                                                      {3.0f, 3.0f}};
  Tensor a(v1::DTYPE_F32, {7, 1}), b(v1::DTYPE_F32, {7, 1});
  for (int i = 0; i < 7; ++i)
    a.data<float>()[i] = pairs[i].first, b.data<float>()[i] = pairs[i].second;
  ExpectComparisonsAsCpp<float>(a, b);
  Tensor wide(v1::DTYPE_F32, {7, 3}), zero(v1::DTYPE_F32, {1, 1}), wout(v1::DTYPE_F32, {7, 3});
  for (int i = 0; i < 21; ++i) wide.data<float>()[i] = pairs[i / 3].first;
  zero.data<float>()[0] = 0.0f;
  auto gt = CreateBinary("gt", wide, zero, wout);
  ASSERT_TRUE(gt.ok()) << gt.status();
  ASSERT_TRUE((*gt)->Run().ok());
  for (int i = 0; i < 21; ++i)
    EXPECT_EQ(wout.data<float>()[i], pairs[i / 3].first > 0.0f ? 1.0f : 0.0f) << i;
}

// Every kernel that takes a max or min keeps a NaN, wherever it sits: the binary fns (a
// broadcast operand too), reduce over each dim and over all, cummax, and pmax's reduction.
TEST(BinaryKernelTest, MaxAndMinEverywhereKeepNanAsXla) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Tensor x = Random({3, 4, 5}, 31);
  x.data<float>()[0] = nan;                   // [0, 0, 0]: first of its row, column and slab
  x.data<float>()[2 * 20 + 3 * 5 + 4] = nan;  // [2, 3, 4]: last
  auto is_nan_at = [&](const Tensor& t, int64_t i) { return std::isnan(t.data<float>()[i]); };
  for (const char* fn : {"max", "min"}) {
    SCOPED_TRACE(fn);
    Tensor zero(v1::DTYPE_F32, {1, 1, 1}), out(v1::DTYPE_F32, {3, 4, 5});
    zero.data<float>()[0] = 0.0f;
    auto k = CreateBinary(fn, x, zero, out);
    ASSERT_TRUE(k.ok()) << k.status();
    ASSERT_TRUE((*k)->Run().ok());
    EXPECT_TRUE(is_nan_at(out, 0));
    EXPECT_TRUE(is_nan_at(out, 59));
    EXPECT_EQ(out.data<float>()[1], std::string(fn) == "max" ? std::max(x.data<float>()[1], 0.0f)
                                                             : std::min(x.data<float>()[1], 0.0f));
    // Reduced over dims {0}, {1}, {2}, {0, 2} and all: NaN exactly where a NaN was reduced in.
    for (const Dims& od :
         {Dims{1, 4, 5}, Dims{3, 1, 5}, Dims{3, 4, 1}, Dims{1, 4, 1}, Dims{1, 1, 1}}) {
      Tensor r(v1::DTYPE_F32, od);
      auto rk = CreateReduce(fn, x, r);
      ASSERT_TRUE(rk.ok()) << rk.status();
      ASSERT_TRUE((*rk)->Run().ok());
      for (int64_t i = 0; i < 60; ++i) {
        const int64_t c[3] = {i / 20, i / 5 % 4, i % 5};
        int64_t j = 0;
        for (int d = 0; d < 3; ++d) j = j * od[d] + (od[d] == 1 ? 0 : c[d]);
        if (std::isnan(x.data<float>()[i])) {
          EXPECT_TRUE(is_nan_at(r, j)) << DimsToString(od) << " element " << i;
        } else if (!is_nan_at(r, j)) {
          const float got = r.data<float>()[j], v = x.data<float>()[i];
          EXPECT_TRUE(std::string(fn) == "max" ? got >= v : got <= v) << DimsToString(od) << i;
        }
      }
    }
    Tensor y(v1::DTYPE_F32, {3, 4, 5});
    auto ck = CreateCumulative(fn, 2, /*reverse=*/false, x, y);
    ASSERT_TRUE(ck.ok()) << ck.status();
    ASSERT_TRUE((*ck)->Run().ok());
    for (int i = 0; i < 5; ++i) EXPECT_TRUE(is_nan_at(y, i)) << "cumulative " << i;
    EXPECT_FALSE(is_nan_at(y, 5));
  }
  // pmax's element-wise reduction, NaN on either side, f32 and bf16.
  float dst[3] = {nan, 1.0f, -1.0f}, src[3] = {2.0f, nan, -3.0f};
  Reduce(v1::DTYPE_F32, ReduceOp::kMax, dst, src, 3);
  EXPECT_TRUE(std::isnan(dst[0]) && std::isnan(dst[1]));
  EXPECT_EQ(dst[2], -1.0f);
  uint16_t bd[2] = {F32ToBf16(nan), F32ToBf16(1.0f)}, bs[2] = {F32ToBf16(2.0f), F32ToBf16(nan)};
  Reduce(v1::DTYPE_BF16, ReduceOp::kMax, bd, bs, 2);
  EXPECT_TRUE(std::isnan(Bf16ToF32(bd[0])) && std::isnan(Bf16ToF32(bd[1])));
}

// log within an ulp of the exact value, relative, near 1 too (oneDNN 2.6's eltwise_log erred by
// ~1.4e-6 absolute: log(1.0001) was 1.4% off).
TEST(UnaryKernelTest, LogIsAccurateToAnUlpNearOneAsElsewhere) {
  const std::vector<float> in = {0.999f, 1.0001f, 1.0036f, 1.01f, 1.5f, 2.0f, 0.5f, 100.0f, 1e-30f};
  Tensor x(v1::DTYPE_F32, {static_cast<int64_t>(in.size())}), y(v1::DTYPE_F32, x.dims());
  std::copy(in.begin(), in.end(), x.data<float>());
  auto k = CreateUnary("log", x, y);
  ASSERT_TRUE(k.ok()) << k.status();
  ASSERT_TRUE((*k)->Run().ok());
  for (size_t i = 0; i < in.size(); ++i) {
    const double exact = std::log(static_cast<double>(in[i]));
    const double ulp = std::nextafter(static_cast<float>(std::abs(exact)), INFINITY) -
                       static_cast<float>(std::abs(exact));
    EXPECT_LE(std::abs(y.data<float>()[i] - exact), ulp) << "log(" << in[i] << ")";
  }
}

// tanh is XLA's CPU tanh bit for bit: the outputs jax.jit(jnp.tanh) gave under JAX 0.10.2 on
// x86 (some an ulp or two from the correctly rounded value, which oneDNN's eltwise_tanh gave
// instead), exactly +-1 from about 7.9 on, x itself below 4e-4, -0.0 and NaN kept; on a length
// past the vector width.
TEST(UnaryKernelTest, TanhIsXlasApproximationBitForBit) {
  const std::vector<std::pair<float, uint32_t>> jax = {
      {0.5f, 0x3eec9a9f},  {1.0f, 0x3f42f7d6},     {2.0f, 0x3f76ca83},     {-3.0f, 0xbf7ebbe8},
      {7.9f, 0x3f7ffffc},  {0.001f, 0x3a83126b},   {-0.0004f, 0xb9d1b714}, {0.00039f, 0x39cc78ea},
      {4.0f, 0x3f7fd40a},  {8.0f, 0x3f800000},     {-19.9f, 0xbf800000},   {20.0f, 0x3f800000},
      {-0.0f, 0x80000000}, {INFINITY, 0x3f800000}, {-1e30f, 0xbf800000}};
  Tensor x(v1::DTYPE_F32, {static_cast<int64_t>(jax.size()) + 1}), y(v1::DTYPE_F32, x.dims());
  for (size_t i = 0; i < jax.size(); ++i) x.data<float>()[i] = jax[i].first;
  x.data<float>()[jax.size()] = NAN;
  auto k = CreateUnary("tanh", x, y);
  ASSERT_TRUE(k.ok()) << k.status();
  ASSERT_TRUE((*k)->Run().ok());
  for (size_t i = 0; i < jax.size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &y.data<float>()[i], 4);
    EXPECT_EQ(bits, jax[i].second) << "tanh(" << jax[i].first << ") = " << y.data<float>()[i];
  }
  EXPECT_TRUE(std::isnan(y.data<float>()[jax.size()]));
}

TEST(BinaryKernelTest, PowBroadcastsItsExponentAsTheOtherFnsDo) {
  Tensor a = Random({2, 3}, 24), b(v1::DTYPE_F32, {1, 3}), out(v1::DTYPE_F32, {2, 3});
  for (int i = 0; i < 6; ++i) a.data<float>()[i] = std::abs(a.data<float>()[i]) + 0.5f;
  const float exps[] = {2.0f, -0.5f, 3.25f};
  for (int i = 0; i < 3; ++i) b.data<float>()[i] = exps[i];
  auto k = CreateBinary("pow", a, b, out);
  ASSERT_TRUE(k.ok()) << k.status();
  ASSERT_TRUE((*k)->Run().ok());
  for (int i = 0; i < 6; ++i)
    EXPECT_EQ(out.data<float>()[i], std::pow(a.data<float>()[i], exps[i % 3])) << i;
  auto atan2 = CreateBinary("atan2", a, b, out);
  ASSERT_TRUE(atan2.ok()) << atan2.status();
  ASSERT_TRUE((*atan2)->Run().ok());
  for (int i = 0; i < 6; ++i)
    EXPECT_EQ(out.data<float>()[i], std::atan2(a.data<float>()[i], exps[i % 3])) << i;
  EXPECT_THAT(std::string(CreateBinary("hypot", a, b, out).status().message()),
              ::testing::HasSubstr("pow"));
}

// jax.lax's integer ops, as JAX's samplers use them: wrapping arithmetic, bitwise ops, shifts
// (by 32 or more: 0, or -1 for an arithmetic shift of a negative), a broadcast operand.
TEST(BinaryKernelTest, IntegerFnsFollowJaxLax) {
  Tensor a(v1::DTYPE_U32, {2, 3}), b(v1::DTYPE_U32, {1, 3}), out(v1::DTYPE_U32, {2, 3});
  const uint32_t av[] = {0xFFFFFFFFu, 0x80000001u, 7u, 1u, 0x12345678u, 0u};
  const uint32_t bv[] = {1u, 31u, 32u};
  std::copy(av, av + 6, a.data<uint32_t>());
  std::copy(bv, bv + 3, b.data<uint32_t>());
  const auto run = [&](const std::string& fn, Tensor& x, Tensor& y, Tensor& z) {
    auto k = CreateBinary(fn, x, y, z);
    ASSERT_TRUE(k.ok()) << fn << ": " << k.status();
    ASSERT_TRUE((*k)->Run().ok());
  };
  run("add", a, b, out);
  EXPECT_EQ(out.data<uint32_t>()[0], 0u) << "wraps";
  EXPECT_EQ(out.data<uint32_t>()[1], 0x80000020u);
  run("shift_right_logical", a, b, out);
  EXPECT_EQ(out.data<uint32_t>()[0], 0x7FFFFFFFu);
  EXPECT_EQ(out.data<uint32_t>()[1], 1u);
  EXPECT_EQ(out.data<uint32_t>()[2], 0u) << "a shift by 32 gives 0";
  run("shift_left", a, b, out);
  EXPECT_EQ(out.data<uint32_t>()[3], 2u);
  EXPECT_EQ(out.data<uint32_t>()[5], 0u);
  run("xor", a, b, out);
  EXPECT_EQ(out.data<uint32_t>()[4], 0x12345678u ^ 31u);
  run("or", a, b, out);
  EXPECT_EQ(out.data<uint32_t>()[2], 39u);
  Tensor s(v1::DTYPE_I32, {3}), t(v1::DTYPE_I32, {3}), r(v1::DTYPE_I32, {3});
  const int32_t sv[] = {-8, -8, 5}, tv[] = {1, 40, 1};
  std::copy(sv, sv + 3, s.data<int32_t>());
  std::copy(tv, tv + 3, t.data<int32_t>());
  run("shift_right_arithmetic", s, t, r);
  EXPECT_EQ(r.data<int32_t>()[0], -4);
  EXPECT_EQ(r.data<int32_t>()[1], -1) << "a negative shifted by 32 or more gives -1";
  EXPECT_EQ(r.data<int32_t>()[2], 2);
  run("mul", s, t, r);
  EXPECT_EQ(r.data<int32_t>()[1], -320);
  // div and rem truncate, with XLA's results where C++ has none: x / 0 is -1 (all bits set) and
  // x % 0 is x; INT_MIN / -1 is INT_MIN and INT_MIN % -1 is 0.
  Tensor n(v1::DTYPE_I32, {5}), d(v1::DTYPE_I32, {5}), q(v1::DTYPE_I32, {5});
  const int32_t nv[] = {7, -7, 100000001, 9, std::numeric_limits<int32_t>::min()};
  const int32_t dv[] = {-3, 2, 3, 0, -1};
  std::copy(nv, nv + 5, n.data<int32_t>());
  std::copy(dv, dv + 5, d.data<int32_t>());
  run("div", n, d, q);
  EXPECT_THAT(std::vector<int32_t>(q.data<int32_t>(), q.data<int32_t>() + 5),
              ::testing::ElementsAre(-2, -3, 33333333, -1, std::numeric_limits<int32_t>::min()));
  run("rem", n, d, q);
  EXPECT_THAT(std::vector<int32_t>(q.data<int32_t>(), q.data<int32_t>() + 5),
              ::testing::ElementsAre(1, -1, 2, 9, 0));
  run("div", a, b, out);  // u32: 0xFFFFFFFF / 1, 0x80000001 / 31, 7 / 32, ...
  EXPECT_EQ(out.data<uint32_t>()[1], 0x80000001u / 31u);
  EXPECT_EQ(out.data<uint32_t>()[2], 0u);
  // Unknown fns and mixed dtypes are refused, naming them.
  EXPECT_THAT(std::string(CreateBinary("atan2", a, b, out).status().message()),
              ::testing::HasSubstr("shift_right_logical"));
  Tensor f(v1::DTYPE_F32, {1, 3});
  EXPECT_THAT(std::string(CreateBinary("or", a, f, out).status().message()),
              ::testing::HasSubstr("f32"));
}

TEST(BinaryKernelTest, NextafterStepsOneUlpTowardsTheOtherOperandAndRemIsFmod) {
  Tensor a(v1::DTYPE_F32, {3}), b(v1::DTYPE_F32, {3}), out(v1::DTYPE_F32, {3});
  const float av[] = {1.0f, -2.0f, 0.0f}, bv[] = {2.0f, 0.0f, -1.0f};
  std::copy(av, av + 3, a.data<float>());
  std::copy(bv, bv + 3, b.data<float>());
  auto k = CreateBinary("nextafter", a, b, out);
  ASSERT_TRUE(k.ok()) << k.status();
  ASSERT_TRUE((*k)->Run().ok());
  EXPECT_EQ(out.data<float>()[0], 0x1.000002p+0f);
  EXPECT_EQ(out.data<float>()[1], -0x1.fffffep+0f);
  EXPECT_EQ(out.data<float>()[2], -std::numeric_limits<float>::denorm_min());
  // rem is C's fmod (lax.rem): the dividend's sign.
  const float rv[] = {7.5f, -7.5f, 1.0f};
  std::copy(rv, rv + 3, a.data<float>());
  const float dv[] = {2.0f, 2.0f, 0.0f};
  std::copy(dv, dv + 3, b.data<float>());
  auto rem = CreateBinary("rem", a, b, out);
  ASSERT_TRUE(rem.ok()) << rem.status();
  ASSERT_TRUE((*rem)->Run().ok());
  EXPECT_EQ(out.data<float>()[0], 1.5f);
  EXPECT_EQ(out.data<float>()[1], -1.5f);
  EXPECT_TRUE(std::isnan(out.data<float>()[2]));
}

// jax.lax.cumsum / cumprod / cummax / cummin along a middle dim, forwards and reversed.
TEST(CumulativeKernelTest, ScansAlongItsDimInEitherDirection) {
  Tensor x(v1::DTYPE_F32, {2, 3, 2}), y(v1::DTYPE_F32, {2, 3, 2});
  const float xv[] = {1, -2, 3, 4, -5, 6, 2, 2, 0.5f, -1, 3, 1};
  std::copy(xv, xv + 12, x.data<float>());
  const auto run = [&](const std::string& fn, bool reverse) {
    auto k = CreateCumulative(fn, 1, reverse, x, y);
    EXPECT_TRUE(k.ok()) << k.status();
    if (k.ok()) {
      EXPECT_TRUE((*k)->Run().ok());
    }
    return std::vector<float>(y.data<float>(), y.data<float>() + 12);
  };
  EXPECT_EQ(run("sum", false), (std::vector<float>{1, -2, 4, 2, -1, 8, 2, 2, 2.5f, 1, 5.5f, 2}));
  EXPECT_EQ(run("sum", true), (std::vector<float>{-1, 8, -2, 10, -5, 6, 5.5f, 2, 3.5f, 0, 3, 1}));
  EXPECT_EQ(run("max", false), (std::vector<float>{1, -2, 3, 4, 3, 6, 2, 2, 2, 2, 3, 2}));
  EXPECT_EQ(run("min", true), (std::vector<float>{-5, -2, -5, 4, -5, 6, 0.5f, -1, 0.5f, -1, 3, 1}));
  EXPECT_EQ(run("prod", false), (std::vector<float>{1, -2, 3, -8, -15, -48, 2, 2, 1, -2, 3, -2}));
  EXPECT_FALSE(CreateCumulative("logsumexp", 1, false, x, y).ok());
  EXPECT_FALSE(CreateCumulative("sum", 3, false, x, y).ok());
}

// lax.sort's order: NaN last, -0 before +0, ties kept in order (stable), other operands
// permuted alongside (argsort), along a leading dim.
TEST(SortKernelTest, SortsStablyInLaxsTotalOrderAndPermutesTheOtherOperands) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Tensor keys(v1::DTYPE_F32, {6, 1}), index(v1::DTYPE_I32, {6, 1});
  const float kv[] = {2.0f, nan, 0.0f, -0.0f, 2.0f, -3.0f};
  std::copy(kv, kv + 6, keys.data<float>());
  for (int i = 0; i < 6; ++i) index.data<int32_t>()[i] = i;
  Tensor sorted(v1::DTYPE_F32, {6, 1}), perm(v1::DTYPE_I32, {6, 1});
  auto k = CreateSort({&keys, &index}, 0, 1, 0, sorted);
  auto a = CreateSort({&keys, &index}, 0, 1, 1, perm);
  ASSERT_TRUE(k.ok() && a.ok()) << k.status() << a.status();
  ASSERT_TRUE((*k)->Run().ok() && (*a)->Run().ok());
  EXPECT_EQ(std::vector<int32_t>(perm.data<int32_t>(), perm.data<int32_t>() + 6),
            (std::vector<int32_t>{5, 3, 2, 0, 4, 1}));
  EXPECT_TRUE(std::signbit(sorted.data<float>()[1]));
  EXPECT_TRUE(std::isnan(sorted.data<float>()[5]));
  Tensor bf16(v1::DTYPE_BF16, {6, 1}), out(v1::DTYPE_BF16, {6, 1});
  EXPECT_FALSE(CreateSort({&bf16}, 0, 1, 0, out).ok()) << "2-byte operands are refused";
}

}  // namespace
}  // namespace meshrun
