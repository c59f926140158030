"""Reductions under cluster.jit beyond sum / max / min: jnp.prod (reduce_prod) over one and
several axes of odd and even sizes, in f32 and in wrapping int32, and its gradient; the
gradients of cumulative reductions, whose JVPs hold zero-size arrays; lax.cumlogsumexp; sums over a sharded dim
(partial sums until reduced) broadcast into arrays."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P


def test_products_and_their_gradient_match_jax(cluster):
    x = np.random.default_rng(5).uniform(0.5, 1.5, size=(8, 7)).astype(np.float32)

    def f(x):
        big = jnp.arange(1, 57, dtype=jnp.int32).reshape(8, 7) * 7919  # wraps, as XLA's int32
        return {"rows": jnp.prod(x, axis=1), "cols": jnp.prod(x, axis=0), "all": jnp.prod(x),
                "three": jnp.prod(x[:, :3], axis=1), "ints": jnp.prod(big, axis=0),
                "grad": jax.grad(lambda x: jnp.sum(jnp.prod(x[:, :5] - 1.0, axis=1)))(x)}

    want = jax.jit(f)(x)
    got = cluster.jit(f, in_shardings=P("data"), out_shardings=P())(cluster.device_put(x, P("data")))
    np.testing.assert_array_equal(np.asarray(got["ints"]), np.asarray(want["ints"]))
    for key in ("rows", "cols", "all", "three", "grad"):  # products rounded in another order: a few ulp
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), rtol=4e-6, err_msg=key)


def test_zero_size_intermediates_of_cumulative_gradients_match_jax(cluster):
    """The JVPs of cumprod / cummax / cummin slice down to zero-size arrays: no op holds them, a
    concatenation drops them, a pad of one is its padding, a reduction over one is its identity.
    A zero-size result is a zero-size array, as jax.jit returns it."""
    x = np.random.default_rng(0).uniform(0.5, 1.5, (4, 6)).astype(np.float32)

    def f(x):
        return {"cumprod_grad": jax.grad(lambda x: jnp.sum(jnp.cumprod(x, axis=1)))(x),
                "cummax_grad": jax.grad(lambda x: jnp.sum(jax.lax.cummax(x, axis=1) ** 2))(x),
                "cummin_grad": jax.grad(lambda x: jnp.sum(jax.lax.cummin(x, axis=0)))(x),
                "concat": jnp.concatenate([x[:, :0], x, x[:0, :].reshape(4, 0)], axis=1),
                "reduced": jnp.sum(x[:, :0], axis=1) + jnp.max(jnp.pad(x[:, :0], ((0, 0), (1, 2)), constant_values=3.0),
                                                              axis=1),
                "split": jnp.split(x, [0, 2], axis=1)[1] * 2}

    want = jax.jit(f)(x)
    got = cluster.jit(f, in_shardings=P("data"), out_shardings=P())(cluster.device_put(x, P("data")))
    for key in want:
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), rtol=2e-6, err_msg=key)
    empty = cluster.jit(lambda x: x[:, :0] * 2, out_shardings=P())(cluster.device_put(x, P()))
    assert (empty.shape, empty.dtype) == ((4, 0), np.float32)  # a zero-size result, as jax.jit's


def test_cumlogsumexp_and_its_gradient_match_jax(cluster):
    """lax.cumlogsumexp (and jax.nn's log-space cumulative sums) along a sharded and an unsharded
    dim, forward and reverse, with values near 1000 (no overflow) and -inf; bf16 computed in f32;
    and its gradient (JAX differentiates it as an associative scan: pads, slices and logaddexps)."""
    x = np.random.default_rng(7).normal(size=(8, 6)).astype(np.float32)
    x[1, :] += 1000.0
    x[2, 3] = -np.inf

    def f(x):
        return {"rows": jax.lax.cumlogsumexp(x, axis=1), "cols": jax.lax.cumlogsumexp(x, axis=0),
                "reverse": jax.lax.cumlogsumexp(x, axis=1, reverse=True),
                "bf16": jax.lax.cumlogsumexp(x.astype(jnp.bfloat16), axis=1).astype(jnp.float32),
                "grad": jax.grad(lambda x: jnp.sum(jnp.tanh(jax.lax.cumlogsumexp(x * 0.5, axis=0))))(x[3:])}

    want = jax.jit(f)(x)
    got = cluster.jit(f, in_shardings=P("data"), out_shardings=P())(cluster.device_put(x, P("data")))
    for key in ("rows", "cols", "reverse", "grad"):  # a sequential scan against XLA's tree: a few ulp
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), rtol=2e-6, atol=1e-6, err_msg=key)
    # bf16: XLA adds in bf16, meshrun in f32 rounded once; within bf16's rounding of the result.
    np.testing.assert_allclose(np.asarray(got["bf16"]), np.asarray(want["bf16"]), rtol=2e-2)


def test_sums_over_the_sharded_dim_combined_with_each_other_match_jax(cluster):
    """jnp.trace(x) + jnp.eye(8) @ x with x sharded over rows: a scalar and a [8, 12] array, each
    a partial sum over 'data' until reduced, broadcast together; jnp.where(s > t, s, t) over two
    partial sums, where the comparison and the select each reduce them."""
    x = np.random.default_rng(6).normal(size=(8, 12)).astype(np.float32)

    def f(x):
        y = jnp.trace(x[:, :8]) + jnp.eye(8) @ x
        z = jnp.sum(x) - jnp.ones((8, 8)) @ x
        return {"y": y, "z": z, "grad": jax.grad(lambda x: jnp.sum((jnp.trace(x[:, :8]) + jnp.eye(8) @ x) ** 2))(x)}

    def where(x):  # alone: each partial sum's only readers are the comparison and the select
        def pick(x):
            s, t = jnp.sum(x), jnp.sum(x, axis=0)
            return jnp.where(s > t, s, t)

        return {"where": pick(x), "where_grad": jax.grad(lambda x: jnp.sum(pick(x) ** 2))(x)}

    for fn in (f, where):
        want = jax.jit(fn)(x)
        got = cluster.jit(fn, in_shardings=(P("data"),), out_shardings=P())(cluster.device_put(x, P("data")))
        for k in want:
            np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-5, err_msg=k)
