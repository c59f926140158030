"""jax.debug.print and jax.debug.callback in cluster.jit print and call what jax.jit does: once per
call, a cond branch's only when taken, a scan body's once per step in order, a shard_map body's
once per device with its block; the values they read leave nothing on the cluster."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshrun import errors
from jaxcompare import emulated_mesh
from clusterutil import listed




def printed(capsys):
    jax.effects_barrier()
    return capsys.readouterr().out.splitlines()


def test_prints_and_callbacks_run_as_under_jax_jit(cluster, capsys):
    seen = []

    def loss(x, key):
        jax.debug.print("sum {s:.3f} head {h}", s=x.sum(), h=x[:2, :2])
        y = jax.lax.cond(x.sum() > 0,
                         lambda v: (jax.debug.print("positive {}", v.max()), v * 2)[1],
                         lambda v: (jax.debug.print("negative {}", v.min()), -v)[1], x)
        jax.debug.callback(lambda a, b: seen.append((np.asarray(a).copy(), bool(b))), y.sum(0), x.sum() > 0)
        jax.debug.print("key {}", key)

        def step(c, xi):
            jax.debug.print("step {c} {xi}", c=c, xi=xi, ordered=True)
            return c + xi, None

        c, _ = jax.lax.scan(step, 0.0, x[:3, 0])
        return (y * 3).sum() + c

    rng = np.random.default_rng(0)
    key = jax.random.key(7)
    step = cluster.jit(jax.value_and_grad(loss))
    for x in (rng.normal(size=(8, 4)).astype(np.float32) + 1, rng.normal(size=(8, 4)).astype(np.float32) - 1):
        xs, ks = cluster.device_put(x, P("data", "model")), cluster.device_put(key)
        before = listed(cluster)
        value, grad = step(xs, ks)
        got_lines, got_seen = printed(capsys), list(seen)
        # The callbacks' values are not left on the cluster: only the results (and the constants
        # the first call uploads).
        consts = {a.id for c in step._cache.values() for a in c.consts}
        assert listed(cluster) - before - consts == {value.id, grad.id}
        seen.clear()
        want_value, want_grad = jax.jit(jax.value_and_grad(loss))(x, key)
        want_lines, want_seen = printed(capsys), list(seen)
        seen.clear()
        np.testing.assert_allclose(np.asarray(value), want_value, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5)
        # Only the branch taken printed; the ordered scan steps in order.
        assert any(line.startswith("positive" if x.sum() > 0 else "negative") for line in got_lines)
        assert not any(line.startswith("negative" if x.sum() > 0 else "positive") for line in got_lines)
        assert [s for s in got_lines if s.startswith("step")] == [s for s in want_lines if s.startswith("step")]
        assert sorted(got_lines) == sorted(want_lines)
        assert len(got_seen) == len(want_seen) == 1
        np.testing.assert_allclose(got_seen[0][0], want_seen[0][0], rtol=1e-5)
        assert got_seen[0][1] == want_seen[0][1] == (x.sum() > 0)


def test_a_shard_map_body_prints_once_per_device_with_its_block(cluster, capsys):
    mesh = emulated_mesh()

    def body(b):
        jax.debug.print("data {i} model {j} block {b}", i=jax.lax.axis_index("data"),
                        j=jax.lax.axis_index("model"), b=b.sum())
        jax.lax.cond(b.sum() > 100, lambda: jax.debug.print("big {}", b.sum()), lambda: None)
        return jax.lax.psum(b, ("data", "model"))

    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    with jax.set_mesh(mesh):
        fn = jax.shard_map(body, mesh=mesh, in_specs=P("data", "model"), out_specs=P())
        got = cluster.jit(fn)(cluster.device_put(x, P("data", "model")))
        got_lines = printed(capsys)
        want = jax.jit(fn)(jax.device_put(x, NamedSharding(mesh, P("data", "model"))))
        want_lines = printed(capsys)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert len([s for s in got_lines if s.startswith("data")]) == 8
    assert 0 < len([s for s in got_lines if s.startswith("big")]) < 8
    assert sorted(got_lines) == sorted(want_lines)


def test_a_failing_callback_raises_and_leaves_nothing_on_the_cluster(cluster):
    def boom(v):
        raise ValueError(f"callback saw {v}")

    def f(x):
        jax.debug.callback(boom, x.sum())
        return x * 2

    x = cluster.device_put(np.ones((8, 4), np.float32), P("data"))
    before = listed(cluster)
    with pytest.raises(ValueError, match="callback saw 32.0"):
        cluster.jit(f)(x)
    assert listed(cluster) == before
    np.testing.assert_array_equal(np.asarray(x), np.ones((8, 4)))  # the argument is still there


def test_a_partitioned_callback_outside_shard_map_is_refused_by_name(cluster):
    def f(x):
        jax.debug.callback(print, x, partitioned=True)
        return x

    with pytest.raises(errors.UnsupportedPrimitiveError, match="partitioned=True"):
        cluster.jit(f)(cluster.device_put(np.ones((8, 4), np.float32), P("data")))


def test_a_function_without_callbacks_has_no_extra_results(cluster):
    f = cluster.jit(lambda x: jnp.tanh(x) + 1)
    f(cluster.device_put(np.ones((8, 4), np.float32), P("data")))
    outputs = [op for op in f.last_program.ops if op.kind == op.OUTPUT]
    assert len(outputs) == 1


def test_a_function_without_results_returns_what_jax_jit_returns_and_still_prints(cluster, capsys):
    x = np.arange(4, dtype=np.float32)
    for fun in (lambda a: None, lambda a: (), lambda a: {"nothing": []}):
        assert cluster.jit(fun)(x) == jax.jit(fun)(x)
    on_cluster = cluster.device_put(x, P())
    assert cluster.jit(lambda a: None, donate_argnums=0)(on_cluster) is None

    def show(a):
        jax.debug.print("sum {s}", s=a.sum())

    assert cluster.jit(show)(x) is None
    assert printed(capsys) == ["sum 6.0"]


def test_an_unrolled_while_loop_prints_once_per_iteration(cluster, capsys):
    def f(x):
        def body(c):
            i, acc = c
            jax.debug.print("iteration {i} acc {a}", i=i, a=acc.sum(), ordered=True)
            jax.lax.cond(i % 2 == 1, lambda: jax.debug.print("odd {}", i, ordered=True), lambda: None)
            return i + 1, acc * 2

        # The trip count is worked out on the client while converting; that must not print.
        _, acc = jax.lax.while_loop(lambda c: c[0] < 4, body, (0, x))
        return acc

    x = np.ones((8, 4), np.float32)
    got = cluster.jit(f)(cluster.device_put(x, P("data")))
    got_lines = printed(capsys)
    want = jax.jit(f)(x)
    want_lines = printed(capsys)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got_lines == want_lines
    assert len(want_lines) == 6  # 4 iterations, 2 of them odd
