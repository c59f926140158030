"""Element-wise primitives under cluster.jit beyond the seeds': cbrt within an ulp of JAX's, with
its specials (signed zeros, infinities, NaN) as themselves, and its gradient."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P


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
