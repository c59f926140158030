// The element-wise, scan and sort kernels follow XLA's semantics, which jax.jit's results have:
// NaN propagation and signed zeros in max, min and comparisons, exact integer ops beyond 2^24,
// lax's shifts and wrapping, tanh bit for bit, log within an ulp, lax.sort's total order.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/casts.h"
#include "absl/strings/str_cat.h"
#include "core/collectives/reduce_kernels.h"
#include "core/float_ops.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/worker/random_tensor.h"
#include "worker/kernels/kernel.h"

namespace meshrun {
namespace {

using testing::Random;

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

// ScaleByPowerOfTwo is std::ldexp over the range XLA's exp scales by: every n from -150 (deep in
// the subnormals, where it rounds) to 128 (overflow) and values of y across [0.5, 2), their
// rounding bits included.
TEST(FloatOpsTest, ScaleByPowerOfTwoIsLdexpBitForBit) {
  std::vector<float> ys = {0.5f, 0.70710677f, 1.0f, 1.4142135f, std::nextafter(2.0f, 0.0f)};
  for (uint32_t bits = 0x3F000000u; bits < 0x40000000u; bits += 0x1357u)
    ys.push_back(absl::bit_cast<float>(bits));
  for (const float y : ys)
    for (int n = -150; n <= 128; ++n)
      for (const float v : {y, -y}) {
        const float want = std::ldexp(v, n), got = ScaleByPowerOfTwo(v, n);
        ASSERT_EQ(absl::bit_cast<uint32_t>(got), absl::bit_cast<uint32_t>(want))
            << v << " * 2^" << n << ": " << got << " against " << want;
      }
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

// neg flips the sign bit of every value, a NaN's too, as lax.neg (jax.jit(lambda x: -x) turns
// NaN into -NaN and back); oneDNN's eltwise_linear(-1) kept a NaN's sign. On a length past the
// vector width.
TEST(UnaryKernelTest, NegFlipsTheSignBitOfEveryValueANansToo) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> in = {nan,  -nan, 0.0f, -0.0f, 1.5f, -INFINITY, 3e-39f, -2.0f, 7.0f, nan,
                                 1.0f, 2.0f, 3.0f, 4.0f,  5.0f, 6.0f,      8.0f,   -nan,  9.0f};
  Tensor x(v1::DTYPE_F32, {static_cast<int64_t>(in.size())}), y(v1::DTYPE_F32, x.dims());
  std::copy(in.begin(), in.end(), x.data<float>());
  auto k = CreateUnary("neg", x, y);
  ASSERT_TRUE(k.ok()) << k.status();
  ASSERT_TRUE((*k)->Run().ok());
  for (size_t i = 0; i < in.size(); ++i) {
    uint32_t a, b;
    std::memcpy(&a, &in[i], 4);
    std::memcpy(&b, y.data<float>() + i, 4);
    EXPECT_EQ(b, a ^ 0x80000000u) << "element " << i;
  }
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

// exp and logistic (jax.nn.sigmoid, 1 / (1 + exp(-x))) are XLA's CPU functions bit for bit: the
// outputs jax.jit gave under JAX 0.10.2 on x86, where some differ by an ulp from the correctly
// rounded value (the first five here) and a denormal result is 0 (XLA flushes it).
TEST(UnaryKernelTest, ExpAndLogisticAreXlasBitForBit) {
  struct Case {
    float x;
    uint32_t exp, logistic;
  };
  const std::vector<Case> jax = {{0.11368896812200546f, 0x3f8f6962, 0x3f0744ad},
                                 {-2.9458162784576416f, 0x3d574840, 0x3d4c883d},
                                 {-4.44808292388916f, 0x3c3fb574, 0x3c3d7dd7},
                                 {1.3217482566833496f, 0x406fff89, 0x3f4a1ade},
                                 {-2.147812843322754f, 0x3def14f7, 0x3dd616da},
                                 {0.5f, 0x3fd3094c, 0x3f1f597f},
                                 {-20.25f, 0x30dc9ef1, 0x30dc9ef0},
                                 {60.0f, 0x6abcede5, 0x3f800000},
                                 {88.3f, 0x7f27ba46, 0x3f800000},
                                 {-87.0f, 0x00b33687, 0x00b33688},
                                 {-88.9f, 0x00000000, 0x00000000},
                                 {-0.0f, 0x3f800000, 0x3f000000},
                                 {-INFINITY, 0x00000000, 0x00000000},
                                 {INFINITY, 0x7f800000, 0x3f800000}};
  Tensor x(v1::DTYPE_F32, {static_cast<int64_t>(jax.size())}), e(v1::DTYPE_F32, x.dims()),
      l(v1::DTYPE_F32, x.dims());
  for (size_t i = 0; i < jax.size(); ++i) x.data<float>()[i] = jax[i].x;
  auto ke = CreateUnary("exp", x, e), kl = CreateUnary("logistic", x, l);
  ASSERT_TRUE(ke.ok() && kl.ok()) << ke.status() << kl.status();
  ASSERT_TRUE((*ke)->Run().ok() && (*kl)->Run().ok());
  for (size_t i = 0; i < jax.size(); ++i) {
    uint32_t eb, lb;
    std::memcpy(&eb, &e.data<float>()[i], 4);
    std::memcpy(&lb, &l.data<float>()[i], 4);
    EXPECT_EQ(eb, jax[i].exp) << "exp(" << jax[i].x << ") = " << e.data<float>()[i];
    EXPECT_EQ(lb, jax[i].logistic) << "logistic(" << jax[i].x << ") = " << l.data<float>()[i];
  }
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

// A loop fn broadcasts b along any of a's dims where b has 1, a scalar b included, with each
// element a's own fn(a, b) (sub and atan2: the operands' order shows).
TEST(BinaryKernelTest, ALoopFnBroadcastsBAlongAnyDimsOfSizeOne) {
  const Dims ad = {2, 3, 5};
  const std::vector<Dims> bds = {{2, 3, 5}, {1, 1, 1}, {2, 1, 5}, {2, 3, 1},
                                 {1, 3, 1}, {1, 1, 5}, {2, 1, 1}};
  Tensor fa = Random(ad, 7), ua(v1::DTYPE_U32, ad);
  for (int64_t i = 0; i < ua.num_elements(); ++i)
    ua.data<uint32_t>()[i] = 0x9E3779B9u * static_cast<uint32_t>(i + 1);
  for (const Dims& bd : bds) {
    Tensor fb = Random(bd, 11), ub(v1::DTYPE_U32, bd);
    for (int64_t i = 0; i < ub.num_elements(); ++i)
      ub.data<uint32_t>()[i] = 1000u + 17u * static_cast<uint32_t>(i);
    Tensor fo(v1::DTYPE_F32, ad), uo(v1::DTYPE_U32, ad);
    auto fk = CreateBinary("atan2", fa, fb, fo);
    auto uk = CreateBinary("sub", ua, ub, uo);
    ASSERT_TRUE(fk.ok() && uk.ok()) << fk.status() << uk.status();
    ASSERT_TRUE((*fk)->Run().ok() && (*uk)->Run().ok());
    for (int64_t i = 0; i < 2; ++i)
      for (int64_t j = 0; j < 3; ++j)
        for (int64_t k = 0; k < 5; ++k) {
          const int64_t at = (i * 3 + j) * 5 + k;
          const int64_t bt =
              ((bd[0] == 1 ? 0 : i) * bd[1] + (bd[1] == 1 ? 0 : j)) * bd[2] + (bd[2] == 1 ? 0 : k);
          ASSERT_EQ(fo.data<float>()[at], std::atan2(fa.data<float>()[at], fb.data<float>()[bt]))
              << DimsToString(bd) << " element " << at;
          ASSERT_EQ(uo.data<uint32_t>()[at], ua.data<uint32_t>()[at] - ub.data<uint32_t>()[bt])
              << DimsToString(bd) << " element " << at;
        }
  }
  // A scalar against a scalar, and an empty a.
  Tensor x(v1::DTYPE_U32, {}), y(v1::DTYPE_U32, {}), z(v1::DTYPE_U32, {});
  x.data<uint32_t>()[0] = 5;
  y.data<uint32_t>()[0] = 7;
  auto k = CreateBinary("sub", x, y, z);
  ASSERT_TRUE(k.ok() && (*k)->Run().ok());
  EXPECT_EQ(z.data<uint32_t>()[0], 0xFFFFFFFEu);
  Tensor e(v1::DTYPE_U32, {0, 3}), eb(v1::DTYPE_U32, {1, 3}), eo(v1::DTYPE_U32, {0, 3});
  auto ek = CreateBinary("sub", e, eb, eo);
  ASSERT_TRUE(ek.ok()) << ek.status();
  EXPECT_TRUE((*ek)->Run().ok());
}

// f32 add, sub, mul and div where b broadcasts along a's last dim (a softmax's row max and sum),
// which oneDNN 2.6 runs only in its reference code, and along its first: IEEE's result per element.
TEST(BinaryKernelTest, ArithmeticWithARowBroadcastGivesEachElementsIeeeResult) {
  const Dims ad = {2, 3, 4, 37};
  Tensor a = Random(ad, 5);
  for (const Dims& bd : {Dims{2, 3, 4, 1}, Dims{1, 3, 4, 37}}) {
    Tensor b = Random(bd, 9);
    for (int64_t i = 0; i < b.num_elements(); ++i) b.data<float>()[i] += 2.0f;  // no 0 divisor
    for (const std::string fn : {"add", "sub", "mul", "div"}) {
      Tensor out(v1::DTYPE_F32, ad);
      auto k = CreateBinary(fn, a, b, out);
      ASSERT_TRUE(k.ok()) << fn << ": " << k.status();
      ASSERT_TRUE((*k)->Run().ok());
      for (int64_t i = 0; i < a.num_elements(); ++i) {
        const int64_t j = bd[3] == 1 ? i / 37 : i % (3 * 4 * 37);
        const float x = a.data<float>()[i], y = b.data<float>()[j];
        const float want = fn == "add" ? x + y : fn == "sub" ? x - y : fn == "mul" ? x * y : x / y;
        ASSERT_EQ(out.data<float>()[i], want) << fn << " " << DimsToString(bd) << " element " << i;
      }
    }
  }
  Tensor x = Random({2, 1}, 3), y = Random({2, 1}, 4), z(v1::DTYPE_U32, {2, 1});
  EXPECT_THAT(std::string(CreateArithmeticLoop("pow", x, y, x).status().message()),
              ::testing::HasSubstr("pow"));
  EXPECT_FALSE(CreateArithmeticLoop("add", x, y, z).ok()) << "a u32 output";
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
  EXPECT_FALSE(CreateCumulative("mean", 1, false, x, y).ok());
  EXPECT_FALSE(CreateCumulative("sum", 3, false, x, y).ok());
}

// lax.sort's order (jax.jit's, jax 0.10): -inf first, NaN last, -0 equal to +0 and -NaN to NaN
// (so a stable sort keeps each in place), ties kept in order, other operands permuted alongside
// (argsort), along a leading dim; the values keep their bits.
TEST(SortKernelTest, SortsStablyInLaxsOrderAndPermutesTheOtherOperands) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  Tensor keys(v1::DTYPE_F32, {8, 1}), index(v1::DTYPE_I32, {8, 1});
  const float kv[] = {2.0f, nan, 0.0f, -0.0f, 2.0f, -3.0f, -nan, -inf};
  std::copy(kv, kv + 8, keys.data<float>());
  for (int i = 0; i < 8; ++i) index.data<int32_t>()[i] = i;
  Tensor sorted(v1::DTYPE_F32, {8, 1}), perm(v1::DTYPE_I32, {8, 1});
  auto k = CreateSort({&keys, &index}, 0, 1, 0, sorted);
  auto a = CreateSort({&keys, &index}, 0, 1, 1, perm);
  ASSERT_TRUE(k.ok() && a.ok()) << k.status() << a.status();
  ASSERT_TRUE((*k)->Run().ok() && (*a)->Run().ok());
  EXPECT_EQ(std::vector<int32_t>(perm.data<int32_t>(), perm.data<int32_t>() + 8),
            (std::vector<int32_t>{7, 5, 2, 3, 0, 4, 1, 6}));
  EXPECT_FALSE(std::signbit(sorted.data<float>()[2]));
  EXPECT_TRUE(std::signbit(sorted.data<float>()[3]));
  EXPECT_TRUE(std::isnan(sorted.data<float>()[6]) && !std::signbit(sorted.data<float>()[6]));
  EXPECT_TRUE(std::isnan(sorted.data<float>()[7]) && std::signbit(sorted.data<float>()[7]));
  Tensor bf16(v1::DTYPE_BF16, {6, 1}), out(v1::DTYPE_BF16, {6, 1});
  EXPECT_FALSE(CreateSort({&bf16}, 0, 1, 0, out).ok()) << "2-byte operands are refused";
}

}  // namespace
}  // namespace meshrun
