"""cluster.jit runs JAX train steps on the cluster: the losses and parameters match jax.jit's."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import mesh_utils
from jax.lax import with_sharding_constraint
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import meshrun

STEPS = 20


class DotReluDot(nn.Module):
    """Seed 000's module (Flax's pjit guide), unchanged."""

    depth: int
    dense_init: callable = nn.initializers.xavier_normal()

    @nn.compact
    def __call__(self, x):
        y = nn.Dense(self.depth, kernel_init=nn.with_partitioning(self.dense_init, (None, "model")),
                     use_bias=False)(x)
        y = jax.nn.relu(y)
        y = with_sharding_constraint(y, P("data", "model"))
        W2 = self.param("W2", nn.with_partitioning(self.dense_init, ("model", None)),
                        (self.depth, x.shape[-1]))
        z = jnp.dot(y, W2)
        z = with_sharding_constraint(z, P("data", None))
        return z


class Biased(nn.Module):
    """A model beyond the seeds: biases, tanh and GELU-free MLP with LayerNorm-style rsqrt."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(32, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model")),
                     bias_init=nn.with_partitioning(nn.initializers.normal(0.1), ("model",)))(x)
        h = jnp.tanh(h)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-5)
        return nn.Dense(x.shape[-1], kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), ("model", None)))(h)


def make_step(model, tx):
    def train_step(state, x, y):
        params, opt_state = state

        def loss_fn(p):
            z = model.apply({"params": p}, x)
            return jnp.mean(optax.l2_loss(z, y))

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return train_step


def batches(dim, n=STEPS, batch=16):
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(batch, dim)).astype(np.float32), rng.normal(size=(batch, dim)).astype(np.float32))
            for _ in range(n)]


def run_case(cluster, model, dim, tx):
    mesh = Mesh(mesh_utils.create_device_mesh((2, 4)), ("data", "model"))
    x0 = jnp.ones((16, dim), jnp.float32)
    with jax.set_mesh(mesh):
        boxed = model.init(jax.random.PRNGKey(0), x0)["params"]
    param_spec = nn.get_partition_spec(boxed)
    params = jax.tree_util.tree_map(np.asarray, nn.unbox(boxed))
    opt_state = jax.tree_util.tree_map(np.asarray, tx.init(params))
    opt_spec = optax.tree_map_params(tx, lambda _, s: s, opt_state, param_spec,
                                     transform_non_params=lambda *_: P(), is_leaf=lambda x: isinstance(x, P))
    state_spec = (param_spec, opt_spec)
    step = make_step(model, tx)
    data = batches(dim)

    # Plain jax.jit on the local CPU: the reference.
    ref_state, ref_losses = (params, opt_state), []
    plain = jax.jit(step)
    with jax.set_mesh(mesh):
        for x, y in data:
            ref_state, loss = plain(ref_state, x, y)
            ref_losses.append(float(loss))
    # JAX's own sharded run on 8 emulated devices: how far sharding alone moves the result.
    shard = lambda spec: jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), spec, is_leaf=lambda s: isinstance(s, P))
    jax_step = jax.jit(step, in_shardings=(shard(state_spec), shard(P("data")), shard(P("data"))),
                       out_shardings=(shard(state_spec), shard(P())), donate_argnums=0)
    jax_state = jax.device_put((params, opt_state), shard(state_spec))
    with jax.set_mesh(mesh):
        for x, y in data:
            jax_state, _ = jax_step(jax_state, x, y)

    # The same code on the cluster: jax.jit -> cluster.jit.
    state = cluster.device_put((params, opt_state), state_spec)
    ours = cluster.jit(step, in_shardings=(state_spec, P("data"), P("data")),
                       out_shardings=(state_spec, P()), donate_argnums=0)
    losses = []
    with jax.set_mesh(mesh):
        for x, y in data:
            state, loss = ours(state, cluster.device_put(x, P("data")), cluster.device_put(y, P("data")))
            losses.append(float(np.asarray(loss)))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    got = jax.tree_util.tree_map(np.asarray, state[0])
    ref = jax.tree_util.tree_map(np.asarray, ref_state[0])
    jax_got = jax.tree_util.tree_map(np.asarray, jax_state[0])
    ours_diff = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)))
    jax_diff = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree_util.tree_leaves(jax_got), jax.tree_util.tree_leaves(ref)))
    print(f"final parameters vs plain jax.jit: meshrun {ours_diff:.3g}, JAX sharded {jax_diff:.3g}")
    assert ours_diff <= max(4 * jax_diff, 1e-6), (ours_diff, jax_diff)
    return ours


def test_seed_000_dot_relu_dot_with_adam_matches_jax(cluster):
    ours = run_case(cluster, DotReluDot(depth=64), 32, optax.adam(1e-2))
    assert ours.last_collectives, "the partitioner inserted no collective for a sharded model"


def test_a_model_beyond_the_seeds_with_adamw_matches_jax(cluster):
    run_case(cluster, Biased(), 16, optax.adamw(3e-3, weight_decay=1e-2))


def test_the_second_call_does_not_retrace(cluster):
    traces = []

    def f(x, y):
        traces.append(1)
        return jnp.sum(jnp.maximum(x @ y, 0.0), axis=0)

    fn = cluster.jit(f, out_shardings=P("model"))
    x = cluster.device_put(np.ones((8, 4), np.float32), P("data"))
    y = cluster.device_put(np.full((4, 8), 0.5, np.float32), P(None, "model"))
    for _ in range(3):
        out = fn(x, y)
    assert len(traces) == 1
    np.testing.assert_allclose(np.asarray(out), np.full(8, 16.0, np.float32))
    assert out.sharding.spec == P("model")


def test_donated_arguments_are_consumed(cluster):
    fn = cluster.jit(lambda s: s * 2.0, donate_argnums=0)
    a = cluster.device_put(np.ones(8, np.float32), P())
    b = fn(a)
    np.testing.assert_array_equal(np.asarray(b), np.full(8, 2.0, np.float32))
    with pytest.raises(RuntimeError, match="donated"):
        np.asarray(a)


def test_an_unsupported_primitive_is_named_with_the_users_line(cluster):
    fn = cluster.jit(lambda x: jnp.cumsum(x, axis=0))
    x = cluster.device_put(np.ones((8, 4), np.float32), P())
    with pytest.raises(meshrun.errors.UnsupportedPrimitiveError) as e:
        fn(x)
    assert "'cumsum'" in str(e.value) and "test_jit.py:" in str(e.value)
    assert isinstance(e.value, ValueError)


def test_an_argument_laid_out_otherwise_is_refused(cluster):
    fn = cluster.jit(lambda x: x + 1.0, in_shardings=P("data"))
    x = cluster.device_put(np.ones((8, 4), np.float32), P("model"))
    with pytest.raises(ValueError, match="in_sharding"):
        fn(x)
