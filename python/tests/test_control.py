"""lax.while_loop and fori_loop under cluster.jit: a trip count that follows from constants is
counted while converting and the body unrolled (results as jax.jit's); one that reads a traced
value is refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P


def test_while_loops_with_constant_trip_counts_match_jax(cluster):
    rng = np.random.default_rng(1)
    w = (rng.normal(size=(6, 6)) * 0.3).astype(np.float32)
    x = rng.normal(size=(8, 6)).astype(np.float32)

    def loops(w, x):
        n = 3
        return {
            "counter": jax.lax.while_loop(lambda s: s[0] < 4, lambda s: (s[0] + 1, jnp.tanh(s[1] @ w)), (0, x))[1],
            # a bound computed from constants (folded while converting): a while, not a scan
            "fori": jax.lax.fori_loop(0, jnp.int32(n) * 2, lambda i, c: c + jnp.sin(c) * i, x),
            "two_counters": jax.lax.while_loop(lambda s: (s[0] < 10) & (s[2] < 100.0),
                                               lambda s: (s[0] + 2, s[1] * 0.5 + 1, s[2] * 2.0),
                                               (jnp.int32(1), x, 1.0)),
            "never": jax.lax.while_loop(lambda s: s[0] > 0, lambda s: (s[0] - 1, s[1] * 2.0), (0, x))[1],
        }

    want = jax.jit(loops)(w, x)
    got = cluster.jit(loops, in_shardings=(P(), P("data")), out_shardings=P())(
        cluster.device_put(w, P()), cluster.device_put(x, P("data")))
    for g, v in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(v), rtol=1e-6, atol=1e-6)


def test_a_while_loop_whose_trip_count_reads_a_traced_value_is_refused(cluster):
    f = cluster.jit(lambda x: jax.lax.while_loop(lambda s: jnp.sum(s) < 100.0, lambda s: s * 2.0, x))
    with pytest.raises(Exception, match=r"'while' at .*test_control.py.*trip count that depends on traced"):
        f(cluster.device_put(np.ones((4, 4), np.float32), P()))
