"""Element-wise primitives under cluster.jit beyond the seeds': cbrt within an ulp of JAX's, with
its specials (signed zeros, infinities, NaN) as themselves, and its gradient; asinh, acosh,
lgamma and digamma (jax.scipy.special's gammaln and digamma) with their poles and gradients;
lax.reduce_precision to bf16's bits; bf16 arithmetic rounded to bf16 after every op, as XLA's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import meshrun


def test_cbrt_is_within_an_ulp_of_jax_and_keeps_its_specials(cluster):
    rng = np.random.default_rng(0)
    normal = rng.lognormal(0, 8, 4000) * np.sign(rng.normal(size=4000))
    specials = [0.0, -0.0, np.inf, -np.inf, np.nan, -8.0, 27.0]
    x = np.concatenate([normal, specials]).astype(np.float32)

    def f(x):
        return jnp.cbrt(x), jax.grad(lambda v: jnp.sum(jnp.cbrt(v)))(jnp.abs(x[:100]) + 1.0)

    (got, got_grad), (want, want_grad) = cluster.jit(f, out_shardings=P())(cluster.device_put(x, P())), jax.jit(f)(x)
    got, want = np.asarray(got), np.asarray(want)
    ulps = np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
    finite = np.isfinite(want)
    assert ulps[finite].max() <= 1, ulps[finite].max()
    np.testing.assert_array_equal(got[~finite], want[~finite])
    assert np.signbit(got[-6]) and got[-6] == 0.0  # cbrt(-0) = -0
    np.testing.assert_allclose(np.asarray(got_grad), np.asarray(want_grad), rtol=1e-6)


def test_inverse_hyperbolics_lgamma_and_digamma_with_their_gradients_match_jax(cluster):
    rng = np.random.default_rng(1)
    wide = rng.lognormal(0, 3, 2000) * np.sign(rng.normal(size=2000))
    poles = [0.0, -0.0, -1.0, -2.0, 1.0, 2.0, 0.5, 1e-30, -1e-30, 3e38, np.inf, -np.inf, np.nan]
    x = np.concatenate([wide, rng.uniform(-6, 6, 1000), poles]).astype(np.float32)

    def f(x):
        grads = jax.grad(lambda v: jnp.sum(jax.scipy.special.gammaln(v) + jnp.arcsinh(v) + jnp.arccosh(v + 1)))
        return (jnp.arcsinh(x), jnp.arccosh(jnp.abs(x) + 1), jax.scipy.special.gammaln(x),
                jax.scipy.special.digamma(x), grads(jnp.abs(x[:200]) + 0.25))

    got = cluster.jit(f, out_shardings=P())(cluster.device_put(x, P()))
    want = jax.jit(f)(x)
    for name, g, w in zip(["asinh", "acosh", "lgamma", "digamma", "gradient"], got, want):
        g, w = np.asarray(g), np.asarray(w)
        # XLA's lgamma is a Lanczos approximation (lgamma(1) is 4.8e-7, not 0) and its acosh
        # loses digits near 1; libm's are within an ulp: absolute agreement where values are small.
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=name)
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=name)
    assert np.isnan(np.asarray(got[3])[-13:-9]).all()  # digamma's poles 0, -0, -1, -2
    assert (np.asarray(got[2])[-13:-9] == np.inf).all()  # lgamma's


def test_reduce_precision_to_bf16_bits_matches_jax_bit_for_bit(cluster):
    """lax.reduce_precision(x, 8, 7), as mixed-precision code (jmp) casts: round to nearest even,
    ties and values past bf16's largest (to inf) included; its gradient, the same rounding of the
    cotangent; 8 and 23 bits leave f32 as it is; other widths are refused by name."""
    rng = np.random.default_rng(2)
    ties = (np.arange(64, dtype=np.uint32) << 16 | 0x8000).view(np.float32)  # halfway between bf16s
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.3961e38, 3.4e38, -3.4e38, 1e-38], np.float32)
    x = np.concatenate([rng.normal(size=999).astype(np.float32) * 100, ties, specials])

    def f(x):
        w = jnp.linspace(0.5, 1.5, 100)
        grad = jax.grad(lambda v: jnp.sum(jax.lax.reduce_precision(v, 8, 7) * w))(x[:100])
        return jax.lax.reduce_precision(x, 8, 7), jax.lax.reduce_precision(x, 8, 23), grad

    got = cluster.jit(f, out_shardings=P())(cluster.device_put(x, P("data")))
    want = jax.jit(f)(x)
    for name, g, w in zip(["bf16 bits", "f32 bits", "gradient"], got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
    with pytest.raises(meshrun.errors.UnsupportedPrimitiveError, match="exponent_bits=5, mantissa_bits=10"):
        cluster.jit(lambda v: jax.lax.reduce_precision(v, 5, 10))(cluster.device_put(x, P()))


def test_bf16_arithmetic_with_literals_rounds_every_op_as_jax(cluster):
    """Each bf16 op's result is rounded to bf16, as XLA's CPU rounds it, also where an operand is
    a Python literal held as f32 and where a unary op or erf_inv computes in f32: a chain of
    them equals jax.jit's bit for bit (without the rounding, 44 of these 1024 values kept f32
    digits and differed). A bf16 sigmoid (so SiLU) and exp2 run as JAX lowers them, 1 / (1 +
    exp(-x)) and exp(x * log 2), each step rounded (computed in f32 and rounded once, a quarter of
    the sigmoids differed by an ulp)."""

    def f(x):
        y = x.astype(jnp.bfloat16)
        z = jnp.maximum(-0.99, (y - 1.0) * 1.99609375 + 0.3)
        return (jax.lax.erf_inv(jnp.clip(z, -0.99, 0.99)) * 1.4140625, jnp.exp(z * 0.7) / 3.0, jnp.tanh(z) ** 2,
                jax.nn.sigmoid(z), jax.nn.silu(y), jnp.exp2(z))

    x = np.random.default_rng(2).uniform(0, 2, size=(64, 16)).astype(np.float32)
    got, want = cluster.jit(f)(cluster.device_put(x, P("data"))), jax.jit(f)(x)
    for g, w in zip(got, want):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype == jnp.bfloat16
        np.testing.assert_array_equal(g.view(np.uint16), w.view(np.uint16))


def test_a_bf16_products_rounding_stays_before_the_ops_that_read_it_as_jax(cluster):
    """A bf16 dot's result is rounded to bf16 before a bias add, a tanh or a GELU reads it, also
    where its contraction is split over 'model' (each device's part summed in f32, rounded once
    after the sum), as jax.jit computes it on one device: bit for bit. Before, the GEMM handed
    those ops its unrounded f32 accumulator (a quarter to a third of these values differed by an
    ulp or two), and a split contraction summed parts already rounded to bf16. A dot converted to
    f32 right away keeps its f32 accumulator, as XLA's does (to f32 rounding)."""
    bf = jnp.bfloat16
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    w = (rng.standard_normal((64, 48)) * 0.3).astype(np.float32)
    b = (rng.standard_normal((48,)) * 0.3).astype(np.float32)

    def f(x, w, b):
        y = jnp.dot(x.astype(bf), w.astype(bf))
        return (y + b.astype(bf), jnp.tanh(y), jax.nn.gelu(y * 2.0), jax.nn.relu(y) + 0.5,
                jnp.dot((x * 0.5).astype(bf), w.astype(bf)).astype(jnp.float32))

    want = jax.jit(f)(x, w, b)
    for w_spec in (P(), P(None, "model"), P("model", None)):
        got = cluster.jit(f, in_shardings=(P("data"), w_spec, P()), out_shardings=P())(
            cluster.device_put(x, P("data")), cluster.device_put(w, w_spec), cluster.device_put(b, P()))
        for i, (g, v) in enumerate(zip(got, want)):
            g, v = np.asarray(g), np.asarray(v)
            assert g.dtype == v.dtype, (w_spec, i)
            if v.dtype == jnp.bfloat16:
                np.testing.assert_array_equal(g.view(np.uint16), v.view(np.uint16), err_msg=f"{w_spec} result {i}")
            else:
                np.testing.assert_allclose(g, v, rtol=1e-6, atol=1e-6, err_msg=f"{w_spec}")


def test_clz_and_population_count_match_jax_on_every_integer_width(cluster):
    """lax.clz and lax.population_count (jnp.bitwise_count) of int32 / uint32 / uint8 / uint16,
    edge values included (0, -1, INT_MIN, INT_MAX): 32 leading zeros for 0, the narrow widths'
    counts within their own bits."""
    i32 = np.array([0, 1, -1, 2 ** 31 - 1, -2 ** 31, 256, 65535, 123456789, -987654321], np.int32)
    u8 = np.array([0, 1, 2, 127, 128, 255, 17, 64, 3], np.uint8)

    def f(a, b):
        u = a.view(jnp.uint32)
        u16 = u.astype(jnp.uint16)
        return (jax.lax.clz(a), jax.lax.population_count(a), jax.lax.clz(u), jnp.bitwise_count(u), jax.lax.clz(b),
                jnp.bitwise_count(b), jax.lax.clz(u16).astype(jnp.int32), jnp.bitwise_count(u16).astype(jnp.int32))

    want = jax.jit(f)(i32, u8)
    got = cluster.jit(f)(cluster.device_put(i32, P()), cluster.device_put(u8, P()))
    for k, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype, (k, g.dtype, w.dtype)
        np.testing.assert_array_equal(g, w, err_msg=str(k))


def test_special_functions_jax_lowers_in_python_match_jax(cluster):
    """bessel_i0e, igamma, igammac, igamma_grad_a, random_gamma_grad and
    regularized_incomplete_beta, which jax.jit lowers through JAX's own Python implementations
    (series and continued fractions in while loops), inlined: within f32 rounding of jax.jit."""
    rng = np.random.default_rng(5)
    x = (rng.random((4, 6)) * 6 + 0.05).astype(np.float32)
    a = (rng.random((4, 6)) * 4 + 0.2).astype(np.float32)
    z = (rng.normal(size=(4, 6)) * 10).astype(np.float32)

    def f(x, a, z):
        return {
            "i0": jnp.i0(z),
            "i0e": jax.scipy.special.i0e(z),
            "gammainc": jax.scipy.special.gammainc(a, x),
            "gammaincc": jax.scipy.special.gammaincc(a, x),
            "gammainc_grad": jax.grad(lambda q: jax.scipy.special.gammainc(q, x).sum())(a),
            "chi2_cdf": jax.scipy.stats.chi2.cdf(x, 3.0),
            "gamma_draw_grad": jax.grad(lambda q: jax.random.gamma(jax.random.key(0), q).sum())(a),
        }

    want = jax.jit(f)(x, a, z)
    got = cluster.jit(f)(*[cluster.device_put(v, P()) for v in (x, a, z)])
    for key in want:
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), rtol=2e-5, atol=1e-7, err_msg=key)
    betainc = lambda a, x: jax.scipy.special.betainc(a, a + 1, x / 7)  # noqa: E731
    got = cluster.jit(betainc, while_trips=256)(cluster.device_put(a, P()), cluster.device_put(x, P()))
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(betainc)(a, x)), rtol=2e-5, atol=1e-7)
    few = cluster.jit(betainc, while_trips=8)
    with pytest.raises(meshrun.errors.FailedPreconditionError, match="while_trips"):
        np.asarray(few(cluster.device_put(a, P()), cluster.device_put(x, P())))


def test_bessel_i1e_and_the_gradients_of_i0e_and_i1e_match_jax(cluster):
    """bessel_i1e, which XLA expands itself (Cephes' i1ef series), and what reaches it: jnp's i1,
    the gradients of i0e and i1e (each's JVP reads the other), in f32 and bf16, at 0, +-tiny,
    the series' seam at +-8 and far past it: within f32 rounding of jax.jit (bf16 to one ulp); and
    jnp.sign, whose -0 is -0 (i1e(-0) = sign(-0) * 0 reads it)."""
    rng = np.random.default_rng(9)
    z = np.concatenate([np.array([0.0, -0.0, 1e-30, -1e-7, 8.0, -8.0, 8.000001, 95.0, -300.0, 2.5e4]),
                        rng.normal(size=14) * 12]).astype(np.float32).reshape(4, 6)

    def f(z):
        return {
            "i1e": jax.scipy.special.i1e(z),
            "i1": jax.scipy.special.i1(z / 10),
            "i0e_grad": jax.grad(lambda q: jax.scipy.special.i0e(q).sum())(z),
            "i1e_grad": jax.grad(lambda q: jax.scipy.special.i1e(q).sum())(z),
            "i1e_bf16": jax.scipy.special.i1e(z.astype(jnp.bfloat16)).astype(jnp.float32),
            "sign": jnp.sign(z),
        }

    want = jax.jit(f)(z)
    got = cluster.jit(f)(cluster.device_put(z, P()))
    for key in want:
        rtol = 8e-3 if key.endswith("bf16") else 2e-5
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), rtol=rtol, atol=1e-7, err_msg=key)
    for key in ("i1e", "sign"):  # i1e(-0) = sign(-0) * 0 = -0, as lax.sign keeps a zero's sign
        assert np.array_equal(np.signbit(np.asarray(got[key])), np.signbit(np.asarray(want[key]))), key


def test_zeta_polygamma_and_the_gradient_of_digamma_match_jax(cluster):
    """zeta and polygamma, which XLA expands itself, and what reaches them: digamma's gradient
    (polygamma(1, x)), zeta's gradient in q, and XLA's special cases (NaN for x < 1 or a
    non-integer x at q <= 0; at an integer q <= 0 inf for an even x, else NaN; inf at x = 1;
    polygamma NaN for a fractional or negative n): within f32 rounding of jax.jit, NaN and inf
    where it has them."""
    rng = np.random.default_rng(13)
    x = np.concatenate([[1.0, 0.5, 2.0, 2.0, 3.0, 2.5, 1.5, 30.0],
                        rng.random(16) * 10 + 1]).astype(np.float32).reshape(4, 6)
    q = np.concatenate([[1.0, 1.0, 0.0, -2.0, -2.0, -3.5, 0.3, 2.0],
                        rng.random(16) * 5 + 0.01]).astype(np.float32).reshape(4, 6)
    n = np.array([0, 1, 2, 3, 1.5, -1] * 4, np.float32).reshape(4, 6)

    def f(x, q, n):
        v = jnp.abs(q) + 0.25
        return {
            "zeta": jax.scipy.special.zeta(x, q),
            "polygamma": jax.lax.polygamma(n, v),
            "trigamma": jax.scipy.special.polygamma(1, v),
            "digamma_grad": jax.grad(lambda t: jax.scipy.special.digamma(t).sum())(v),
            "zeta_grad_q": jax.grad(lambda t: jax.scipy.special.zeta(x + 1.5, t).sum())(v),
        }

    want = jax.jit(f)(x, q, n)
    got = cluster.jit(f)(*[cluster.device_put(a, P()) for a in (x, q, n)])
    for key in want:
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), rtol=2e-5, atol=1e-7,
                                   equal_nan=True, err_msg=key)
    assert np.isnan(np.asarray(want["zeta"])).any() and np.isinf(np.asarray(want["zeta"])).any()
