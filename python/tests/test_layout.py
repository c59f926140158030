"""Stacking and unstacking under cluster.jit match JAX's bit for bit: jnp.stack and jnp.unstack
(JAX's stack and unstack primitives, each the other's transpose) along every axis, over a
sharded axis, in a rotary embedding's interleave and in the gradients."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P


def rotary(x):  # rotary position embedding as LLaMA-style models write it: interleaved pairs
    t, d = x.shape[-2], x.shape[-1]
    angle = jnp.arange(t)[:, None] / (10000.0 ** (jnp.arange(0, d, 2) / d))[None, :]
    x1, x2 = x[..., ::2], x[..., 1::2]
    s, c = jnp.sin(angle), jnp.cos(angle)
    return jnp.stack([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).reshape(x.shape)


def test_stack_and_unstack_along_every_axis_and_their_gradients_match_jax(cluster):
    rng = np.random.default_rng(11)
    x = rng.normal(size=(8, 6, 4)).astype(np.float32)
    w = rng.normal(size=(4, 4)).astype(np.float32)

    def f(x, w):
        rows = jnp.unstack(x, axis=0)  # 8 parts of [6, 4]: over the sharded axis
        mids = jnp.unstack(x, axis=1)  # 6 parts of [8, 4]
        h = rotary(x @ w)
        loss = lambda w: jnp.sum(rotary(x @ w) ** 2) + jnp.sum(jnp.stack(jnp.unstack(x @ w, axis=2), 1) ** 3)
        return {
            "rows": jnp.stack(rows[::-1], axis=0),
            "mids": jnp.stack(mids[1:4], axis=2),
            "one": jnp.unstack(x[:, :1], axis=1)[0],
            "rotary": h,
            "grad": jax.grad(loss)(w),
        }

    want = jax.jit(f)(x, w)
    got = cluster.jit(f, in_shardings=(P("data"), P()), out_shardings=P())(
        cluster.device_put(x, P("data")), cluster.device_put(w, P()))
    for k in want:
        g, wnt = np.asarray(got[k]), np.asarray(want[k])
        assert g.shape == wnt.shape, (k, g.shape, wnt.shape)
        if k in ("rotary", "grad"):  # sin, cos and the matmul round as oneDNN's, not Eigen's
            np.testing.assert_allclose(g, wnt, rtol=1e-5, atol=1e-5, err_msg=k)
        else:
            np.testing.assert_array_equal(g, wnt, err_msg=k)
