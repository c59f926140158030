"""Reductions under cluster.jit beyond sum / max / min: jnp.prod (reduce_prod) over one and
several axes of odd and even sizes, in f32 and in wrapping int32, and its gradient."""

import jax
import jax.numpy as jnp
import numpy as np
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
