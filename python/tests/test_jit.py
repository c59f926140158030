"""cluster.jit runs JAX train steps on the cluster: the losses and parameters match jax.jit's."""

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import meshrun
from jaxcompare import compare, emulated_mesh
from meshrun.v1 import common_pb2, program_pb2
from meshrun.seeds import MLP, DotReluDot, NnxDotReluDot
from clusterutil import listed

STEPS = 20


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
            z = z[0] if isinstance(z, tuple) else z  # seed 000's block returns (z, None)
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
    mesh = emulated_mesh()
    x0 = jnp.ones((16, dim), jnp.float32)
    with jax.set_mesh(mesh):
        boxed = model.init(jax.random.PRNGKey(0), x0)["params"]
    param_spec = nn.get_partition_spec(boxed)
    params = jax.tree_util.tree_map(np.asarray, nn.unbox(boxed))
    opt_state = jax.tree_util.tree_map(np.asarray, tx.init(params))
    opt_spec = optax.tree_map_params(tx, lambda _, s: s, opt_state, param_spec,
                                     transform_non_params=lambda *_: P(), is_leaf=lambda x: isinstance(x, P))
    return compare(cluster, make_step(model, tx), (params, opt_state), (param_spec, opt_spec), batches(dim), mesh)


def test_seed_000_dot_relu_dot_with_adam_matches_jax(cluster):
    ours = run_case(cluster, DotReluDot(depth=64), 32, optax.adam(1e-2))
    assert ours.last_collectives, "the partitioner inserted no collective for a sharded model"


def test_seed_000_scanned_mlp_in_a_train_state_matches_jax(cluster):
    from flax.training import train_state

    mesh = emulated_mesh()
    model, optimizer = MLP(num_layers=4, depth=64), optax.adam(learning_rate=0.001)

    def init_fn(k, x, model, optimizer):  # the seed's
        variables = model.init(k, x)
        return train_state.TrainState.create(apply_fn=model.apply, params=variables["params"], tx=optimizer)

    with jax.set_mesh(mesh):
        boxed = init_fn(jax.random.PRNGKey(0), jnp.ones((8, 32)), model, optimizer)
    state_spec = nn.get_partition_spec(boxed)
    specs = jax.tree_util.tree_leaves(state_spec.params, is_leaf=lambda s: isinstance(s, P))
    assert P(None, None, "model") in specs and P(None, "model", None) in specs, specs  # layer dim first
    state = jax.tree_util.tree_map(np.asarray, nn.unbox(boxed))

    def train_step(state, x, y):  # the seed's fake loss, its value returned too
        def loss_unrolled(params):
            return model.apply({"params": params}, x).sum() + 0.0 * y.sum()

        loss, grads = jax.value_and_grad(loss_unrolled)(state.params)
        return state.apply_gradients(grads=grads), loss

    compare(cluster, train_step, state, state_spec, batches(32, n=10, batch=8), mesh)


class LogicalDotReluDot(nn.Module):
    """Seed 000's logical variant, as the seed writes it."""

    depth: int

    @nn.compact
    def __call__(self, x):
        W1 = self.param("W1", nn.with_logical_partitioning(nn.initializers.xavier_normal(), ("embed", "hidden")),
                        (x.shape[-1], self.depth))
        y = jax.nn.relu(jnp.dot(x, W1))
        y = nn.with_logical_constraint(y, ("batch", "hidden"))
        W2 = self.param("W2", nn.with_logical_partitioning(nn.initializers.xavier_normal(), ("hidden", "embed")),
                        (self.depth, x.shape[-1]))
        z = jnp.dot(y, W2)
        z = nn.with_logical_constraint(z, ("batch", "embed"))
        return z, None


class LogicalMLP(nn.Module):
    num_layers: int
    depth: int

    @nn.compact
    def __call__(self, x):
        x, _ = nn.scan(LogicalDotReluDot, length=self.num_layers, variable_axes={"params": 0},
                       split_rngs={"params": True}, metadata_params={nn.PARTITION_NAME: "layer"})(self.depth)(x)
        return x


def test_seed_000_logical_variant_initialised_on_the_cluster_and_trained_matches_jax(cluster):
    """nn.with_logical_partitioning + nn.logical_axis_rules: the state spec is the seed's, the
    cluster initialises the TrainState (cluster.jit(init_fn, out_shardings=logical_state_spec))
    with JAX's values, and training under the rules matches jax.jit."""
    from flax.training import train_state

    from test_random import assert_within_ulp

    mesh = emulated_mesh()
    rules = (("batch", "data"), ("hidden", "model"))
    model, optimizer = LogicalMLP(num_layers=2, depth=64), optax.adam(learning_rate=1e-2)

    def init_fn(k, x):  # the seed's, model and optimizer bound
        variables = model.init(k, x)
        return train_state.TrainState.create(apply_fn=model.apply, params=variables["params"], tx=optimizer)

    k, x = np.asarray(jax.random.PRNGKey(0)), np.ones((16, 32), np.float32)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        logical_spec = nn.get_partition_spec(jax.eval_shape(init_fn, k, x))
        state_spec = nn.logical_to_mesh(logical_spec, rules)
        ref = nn.unbox(jax.jit(init_fn)(k, x))
        state = cluster.jit(init_fn, in_shardings=(P(), P("data")), out_shardings=state_spec)(
            cluster.device_put(k, P()), cluster.device_put(x, P("data")))
    layer = logical_spec.params["ScanLogicalDotReluDot_0"]
    assert (layer["W1"], layer["W2"]) == (P("layer", "embed", "hidden"), P("layer", "hidden", "embed"))
    layer = state_spec.params["ScanLogicalDotReluDot_0"]
    assert (layer["W1"], layer["W2"]) == (P(None, None, "model"), P(None, "model", None))  # as the seed prints
    for ours, theirs in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(ref)):
        assert_within_ulp(ours, np.asarray(theirs))

    def train_step(state, x, y):
        def loss_fn(params):
            z = model.apply({"params": params}, x)
            return jnp.mean(optax.l2_loss(z, y))

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    # JAX's sharded run of this step is bitwise its unsharded one; meshrun's partial sums add in
    # another order, which Adam (lr 1e-2, 10 steps) amplifies to ~1e-5 of the parameters.
    with nn.logical_axis_rules(rules):
        compare(cluster, train_step, jax.tree_util.tree_map(np.asarray, ref), state_spec, batches(32, n=10), mesh,
                floor=5e-5)


def test_a_model_beyond_the_seeds_with_adamw_matches_jax(cluster):
    run_case(cluster, Biased(), 16, optax.adamw(3e-3, weight_decay=1e-2))


def test_seeds_002_003_nnx_dot_relu_dot_as_a_pure_function_matches_jax(cluster):
    mesh = emulated_mesh()
    with jax.set_mesh(mesh):
        model = NnxDotReluDot(64, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        graphdef, state = nnx.split((model, optimizer))
    specs = nnx.get_partition_spec(state)
    state = jax.tree_util.tree_map(np.asarray, state)

    def train_step(state, x, y):  # the seed's step, as a pure function over nnx.split state
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model):
            return jnp.mean((model(x) - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    compare(cluster, train_step, state, specs, batches(64, batch=8), mesh)


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


def test_in_and_out_shardings_longer_than_the_rank_are_refused_as_jax_jit_refuses_them(cluster):
    x = np.ones((8, 4), np.float32)
    on_cluster = cluster.device_put(x, P("data"))
    too_long = P("data", None, None)
    with pytest.raises(meshrun.errors.InvalidArgumentError,
                       match=r"in_sharding of argument array '.*': PartitionSpec .* has 3 entries but the "
                             r"value has rank 2"):
        cluster.jit(lambda a: a + 1, in_shardings=too_long)(on_cluster)
    with pytest.raises(meshrun.errors.InvalidArgumentError, match=r"device_put: .* has 3 entries"):
        cluster.jit(lambda a: a + 1, in_shardings=too_long)(x)  # a host array, put on the call
    with pytest.raises(meshrun.errors.InvalidArgumentError,
                       match=r"out_shardings of result 1: PartitionSpec .* has 2 entries but the value "
                             r"has rank 1 \(shape \[8\]\)"):
        cluster.jit(lambda a: (a, a.sum(1)), out_shardings=(P("data"), P("data", None)))(on_cluster)
    with pytest.raises(ValueError, match="rank at least 2"):  # what jax.jit says
        jax.jit(lambda a: (a, a.sum(1)), out_shardings=(NamedSharding(emulated_mesh(), P("data")),
                                                        NamedSharding(emulated_mesh(), P("data", None))))(x)
    out = cluster.jit(lambda a: a.sum(1), out_shardings=P("data"))(on_cluster)
    np.testing.assert_array_equal(np.asarray(out), np.full(8, 4.0, np.float32))


def test_zero_size_results_are_returned_as_jax_jit_returns_them(cluster):
    """jnp.zeros((0, 3)), an empty slice, an empty comparison or iota, an empty bf16 cast: no op
    computes them, yet jax.jit returns each with its shape and dtype (and out_sharding)."""
    x = np.arange(32, dtype=np.float32).reshape(8, 4)

    def f(a):
        return a + 1, jnp.zeros((0, 3)), a[:0] > 1, jnp.arange(8)[:0], a[:, 4:].astype(jnp.bfloat16)

    want = jax.jit(f)(x)
    fn = cluster.jit(f)
    for _ in range(2):  # the second call reuses the compiled program and its constants
        got = fn(x)
        for g, w in zip(got, want):
            assert (g.shape, g.dtype) == (w.shape, w.dtype)
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    # Laid out as out_shardings says, and usable as the next call's argument.
    empty = cluster.jit(lambda a: a[:0] * 2, out_shardings=P("data", None))(x)
    assert empty.shape == (0, 4) and empty.sharding.spec == P("data")
    again = cluster.jit(lambda e, a: (e + 1, a.sum() + e.sum()))(empty, x)
    assert again[0].shape == (0, 4)
    np.testing.assert_array_equal(np.asarray(again[1]), np.float32(x.sum()))


def test_results_without_out_shardings_are_laid_out_as_jax_jit_lays_them_out(cluster):
    """A result with no out_sharding gets the layout sharding propagation gives it, as XLA's does
    under jax.jit, so a step with in_shardings and no out_shardings takes its new state back."""
    mesh = emulated_mesh()

    def step(s, x):
        return s + x.sum(), (s * x).sum(), s.reshape(4, 4).T, jnp.outer(s, s)

    in_specs = (P("model"), P("data"))
    s0, x = np.arange(16, dtype=np.float32), np.ones((8, 16), np.float32)
    ref = jax.jit(step, in_shardings=tuple(NamedSharding(mesh, p) for p in in_specs))
    want = ref(jax.device_put(s0, NamedSharding(mesh, in_specs[0])), x)
    fn = cluster.jit(step, in_shardings=in_specs, donate_argnums=0)
    s = cluster.device_put(s0, P("model"))
    for i in range(3):
        donated_id = s.id
        out = fn(s, x)
        for got, w in zip(out, want if i == 0 else ()):
            assert got.sharding.spec == w.sharding.spec, (got.sharding.spec, w.sharding.spec)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(w))
        # the first call learns the layouts; from the second on the new state takes the donated
        # one's place (its id), as a TrainState is updated in place
        assert (out[0].id == donated_id) == (i > 0)
        s = out[0]
    np.testing.assert_array_equal(np.asarray(s), s0 + 3 * 128.0)


def test_donated_arguments_are_consumed(cluster):
    fn = cluster.jit(lambda s: s * 2.0, donate_argnums=0)
    a = cluster.device_put(np.ones(8, np.float32), P())
    b = fn(a)
    np.testing.assert_array_equal(np.asarray(b), np.full(8, 2.0, np.float32))
    with pytest.raises(RuntimeError, match="donated"):
        np.asarray(a)


def test_layouts_and_donations_worked_out_once_per_structure_hold_for_every_call(cluster):
    """cluster.jit works out each argument structure's in_shardings and donations once, and which
    donated array each result replaces once per compiled program: later calls must still refuse a
    misplaced argument, keep each structure's own specs, and free the donated arrays no result
    takes."""

    def step(s, x):
        return {"w": s["w"] + x, "n": s["n"] * 2.0}, jnp.sum(x)

    state_spec = {"w": P("data"), "n": P()}
    fn = cluster.jit(step, in_shardings=(state_spec, P("data")), out_shardings=(state_spec, P()),
                     donate_argnums=0)
    x = cluster.device_put(np.arange(8, dtype=np.float32), P("data"))
    state = cluster.device_put({"w": np.ones(8, np.float32), "n": np.ones(4, np.float32)},
                               {"w": P("data"), "n": P()})
    ids = {k: a.id for k, a in state.items()}
    for step in range(3):
        state, total = fn(state, x)
        # each result took its donated argument's place: the ids stay, nothing is left behind
        assert {k: a.id for k, a in state.items()} == ids
        assert not (set(ids.values()) - listed(cluster))
    np.testing.assert_array_equal(np.asarray(state["w"]), 1.0 + 3.0 * np.arange(8, dtype=np.float32))
    np.testing.assert_array_equal(np.asarray(state["n"]), np.full(4, 8.0, np.float32))
    assert float(np.asarray(total)) == 28.0
    misplaced = cluster.device_put(np.arange(8, dtype=np.float32), P())
    for _ in range(2):  # refused on every call, not only the one that worked the layout out
        with pytest.raises(meshrun.errors.InvalidArgumentError, match="is laid out as .* but its in_sharding"):
            fn(state, misplaced)
    # A donated argument that no result replaces (another shape, or another layout: w + x comes
    # back replicated without out_shardings) is consumed: the step succeeds and the cluster drops it.
    for fun in (lambda s: s[:4], lambda s: s + 1.0):
        other = cluster.jit(fun, in_shardings=P("data"), out_shardings=P(), donate_argnums=0)
        for _ in range(2):
            arg = cluster.device_put(np.ones(8, np.float32), P("data"))
            out = other(arg)
            assert arg.id not in listed(cluster) and out.id in listed(cluster)
            assert out.sharding.spec == P()


def test_keyword_arguments_static_argnames_and_donate_argnames_as_jax_jit_takes_them(cluster):
    traces = []

    def step(state, x, scale=1.0, train=True):
        traces.append(train)
        return (state + scale * x) if train else state, jnp.sum(x)

    fn = cluster.jit(step, static_argnames="train", donate_argnames=("state",))
    x = np.arange(8, dtype=np.float32)
    state = cluster.device_put(np.ones(8, np.float32), P())
    new_state, total = fn(state, x=x, scale=np.float32(2.0), train=True)
    np.testing.assert_array_equal(np.asarray(new_state), 1.0 + 2.0 * x)
    assert float(np.asarray(total)) == 28.0
    with pytest.raises(RuntimeError, match="donated"):  # donated by name
        np.asarray(state)
    kept, _ = fn(new_state, x, np.float32(2.0), train=False)  # a second trace for train=False
    np.testing.assert_array_equal(np.asarray(kept), 1.0 + 2.0 * x)
    assert traces == [True, False]
    with pytest.raises(ValueError, match="'steps' is not a parameter of step"):
        cluster.jit(step, static_argnames="steps")


def test_keyword_only_parameters_and_kwargs_as_jax_jit_takes_them(cluster):
    def step(state, x, scale=2.0, *, mode, offset, **extra):
        y = state * scale + x if mode == "mul" else state + x
        return y + offset + sum(extra.values()), jnp.sum(x)

    x = np.arange(8, dtype=np.float32)
    ref = jax.jit(step, static_argnames="mode", donate_argnames="offset")
    fn = cluster.jit(step, static_argnames="mode", donate_argnames="offset")
    for mode in ("mul", "add"):
        kw = dict(mode=mode, offset=np.float32(0.5), bias=np.ones(8, np.float32))
        want = ref(np.ones(8, np.float32), x, **kw)
        offset = cluster.device_put(np.float32(0.5), P())
        got = fn(cluster.device_put(np.ones(8, np.float32), P()), x, mode=mode, offset=offset,
                 bias=np.ones(8, np.float32))
        np.testing.assert_array_equal(np.asarray(got[0]), want[0])
        with pytest.raises(RuntimeError, match="donated"):  # a keyword-only parameter donated by name
            np.asarray(offset)
    # A static keyword-only parameter traces once per value; a parameter left to its default after
    # a static position is not passed at all.
    assert len(fn._cache) == 2
    fixed = cluster.jit(lambda a, k=3: a * k, static_argnums=1)
    np.testing.assert_array_equal(np.asarray(fixed(x)), 3 * x)
    np.testing.assert_array_equal(np.asarray(fixed(x, 4)), 4 * x)
    with pytest.raises(ValueError, match="pjit does not support kwargs"):  # as jax.jit refuses them
        cluster.jit(step, in_shardings=(P(), P()), static_argnames="mode")(x, x, mode="mul", offset=1.0)
    with pytest.raises(TypeError):  # a required keyword-only parameter left out
        fn(x, x, mode="mul")


def test_an_unsupported_primitive_is_named_with_the_users_line(cluster):
    fn = cluster.jit(lambda x: jnp.linalg.eigh(x + 1.0)[0])
    x = cluster.device_put(np.ones((4, 4), np.float32), P())
    with pytest.raises(meshrun.errors.UnsupportedPrimitiveError) as e:
        fn(x)
    assert "'eigh'" in str(e.value) and "test_jit.py:" in str(e.value)
    assert isinstance(e.value, ValueError)


def test_an_argument_laid_out_otherwise_is_refused(cluster):
    fn = cluster.jit(lambda x: x + 1.0, in_shardings=P("data"))
    x = cluster.device_put(np.ones((8, 4), np.float32), P("model"))
    with pytest.raises(ValueError, match="in_sharding"):
        fn(x)


def test_integer_arithmetic_is_exact_and_floor_division_and_modulo_match_jax(cluster):
    """int32 / uint32 arithmetic runs in integers (lax's wrapping, truncated div and rem, XLA's
    results for a zero divisor and INT_MIN / -1), exact beyond f32's 2**24, literals included;
    `//` and `%` (rem and its sign fix-up) on integers and floats."""

    def f(i, j, x):
        u = i.astype(jnp.uint32)
        return (jax.lax.div(i, j), jax.lax.rem(i, j), i // 3, i % 5, 100 // (j + 7), 7 - i,
                jnp.maximum(i, j) * 3 + 1, jax.lax.div(u, jnp.uint32(3)), u % jnp.uint32(10),
                x % 3.0, x // 2.5, jnp.fmod(x, -1.5), i + 100000001, jnp.where(i > 0, i, -2000000001))

    i = np.array([7, -7, 7, 100000001, -9, 5, -2147483648, 2147483647], np.int32)
    j = np.array([2, 2, -3, 3, 4, 0, -1, 16777217], np.int32)
    x = np.linspace(-7, 7, 8, dtype=np.float32)
    want = jax.jit(f)(i, j, x)
    got = cluster.jit(f)(cluster.device_put(i, P("data")), cluster.device_put(j, P("data")), x)
    for k, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype, (k, g.dtype, w.dtype)
        np.testing.assert_array_equal(g, w, err_msg=f"result {k}")

    # In a shard_map: integers gathered and permuted keep every bit; a psum of counts sums them.
    mesh = emulated_mesh()

    def local(i):
        moved = jax.lax.ppermute(i, "data", [(0, 1), (1, 0)])
        return jax.lax.all_gather(moved, "data", tiled=True), jax.lax.psum(jnp.sum(i > 0), "data")

    with jax.set_mesh(mesh):
        sm = jax.shard_map(local, mesh=mesh, in_specs=P("data"), out_specs=(P("data"), P()))
        want = jax.jit(sm)(i)
        got = cluster.jit(sm)(cluster.device_put(i, P("data")))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_integer_powers_stay_integers_and_an_integer_dot_is_refused_by_name(cluster):
    """i ** 3 on int32 wraps in int32 as XLA's does (before: an f32 result, rounded above
    2**24); an integer dot_general, which f32 GEMMs would round, is refused with its line."""
    i = np.array([3, -7, 1000, 2000, 46341, -2147483648, 0, 1], np.int32)

    def powers(a):
        return a ** 3, a ** 2, a ** 0, jnp.uint32(7) ** 5 + a.astype(jnp.uint32) ** 2

    want = jax.jit(powers)(i)
    got = cluster.jit(powers)(cluster.device_put(i, P("data")))
    for k, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype, (k, g.dtype, w.dtype)
        np.testing.assert_array_equal(g, w, err_msg=f"result {k}")
    with pytest.raises(meshrun.errors.UnsupportedPrimitiveError, match=r"dot_general.*test_jit.py:\d+.*integer \(int32\) product"):
        cluster.jit(lambda a: a.reshape(2, 4) @ a.reshape(4, 2))(i)


def test_flips_reversed_scans_and_their_gradients_match_jax_bit_for_bit(cluster):
    """jax.lax.rev (jnp.flip, x[::-1], cumsum(reverse=True)'s transpose, a bidirectional
    scan's input) over sharded and unsharded dims, f32, int32 and bf16; and bool xor."""
    x = np.random.default_rng(5).normal(size=(8, 12)).astype(np.float32)
    x[0, 0] = -0.0
    i = np.arange(96, dtype=np.int32).reshape(8, 12) * 1000003

    def f(a, n):
        b = a.astype(jnp.bfloat16)
        return (jnp.flip(a), a[::-1], a[:, ::-1], jnp.flip(n, axis=1), jnp.flip(b, axis=0),
                jnp.cumsum(a[:, ::-1], axis=1), jnp.logical_xor(a > 0, n % 3 == 0))

    def loss(a):  # rev and a reverse cumsum inside the gradient
        return jnp.sum(jax.lax.cumsum(jnp.flip(a, axis=0), axis=0, reverse=True) ** 2)

    want = jax.jit(f)(x, i) + (jax.jit(jax.grad(loss))(x),)
    for spec in (P(), P("data", "model"), P("model", None)):
        xs, ns = cluster.device_put(x, spec), cluster.device_put(i, spec)
        got = cluster.jit(f)(xs, ns) + (cluster.jit(jax.grad(loss))(xs),)
        for k, (g, w) in enumerate(zip(got, want)):
            g, w = np.asarray(g), np.asarray(w)
            assert g.dtype == w.dtype, (k, spec, g.dtype, w.dtype)
            if k < 5:  # moves only: every bit, -0.0 included
                np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8), err_msg=f"result {k}, {spec}")
            else:
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=f"result {k}, {spec}")


def test_indexed_updates_at_set_add_multiply_min_max_and_tile_match_jax(cluster):
    """x.at[...] updates of one window at one index (scatter, scatter-add / -mul / -min / -max):
    constant, traced and negative indices, a slice window, an index out of bounds (the update
    dropped, as jnp's default mode does), int32, a 3-D bf16 operand, inside a gradient; and
    jnp.tile. Sharded and replicated operands, against jax.jit."""
    x = np.random.default_rng(6).normal(size=(8, 16)).astype(np.float32)
    n = np.arange(128, dtype=np.int32).reshape(8, 16) * 1000003
    c = np.random.default_rng(7).normal(size=(4, 8, 6)).astype(np.float32)

    def f(a, m, b, i):
        return (a.at[0, 3].set(7.0), a.at[i].set(jnp.ones(16)), a.at[-1].set(2.0), a.at[i, 2:5].add(1.0),
                a.at[i + 10].add(1.0), a.at[i + 100, 3].set(5.0), a.at[i, 4].multiply(3.0), a.at[2].max(0.0),
                a.at[:, 5].min(0.0), m.at[i, 1].set(100000001), m.at[i - 9].add(1),
                jax.lax.dynamic_update_slice(b, jnp.ones((1, 3, 1)), (1, i, 2)).astype(jnp.bfloat16).at[1, 2:5, i].add(0.5), jnp.tile(a, (2, 3)), jnp.tile(m[0], (3,)),
                jax.grad(lambda v: jnp.sum(v.at[i, 2:5].set(0.5) ** 2 + v.at[i].add(v[0]) ** 2))(a))

    i = np.int32(3)
    want = jax.jit(f)(x, n, c, i)
    for spec in (P(), P("data", "model")):
        got = cluster.jit(f)(cluster.device_put(x, spec), cluster.device_put(n, spec), c, i)
        for k, (g, w) in enumerate(zip(got, want)):
            g, w = np.asarray(g), np.asarray(w)
            assert g.dtype == w.dtype, (k, spec, g.dtype, w.dtype)
            np.testing.assert_array_equal(g, w, err_msg=f"result {k}, {spec}")


def test_integers_beyond_float_precision_compare_reduce_scan_gather_and_convert_as_jax(cluster):
    """int32 / uint32 values past 2**24 (and past 2**31 for uint32), where f32 would make
    2**24 + 1 equal 2**24: comparisons, neg / abs (wrapping), sum (wrapping) / max / min over a
    sharded dim (integer psum / pmax), cumsum, take_along_axis and jnp.take, and f32 -> int
    conversions saturating as XLA's (NaN to 0)."""
    a = np.array([[16777217, 16777216, -16777217, 2147483647, -2147483648, 100000001, 100000000, 3]] * 2,
                 np.int32) + np.arange(2, dtype=np.int32)[:, None]
    u = np.array([[4294967295, 4294967294, 2147483648, 2147483649, 16777217, 16777216, 0, 1]] * 2, np.uint32)
    x = np.array([[np.nan, np.inf, -np.inf, 3e9, -3e9, 5e9, -1.0, 4.7]] * 2, np.float32)

    def f(a, u, x):
        return (a == 16777216, a < a[:, ::-1], u > u[:, ::-1], -a, jnp.abs(a), jnp.sum(a, axis=1),
                jnp.sum(a[:, :2]), jnp.max(a, axis=1), jnp.min(a, axis=1), jnp.max(u, axis=1), jnp.min(u),
                jnp.cumsum(a, axis=1), jnp.take_along_axis(a, jnp.argsort(a, axis=1), axis=1),
                jnp.take(a, jnp.array([[1], [0]]), axis=0), x.astype(jnp.int32), x.astype(jnp.uint32),
                jnp.argmax(a[:, 5:7][:, ::-1], axis=1), jnp.argmin(a[:, 5:7], axis=1), jnp.argmax(u, axis=1))

    want = jax.jit(f)(a, u, x)
    for spec in (P(), P("data", "model")):
        got = cluster.jit(f)(cluster.device_put(a, spec), cluster.device_put(u, spec), cluster.device_put(x, spec))
        for k, (g, w) in enumerate(zip(got, want)):
            g, w = np.asarray(g), np.asarray(w)
            assert g.dtype == w.dtype, (k, spec, g.dtype, w.dtype)
            np.testing.assert_array_equal(g, w, err_msg=f"result {k}, {spec}")


def test_gathers_read_the_fill_value_or_clamp_an_out_of_range_index_as_jax(cluster):
    """An index out of range: jnp's default mode reads NaN (the integer fill for int32), so an
    integer-label cross-entropy with a label C is NaN as under jax.jit, not a finite wrong
    loss; mode="clip" clamps it. take_along_axis, jnp.take of rows, with the gradient."""
    x = np.random.default_rng(8).normal(size=(8, 16)).astype(np.float32)
    lab = np.array([3, -1, 15, 16, 0, 7, -5, 2], np.int32)
    emb = np.random.default_rng(9).normal(size=(8, 4)).astype(np.float32)
    ids = np.array([[1, 9], [-1, 2]], np.int32)
    n = np.arange(128, dtype=np.int32).reshape(8, 16) * 1000003

    def f(x, lab, n):
        ce = lambda v: optax.softmax_cross_entropy_with_integer_labels(v, lab)
        return (ce(x), jnp.take_along_axis(x, lab[:, None], axis=1, mode="clip"), jnp.take(emb, ids, axis=0),
                jnp.take(emb, ids, axis=0, mode="clip"), jnp.take_along_axis(n, lab[:, None], axis=1),
                jax.grad(lambda v: jnp.sum(jnp.where(lab >= 0, ce(v), 0.0)))(x))

    want = jax.jit(f)(x, lab, n)
    got = cluster.jit(f)(cluster.device_put(x, P("data", "model")), lab, cluster.device_put(n, P("data", None)))
    for k, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype, (k, g.dtype, w.dtype)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"result {k}")
    # (jnp wraps -1 and -5 to 15 and 11 first; 16 is out of range)
    assert np.flatnonzero(np.isnan(np.asarray(got[0]))).tolist() == [3]


def test_shard_map_under_jax_make_mesh_explicit_axes_with_pmin_and_integer_collectives(cluster):
    """jax.make_mesh's mesh has Explicit axes: a shard_map checks its in_specs against the
    arguments' types, so cluster.jit traces them with their layouts, as jax.jit's arguments
    carry them. Integer psum / pmax / psum_scatter run in integers past 2**24 (a sum wraps), and
    pmin is -pmax(-x) (~pmax(~x) for integers)."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    a = np.arange(8 * 16, dtype=np.int32).reshape(8, 16) * 16777259
    x = np.random.default_rng(10).normal(size=(8, 16)).astype(np.float32)

    def local(a, x):
        return (jax.lax.psum(a, "model"), jax.lax.pmax(a.astype(jnp.uint32), "model"),
                jax.lax.pmin(a, ("data", "model")), jax.lax.pmin(x, "model"),
                jax.lax.psum_scatter(a, "model", scatter_dimension=1, tiled=True), jax.lax.pmean(x, "data"))

    sm = jax.shard_map(local, mesh=mesh, in_specs=(P("data", "model"), P("data", "model")),
                       out_specs=(P("data"), P("data"), P(), P("data"), P("data", "model"), P(None, "model")))
    with jax.set_mesh(mesh):
        put = lambda v: jax.device_put(v, NamedSharding(mesh, P("data", "model")))  # noqa: E731
        want = jax.jit(sm)(put(a), put(x))
        got = cluster.jit(sm)(cluster.device_put(a, P("data", "model")), cluster.device_put(x, P("data", "model")))
    for k, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype, (k, g.dtype, w.dtype)
        np.testing.assert_array_equal(g, w, err_msg=f"result {k}")


def test_a_nan_survives_relu_max_min_argmax_and_pmax_as_under_jax(cluster):
    """lax.max / min keep a NaN whichever side it is on (XLA's semantics), so a diverged value is
    not hidden: relu, jnp.maximum / minimum, jnp.max / min over any axis, cummax, argmax and
    argmin (the first NaN's index) and a shard_map's pmax, on sharded operands; comparisons,
    sign, top_k and atan2 with NaN as XLA's."""
    x = np.arange(64, dtype=np.float32).reshape(8, 8) - 20.0
    x[3, 5] = x[6, 0] = x[0, 7] = np.nan

    def f(a):
        return (jax.nn.relu(a), jnp.maximum(0.5, a), jnp.minimum(a, 0.5), jnp.max(a, axis=0),
                jnp.min(a, axis=1), jnp.max(a), jax.lax.cummax(a, axis=1), jnp.argmax(a, axis=1),
                jnp.argmin(a, axis=0), jnp.clip(a, -3.0, 3.0),
                # comparisons are IEEE's (false with a NaN but for !=), sign(NaN) is NaN, top_k
                # ranks NaN first, and relu's gradient at NaN is 0
                jnp.where(a > 0, 1.0, -1.0), jnp.where(a >= 1, a, 0.0), (a != a).astype(jnp.float32),
                jnp.sign(a), jax.lax.top_k(a, 3)[0], jax.lax.top_k(a, 3)[1], jnp.arctan2(a, 2.0 - a),
                jax.grad(lambda v: jnp.sum(jax.nn.relu(v)))(a))

    want = jax.jit(f)(x)
    for spec in (P(), P("data", "model")):
        got = cluster.jit(f)(cluster.device_put(x, spec))
        for k, (g, w) in enumerate(zip(got, want)):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"result {k}, {spec}")

    mesh = emulated_mesh()
    with jax.set_mesh(mesh):
        sm = jax.shard_map(lambda a: jax.lax.pmax(a, "data"), mesh=mesh, in_specs=P("data", "model"),
                           out_specs=P(None, "model"))
        want = jax.jit(sm)(jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data", "model"))))
        got = cluster.jit(sm)(cluster.device_put(x, P("data", "model")))
    # pmax keeps the NaN as well, as lax.max does; XLA:CPU's all-reduce on emulated devices does
    # not always (it returned 19 for max(NaN, 19) here), so only the other elements are JAX's.
    got, want = np.asarray(got), np.array(want)
    nan_at = [(0, 7), (2, 0), (3, 5)]  # x's NaNs [0, 7], [6, 0], [3, 5], rows mod 4
    assert sorted(map(tuple, np.argwhere(np.isnan(got)))) == nan_at
    for r, c in nan_at:
        want[r, c] = np.nan
    np.testing.assert_array_equal(got, want)


def test_layer_norm_softmax_gelu_clip_sign_isfinite_and_argmax_match_jax(cluster):
    def f(x, w):
        h = jax.nn.gelu(x @ w)
        h = (h - jnp.mean(h, axis=-1, keepdims=True)) * jax.lax.rsqrt(jnp.var(h, axis=-1, keepdims=True) + 1e-6)
        p = jax.nn.softmax(h, axis=-1)
        return (p, jnp.clip(h, -0.5, 0.5), jnp.sign(h), jnp.isfinite(jnp.log(h)), h[2:6, 1:3], jnp.where(h > 0, h, -jnp.inf),
                jnp.argmax(h, axis=1), jnp.argmin(h, axis=0))

    rng = np.random.default_rng(3)
    x = rng.normal(size=(8, 16)).astype(np.float32)
    w = rng.normal(size=(16, 12)).astype(np.float32)
    want = jax.jit(f)(x, w)
    fn = cluster.jit(f, out_shardings=(P("data"), P("data"), P(), P(), P(), P(), P(), P()))
    got = fn(cluster.device_put(x, P("data")), cluster.device_put(w, P(None, "model")))
    for g, wnt in zip(got, want):
        g = np.asarray(g)
        np.testing.assert_allclose(g, np.asarray(wnt).astype(g.dtype), rtol=2e-5, atol=2e-6)
    assert np.asarray(got[6]).dtype == np.int32
    assert np.isneginf(np.asarray(got[5])).any(), "select keeps -inf where the mask is off"
    finite = np.asarray(got[3])
    assert 0 < finite.sum() < finite.size, "log of negative values is NaN, of positive ones finite"


def test_bools_integers_scalars_and_literals_keep_their_dtypes(cluster):
    mask = cluster.device_put(np.arange(8) % 3 == 0, P("data"))
    assert mask.dtype == np.bool_
    x = cluster.device_put(np.arange(8, dtype=np.float32), P("data"))

    def f(x, mask, s):
        return (x > 3) & ~mask, jnp.where(mask, x * s, -x).astype(jnp.int32) + 1, 1.5, None

    got = cluster.jit(f)(x, mask, 2.0)
    want = jax.jit(f)(np.arange(8, dtype=np.float32), np.arange(8) % 3 == 0, 2.0)
    for g, w in zip(got[:3], want[:3]):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype, (g.dtype, w.dtype)
        np.testing.assert_array_equal(g, w)
    assert got[3] is None


def test_concatenate_pad_slices_and_libm_functions_with_their_gradients_match_jax(cluster):
    """A model beyond the seeds: exact GELU (erf), sinusoidal features, a split and a concatenate,
    whose gradients hold pad (the transpose of slice) and slices."""

    def loss(w, x):
        h = x @ w
        a, b = h[:, :6], h[:, 6:]
        feats = jnp.concatenate([jax.nn.gelu(a, approximate=False), jnp.sin(b) * jnp.cos(b)], axis=1)
        padded = jnp.pad(feats, ((0, 0), (2, 1)), constant_values=0.5)
        return jnp.mean(padded ** 2) + jnp.mean(jnp.floor(h) + jnp.round(h) + jnp.log1p(jnp.abs(h)))

    rng = np.random.default_rng(4)
    w = rng.normal(size=(16, 12)).astype(np.float32)
    x = rng.normal(size=(8, 16)).astype(np.float32)
    step = jax.value_and_grad(loss)
    want_loss, want_grad = jax.jit(step)(w, x)
    got_loss, got_grad = cluster.jit(step, out_shardings=(P(), P(None, "model")))(
        cluster.device_put(w, P(None, "model")), cluster.device_put(x, P("data")))
    np.testing.assert_allclose(np.asarray(got_loss), np.asarray(want_loss), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got_grad), np.asarray(want_grad), rtol=1e-4, atol=1e-6)


def test_integer_label_cross_entropy_and_an_embedding_with_their_gradients_match_jax(cluster):
    """take_along_axis (optax's integer-label cross-entropy) and jnp.take of embedding rows, for a
    vector of ids and for a [batch, time] array of them (nn.Embed's), and their transposes
    (scatter-add) in the gradients."""

    def loss(table, w, ids, labels, tokens):
        e = jnp.take(table, ids, axis=0)  # [8, 16] rows of a [20, 16] embedding
        e = e + jnp.take(table, tokens, axis=0).mean(axis=1)  # [8, 5, 16] rows, averaged over time
        logits = e @ w
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return ce + 0.1 * jnp.take_along_axis(logits, labels[:, None], axis=1).mean()

    rng = np.random.default_rng(5)
    table = rng.normal(size=(20, 16)).astype(np.float32)
    w = rng.normal(size=(16, 12)).astype(np.float32)
    ids = rng.integers(0, 20, size=8).astype(np.int32)
    labels = rng.integers(0, 12, size=8).astype(np.int32)
    tokens = rng.integers(0, 20, size=(8, 5)).astype(np.int32)
    step = jax.value_and_grad(loss, argnums=(0, 1))
    want_loss, want = jax.jit(step)(table, w, ids, labels, tokens)
    got_loss, got = cluster.jit(step, out_shardings=(P(), (P(), P(None, "model"))))(
        cluster.device_put(table, P()), cluster.device_put(w, P(None, "model")),
        cluster.device_put(ids, P("data")), cluster.device_put(labels, P("data")),
        cluster.device_put(tokens, P("data")))
    np.testing.assert_allclose(np.asarray(got_loss), np.asarray(want_loss), rtol=1e-5)
    for g, wnt in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(wnt), rtol=1e-4, atol=1e-6)


def test_integer_label_cross_entropy_over_batch_and_time_matches_jax(cluster):
    """A language model's loss: optax's integer-label cross-entropy over [batch, time, vocab]
    logits (take_along_axis with two batching dims) and its gradient."""

    def loss(logits, labels):
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    rng = np.random.default_rng(9)
    logits = rng.normal(size=(4, 6, 12)).astype(np.float32)
    labels = rng.integers(0, 12, size=(4, 6)).astype(np.int32)
    step = jax.value_and_grad(loss)
    want_loss, want_grad = jax.jit(step)(logits, labels)
    got_loss, got_grad = cluster.jit(step)(cluster.device_put(logits, P("data")), cluster.device_put(labels, P("data")))
    np.testing.assert_allclose(np.asarray(got_loss), np.asarray(want_loss), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got_grad), np.asarray(want_grad), rtol=1e-4, atol=1e-7)


def test_gradient_accumulation_with_optax_multisteps_and_apply_if_finite_matches_jax(cluster):
    """optax.MultiSteps (a lax.cond whose results include int32 counters), apply_if_finite
    (jnp.all over jnp.stack of per-leaf checks: reduce_and, stack) and a one-cycle schedule."""
    tx = optax.MultiSteps(optax.apply_if_finite(optax.adamw(optax.cosine_onecycle_schedule(20, 1e-2)), 3),
                          every_k_schedule=3)
    rng = np.random.default_rng(10)
    params = {"w": rng.normal(size=(8, 4)).astype(np.float32), "b": np.zeros(4, np.float32)}
    x, y = rng.normal(size=(8, 8)).astype(np.float32), rng.normal(size=(8, 4)).astype(np.float32)

    def step(params, opt, x, y):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) - y) ** 2))(params)
        updates, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, updates), opt, loss, jnp.any(jnp.stack([loss > 10.0, loss < 0.0]))

    want, ref = [], (params, tx.init(params))
    plain = jax.jit(step)
    for _ in range(7):
        *ref, loss, _ = plain(*ref, x, y)
        want.append(float(loss))
    ours = cluster.jit(step, donate_argnums=(0, 1))
    state, got = (cluster.device_put(params, P()), cluster.device_put(tx.init(params), P())), []
    for _ in range(7):
        *state, loss, odd = ours(*state, x, y)
        got.append(float(np.asarray(loss)))
        assert not bool(np.asarray(odd))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(state[1].mini_step), np.asarray(ref[1].mini_step))
    np.testing.assert_allclose(np.asarray(state[0]["w"]), np.asarray(ref[0]["w"]), rtol=1e-5, atol=1e-6)


class _Rematted(nn.Module):
    """Flax's nn.remat and jax.checkpoint (the primitives 'remat2' / 'checkpoint'): their bodies
    run inlined, recomputed in the backward pass as JAX would."""

    @nn.compact
    def __call__(self, x):
        x = nn.remat(nn.Dense)(32)(x)
        x = jax.checkpoint(nn.gelu)(x)
        return nn.Dense(4)(x)


def test_rematerialised_layers_and_their_gradients_match_jax(cluster):
    model = _Rematted()
    x = np.random.default_rng(7).normal(size=(8, 16)).astype(np.float32)
    params = model.init(jax.random.key(0), x)["params"]

    def loss(params, x):
        return jnp.mean(model.apply({"params": params}, x) ** 2)

    step = jax.value_and_grad(loss)
    want_loss, want = jax.jit(step)(params, x)
    got_loss, got = cluster.jit(step)(cluster.device_put(params, P()), cluster.device_put(x, P("data")))
    np.testing.assert_allclose(np.asarray(got_loss), np.asarray(want_loss), rtol=1e-5)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6)


class _TinyLm(nn.Module):
    """A one-block language model: nn.Embed of [batch, time] tokens, self-attention (batched
    dot_generals, softmax), LayerNorm and an MLP, next-token log-likelihood over one_hot targets."""
    vocab: int = 24

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, 16)(tokens)
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16, deterministic=True)(h, h)
        x = x + nn.Dense(16)(nn.relu(nn.Dense(32)(nn.LayerNorm()(x))))
        return nn.Dense(self.vocab)(x)


def test_a_small_language_model_with_self_attention_trains_as_under_jax(cluster):
    model, tx = _TinyLm(), optax.adam(3e-3)
    tokens = np.random.default_rng(6).integers(0, 24, size=(8, 7)).astype(np.int32)
    params = model.init(jax.random.key(0), tokens)["params"]

    def step(params, opt, tokens):
        def loss_fn(p):
            logp = jax.nn.log_softmax(model.apply({"params": p}, tokens[:, :-1]))
            return -(logp * jax.nn.one_hot(tokens[:, 1:], 24)).sum(-1).mean()

        loss, g = jax.value_and_grad(loss_fn)(params)
        updates, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    # The embedding's vocabulary over 'model' (its one-hot matmul and the transpose's partitioned).
    def spec_of(path, _):
        return P("model", None) if "embedding" in [getattr(k, "key", "") for k in path] else P()

    opt = tx.init(params)
    pspec = jax.tree_util.tree_map_with_path(spec_of, params)
    ospec = jax.tree_util.tree_map_with_path(spec_of, opt)
    want, ref = [], (params, opt)
    plain = jax.jit(step)
    for _ in range(4):
        *ref, loss = plain(*ref, tokens)
        want.append(float(loss))
    ours = cluster.jit(step, in_shardings=(pspec, ospec, P("data")), out_shardings=(pspec, ospec, P()),
                       donate_argnums=(0, 1))
    state = (cluster.device_put(params, pspec), cluster.device_put(opt, ospec))
    got, toks = [], cluster.device_put(tokens, P("data"))
    with jax.set_mesh(emulated_mesh()):
        for _ in range(4):
            *state, loss = ours(*state, toks)
            got.append(float(np.asarray(loss)))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(state[0]["Embed_0"]["embedding"]), np.asarray(ref[0]["Embed_0"]["embedding"]),
                               rtol=1e-4, atol=1e-5)


def test_shard_map_data_parallel_and_fsdp_steps_match_jax(cluster):
    """Seed 001's way of writing a step: jax.shard_map with pmean over 'data' (DP), and FSDP with
    the parameters all_gathered and their gradients psum_scattered (JAX's own transpose)."""
    mesh = emulated_mesh()

    def loss_fn(p, x, y):
        h = jnp.tanh(x @ p["w1"])
        return jnp.mean((h @ p["w2"] - y) ** 2)

    def dp_local(p, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        g = jax.lax.pmean(g, "data")
        return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g), jax.lax.pmean(loss, "data")

    def fsdp_local(p, x, y):
        def gathered_loss(p):
            full = {k: jax.lax.all_gather(v, "data", axis=0, tiled=True) for k, v in p.items()}
            return loss_fn(full, x, y)

        loss, g = jax.value_and_grad(gathered_loss)(p)
        g = jax.tree_util.tree_map(lambda v: v / 2.0, g)  # the mean over the 2 'data' shards
        return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g), jax.lax.pmean(loss, "data")

    rng = np.random.default_rng(6)
    params = {"w1": (rng.normal(size=(16, 32)) * 0.3).astype(np.float32),
              "w2": (rng.normal(size=(32, 8)) * 0.3).astype(np.float32)}
    data = [(rng.normal(size=(8, 16)).astype(np.float32), rng.normal(size=(8, 8)).astype(np.float32))
            for _ in range(5)]
    for local, pspec in ((dp_local, P()), (fsdp_local, P("data"))):
        step = jax.shard_map(local, mesh=mesh, in_specs=(pspec, P("data"), P("data")), out_specs=(pspec, P()))
        ref, ours = params, cluster.device_put(params, pspec)
        fn = cluster.jit(step, out_shardings=(pspec, P()), donate_argnums=0)
        with jax.set_mesh(mesh):
            for x, y in data:
                ref, want = jax.jit(step)(ref, x, y)
                ours, got = fn(ours, cluster.device_put(x, P("data")), cluster.device_put(y, P("data")))
                np.testing.assert_allclose(float(np.asarray(got)), float(want), rtol=1e-5)
        for k in params:
            np.testing.assert_allclose(np.asarray(ours[k]), np.asarray(ref[k]), rtol=1e-5, atol=1e-6)


def test_dynamic_slices_and_updates_with_traced_starts_and_their_gradients_match_jax(cluster):
    """lax.dynamic_slice / dynamic_update_slice with starts computed in the step (clamped as XLA
    clamps them), the seed's minibatch slicing in a scan, and their transposes under jax.grad."""

    def fn(x, w, k):
        def loss(w):
            def body(acc, i):
                mb = jax.lax.dynamic_slice_in_dim(x, i * 4, 4, axis=0)  # the seed's minibatches
                return acc + jnp.sum(jnp.tanh(mb @ w) ** 2), None

            total, _ = jax.lax.scan(body, 0.0, jnp.arange(4))
            return total

        g = jax.grad(loss)(w)
        clamped = jax.lax.dynamic_slice(x, (k + 14, k - 3), (4, 3))  # both starts clamped
        upd = jax.lax.dynamic_update_slice(w, jnp.ones((2, 8), jnp.float32) * k, (k, 0))
        return loss(w), g, clamped, upd

    rng = np.random.default_rng(3)
    x = rng.normal(size=(16, 6)).astype(np.float32)
    w = rng.normal(size=(6, 8)).astype(np.float32)
    k = np.int32(2)
    ref = jax.jit(fn)(x, w, k)
    ours = cluster.jit(fn, in_shardings=(P("data"), P(None, "model"), P()),
                       out_shardings=(P(), P(None, "model"), P(), P(None, "model")))(
        cluster.device_put(x, P("data")), cluster.device_put(w, P(None, "model")), k)
    for o, r in zip(ours, ref):
        np.testing.assert_allclose(np.asarray(o), np.asarray(r), rtol=1e-5, atol=1e-5)  # sums reordered


def test_cumulative_reductions_and_conds_with_their_gradients_match_jax(cluster):
    """cumsum (its transpose a reverse cumsum) with its gradient, cumprod, cummax and cummin along
    sharded dims (their JVPs slice down to empty arrays, which meshrun lacks); lax.cond on a
    traced predicate and lax.switch (index clamped), with gradients through them; strided slices
    (x[1::3, ::2]) and a pad of one, with their transposes (interior padding) in the gradient."""

    def fn(x, p, i):
        def loss(x):
            c = jnp.cumsum(x, axis=0) + jax.lax.cumsum(x, axis=1, reverse=True)
            c = c + jnp.pad(x[::2, 1::3], ((2, 2), (1, 7))) * 0.5  # back to [8, 12]
            c = jax.lax.cond(p > 0, lambda c: c * 2.0, lambda c: jnp.sin(c), c)
            return jnp.sum(jax.lax.switch(i, [lambda c: c, lambda c: c + 1.0, lambda c: jnp.tanh(c)], c) ** 2)

        return (loss(x), jax.grad(loss)(x), jnp.cumprod(x * 0.5, axis=1), jax.lax.cummin(x, axis=0, reverse=True),
                jax.lax.cummax(x, axis=1), x[1::3, ::2] * 2.0)

    rng = np.random.default_rng(5)
    x = rng.normal(size=(8, 12)).astype(np.float32)
    specs = (P("data", "model"), P(), P())
    for p, i in ((1.0, 1), (-1.0, 2), (1.0, 7)):
        ref = jax.jit(fn)(x, np.float32(p), np.int32(i))
        ours = cluster.jit(fn, in_shardings=specs, out_shardings=(P(), P("data", "model"), P("data"), P(), P(), P()))(
            cluster.device_put(x, P("data", "model")), np.float32(p), np.int32(i))
        for o, r in zip(ours, ref):
            np.testing.assert_allclose(np.asarray(o), np.asarray(r), rtol=1e-5, atol=1e-5)


def test_sort_and_argsort_with_a_gradient_match_jax(cluster):
    """jnp.sort along a sharded dim (NaNs last, stable ties), argsort (a sort of two operands), the
    gradient of a sorted value (JAX's scatter-add transpose), and top_k along either axis."""

    def fn(x):
        smallest = lambda x: jnp.sum(jnp.sort(x, axis=1)[:, :3] ** 2)
        return (jnp.sort(x, axis=0), jnp.argsort(x, axis=1), smallest(x), jax.grad(smallest)(x),
                *jax.lax.top_k(jnp.nan_to_num(x), 4), *jax.lax.top_k(x, 3, axis=0))

    rng = np.random.default_rng(9)
    x = rng.normal(size=(8, 12)).astype(np.float32)
    x[1, 3], x[2, 5], x[0, 0], x[3, 0], x[4, 7] = np.nan, -0.0, 0.0, x[5, 0], x[4, 8]  # NaN, zeros, ties
    ref = jax.jit(fn)(x)
    ours = cluster.jit(fn, in_shardings=P("data", "model"),
                       out_shardings=(P(None, "model"), P("data"), P(), P("data"), P(), P(), P(), P()))(
        cluster.device_put(x, P("data", "model")))
    np.testing.assert_array_equal(np.asarray(ours[0]), np.asarray(ref[0]))
    assert np.array_equal(np.signbit(np.asarray(ours[0])), np.signbit(np.asarray(ref[0])))
    np.testing.assert_array_equal(np.asarray(ours[1]), np.asarray(ref[1]))
    for o, r in zip(ours[2:4], ref[2:4]):
        np.testing.assert_allclose(np.asarray(o), np.asarray(r), rtol=1e-6)
    for o, r in zip(ours[4:], ref[4:]):  # top_k: the 4 largest per row, the 3 largest per column (NaN first)
        np.testing.assert_array_equal(np.asarray(o), np.asarray(r))


def test_sort_equates_signed_zeros_and_nans_as_lax_sort_while_top_k_keeps_xlas_total_order(cluster):
    """lax.sort's comparator treats -0 as +0 and -NaN as NaN (a stable sort keeps each where it
    was, the values keep their bits), in argsort, a descending argsort and a two-key sort; XLA's
    top_k ranks by the total order (NaN > inf > ... > +0 > -0 > ... > -NaN), ties by index, in f32
    and bf16, and int32 / uint32 values past 2**24 as themselves. Fails where sort orders -0 before
    +0 or -NaN first, or top_k ranks -NaN with NaN or rounds an integer through f32; or where the
    conversion to bf16 (alone, or rounded and widened back in a fused loop) drops a NaN's sign."""
    x = np.array([[0.0, -0.0, np.nan, 1.0, -np.nan, -1.0, -0.0, 0.0],
                  [3.0, -0.0, 0.0, np.nan, 2.0, -np.nan, 0.0, -np.inf]], np.float32)

    def fn(x):
        bits = jax.lax.bitcast_convert_type(jnp.sort(x, axis=1), jnp.int32)
        # (a NaN converted to bf16 keeps its sign, as XLA's convert: -NaN ranks last in bf16 too)
        half = x.astype(jnp.bfloat16)
        return (jnp.argsort(x, axis=1, stable=True), bits, jnp.argsort(x, axis=1, descending=True, stable=True),
                jax.lax.sort((x[0], x[1], jnp.arange(8)), num_keys=2)[2], *jax.lax.top_k(x, 8),
                jax.lax.top_k(half, 5)[1], jax.lax.top_k(x.T, 2, axis=0)[1],
                jax.lax.bitcast_convert_type(half, jnp.uint16).astype(jnp.int32),
                jax.lax.bitcast_convert_type(half.astype(jnp.float32) * 2, jnp.int32))

    want = jax.jit(fn)(x)
    got = cluster.jit(fn, in_shardings=P("data"))(cluster.device_put(x, P("data")))
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and np.array_equal(g.view(np.int32) if g.dtype == np.float32 else g,
                                                     w.view(np.int32) if w.dtype == np.float32 else w), (i, g, w)
    # Integers rank as themselves, past 2**24 too (through f32, 16777217 would be 16777216).
    for ints in (np.array([[16777217, 16777216, -5, 2**30, -2**31, 7, 16777217, 3]], np.int32),
                 np.array([[4000000000, 16777217, 16777216, 5, 0, 4294967295, 3, 16777217]], np.uint32)):
        got, want = cluster.jit(lambda a: jax.lax.top_k(a, 5))(ints), jax.jit(lambda a: jax.lax.top_k(a, 5))(ints)
        for g, w in zip(got, want):
            assert np.asarray(g).dtype == w.dtype and np.array_equal(np.asarray(g), np.asarray(w)), (g, w)


def test_a_bf16_dot_of_a_bf16_value_held_as_f32_stays_a_bf16_gemm(cluster):
    """A bf16 activation that the cluster holds as f32 (a select against zeros_like, as Flax's
    Dropout writes it) times a bf16 weight: the activation is converted to bf16 (exact: it is a
    bf16 value) rather than the weight widened to f32 every step, so the GEMM runs in bf16 (AMX /
    AVX512-BF16), and the product is jax.jit's."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(8, 32)).astype(np.float32)
    w = rng.normal(size=(32, 16)).astype(np.float32)

    def f(x, w):
        xb = x.astype(jnp.bfloat16)
        h = jax.lax.select(x > 0, xb / 0.9, jnp.zeros_like(xb))
        return (h @ w.astype(jnp.bfloat16)).astype(jnp.float32)

    want = np.asarray(jax.jit(f)(x, w))
    fn = cluster.jit(f)
    got = np.asarray(fn(cluster.device_put(x, P("data", None)), cluster.device_put(w, P())))
    ops = fn.last_program.ops
    dots = [op for op in ops if op.kind == program_pb2.GlobalOp.DOT_GENERAL]
    assert len(dots) == 1
    for operand in dots[0].operands:  # each made bf16 by a CONVERT (values are numbered as ops)
        producer = ops[operand]
        assert producer.kind == program_pb2.GlobalOp.CONVERT and producer.dtype == common_pb2.DTYPE_BF16, producer
    # Products of bf16 values are exact in f32 and summed in f32 either way; each result is then
    # rounded to bf16, so the two may differ by one bf16 ulp where the sums' order differs.
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-6)
