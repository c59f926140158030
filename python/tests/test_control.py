"""lax.while_loop and fori_loop under cluster.jit: a trip count that follows from constants is
counted while converting and the body unrolled (results as jax.jit's); one that reads traced
values is unrolled to while_trips guarded iterations, and a call whose loop had not finished by
then fails naming the loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshrun import errors
from clusterutil import listed




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


def test_a_while_loop_whose_trip_count_reads_traced_values_runs_as_jax(cluster):
    """A loop until convergence, and a vmapped one (a predicate per element, each element
    iterating its own number of times): unrolled to while_trips iterations, each applied where
    the predicate held, as jax.jit's results."""

    def loops(x, a):
        doubled = jax.lax.while_loop(lambda s: jnp.sum(s) < 100.0, lambda s: s * 2.0, x)

        def newton(a):  # sqrt(a) to a relative tolerance, counting the steps
            return jax.lax.while_loop(lambda c: jnp.abs(c[0] * c[0] - a) > 1e-4 * a,
                                      lambda c: ((c[0] + a / c[0]) / 2, c[1] + 1), (a, 0))

        return doubled, jax.vmap(newton)(a)

    x = np.full((4, 4), 0.5, np.float32)
    a = np.linspace(1, 50, 8).astype(np.float32)
    got = cluster.jit(loops)(cluster.device_put(x, P("data")), cluster.device_put(a, P("data")))
    want = jax.jit(loops)(x, a)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)
    assert len(set(np.asarray(got[1][1]).tolist())) > 1  # the elements took different step counts


def test_a_loop_that_runs_past_while_trips_fails_naming_it_and_leaves_nothing(cluster):
    def grow(x):
        return jax.lax.while_loop(lambda s: jnp.sum(s) < 100.0, lambda s: s * 2.0, x) + 1

    small = cluster.device_put(np.full((4, 4), 1e-9, np.float32), P())
    before = listed(cluster)
    with pytest.raises(errors.FailedPreconditionError,
                       match=r"lax.while_loop at .*test_control.py:\d+ .* had not finished after the 16 iterations"):
        cluster.jit(grow)(small)
    assert listed(cluster) - before <= set()  # the failed call's results are deleted
    # With more iterations unrolled it finishes, as jax.jit's loop does.
    got = cluster.jit(grow, while_trips=40)(small)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(grow)(np.full((4, 4), 1e-9, np.float32))))
    with pytest.raises(errors.InvalidArgumentError, match="while_trips 0: expected an int in 1..1000"):
        cluster.jit(grow, while_trips=0)


def test_a_loop_in_a_branch_not_taken_is_not_checked(cluster):
    """A cond runs every branch on meshrun; a loop in the branch not taken may not finish (its
    inputs are not the ones it would get), which must not fail the call."""

    def f(x):
        return jax.lax.cond(jnp.sum(x) > 0, lambda v: v * 3.0,
                            lambda v: jax.lax.while_loop(lambda s: jnp.sum(s) < 100.0, lambda s: s * 2.0, v), x)

    # The loop would need 33 doublings from 1e-9 (past the 16 unrolled), but its branch is not taken.
    x = np.full((4, 4), 1e-9, np.float32)
    np.testing.assert_array_equal(np.asarray(cluster.jit(f)(cluster.device_put(x, P()))), x * 3.0)
    zeros = np.zeros((4, 4), np.float32)  # sum 0: the loop's branch is taken, and cannot finish
    with pytest.raises(errors.FailedPreconditionError, match="had not finished"):
        cluster.jit(f)(cluster.device_put(zeros, P()))


def test_a_nested_loop_that_runs_past_while_trips_in_one_outer_iteration_is_caught(cluster):
    """The inner loop's checks, one per unrolled outer iteration, are one result: the failure in
    the second outer iteration alone still fails the call, naming the inner loop."""

    def f(n):
        def outer(c):
            i, v = c
            target = jnp.where(i == 1, 2.0 ** 20, 2.0)  # 1 doubling, then 19
            v = jax.lax.while_loop(lambda s: s < target, lambda s: s * 2.0, v)  # the inner loop
            return i + 1, v

        return jax.lax.while_loop(lambda c: c[0] < n, outer, (0, jnp.float32(1.0)))[1]

    n = cluster.device_put(np.int32(2), P())
    with pytest.raises(errors.FailedPreconditionError, match=r"test_control.py:\d+ \(.*f.<locals>.outer\) had not"):
        cluster.jit(f)(n)
    np.testing.assert_array_equal(np.asarray(cluster.jit(f, while_trips=20)(n)), np.asarray(jax.jit(f)(np.int32(2))))


def test_select_n_of_more_than_two_cases_picks_as_jax(cluster):
    """lax.select_n over 3 to 5 cases, as jnp.select, jnp.piecewise and a vmapped lax.switch write
    it: f32, int32 past 2**24 and bool cases, an index out of range (the first case below 0, the
    last past the end, as JAX's lowering picks), and jnp.select's gradient; equal to jax.jit's."""
    x = np.linspace(-3, 3, 16, dtype=np.float32).reshape(2, 8)
    ints = np.array([[16777217, 16777216, -5, 2**30, -2**31, 7, 16777219, 3]] * 2, np.int32)
    exact = {
        "select": (lambda x: jnp.select([x < -1, x > 1, x == 0], [x * 2, x * 3, x + 7], 5.0), x),
        "select_int": (lambda x: jnp.select([x < 0, x > 16777216], [x + 1, x - 1], np.int32(9)), ints),
        "select_bool": (lambda x: jnp.select([x < -1, x > 1], [x < -2, x > 2], False), x),
        "piecewise": (lambda x: jnp.piecewise(x, [x < 0, x > 1], [lambda x: x * 2, lambda x: x * 3, 0.0]), x),
        "five": (lambda x: jax.lax.select_n((jnp.abs(x) * 2).astype(jnp.int32) % 5, x, x + 1, x * 2, -x, x * x), x),
        "out_of_range": (lambda x: jax.lax.select_n(jnp.arange(8, dtype=jnp.int32) * 2 - 5, x[0], x[0] + 1, x[0] * 2), x),
    }
    close = {
        "select_grad": lambda x: jax.grad(lambda x: jnp.sum(jnp.select([x < -1, x > 1, x == 0],
                                                                       [x * 2, x ** 3, x + 7], jnp.sin(x))))(x),
        "vmap_switch": lambda x: jax.vmap(lambda i, v: jax.lax.switch(i, [jnp.sin, jnp.cos, jnp.tanh, lambda v: v * 2], v))(
            jnp.arange(8) % 4, x[0]),
    }
    for name, (f, a) in exact.items():
        want = jax.jit(f)(a)
        got = np.asarray(cluster.jit(f, in_shardings=P("data"))(cluster.device_put(a, P("data"))))
        assert got.dtype == want.dtype, name
        np.testing.assert_array_equal(got, np.asarray(want), err_msg=name)
    for name, f in close.items():
        np.testing.assert_allclose(np.asarray(cluster.jit(f)(x)), np.asarray(jax.jit(f)(x)), rtol=2e-6, atol=1e-7,
                                   err_msg=name)
