"""JAX's PRNG on the cluster: draws equal JAX's (bits exactly, floats within 2 ulp), each worker
draws only its block of a partitioned draw, and flax initialises and drops out on the cluster;
bf16 draws (JAX's 8-bit random bits) and the uint8 / uint16 arithmetic on them wrap as JAX's."""

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxcompare import emulated_mesh
import meshrun
from meshrun import _sharding
from meshrun.seeds import MLP
from meshrun.v1 import program_pb2


def assert_within_ulp(ours, ref, ulps=3):
    """Integers equal; floats within `ulps` ulp of JAX's, or within 4 ulp of the array's largest
    value: XLA contracts the uniform draw's u * (hi - lo) + lo into one FMA where meshrun rounds
    twice, and a truncated normal's u near its bound cancels."""
    ours, ref = np.asarray(ours), np.asarray(ref)
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, (ours.dtype, ours.shape, ref.dtype, ref.shape)
    if ref.dtype.kind != "f":
        np.testing.assert_array_equal(ours, ref)
        return
    a = ours.astype(np.float32).view(np.int32).astype(np.int64)
    b = ref.astype(np.float32).view(np.int32).astype(np.int64)
    a = np.where(a < 0, -(a & 0x7FFFFFFF), a)  # ordered as the floats are
    b = np.where(b < 0, -(b & 0x7FFFFFFF), b)
    far = np.abs(a - b) > ulps
    scale = np.spacing(np.max(np.abs(ref)).astype(np.float32))
    cancelled = np.abs(ours.astype(np.float64) - ref) <= 4 * scale
    assert not np.any(far & ~cancelled), f"{ours[far & ~cancelled]} vs {ref[far & ~cancelled]}"


def random_bits_specs(program):
    """The layout each RANDOM_BITS op of a GlobalProgram draws in."""
    return [_sharding.spec_from_proto(op.spec) for op in program.ops
            if op.kind == program_pb2.GlobalOp.RANDOM_BITS]


def draws(key):
    k1, k2 = jax.random.split(key)
    bits = jax.random.bits(k1, (8, 12))
    normal = jax.random.normal(k1, (8, 12))
    uniform = jax.random.uniform(jax.random.fold_in(k2, 3), (5,), minval=-2.0, maxval=3.0)
    trunc = jax.nn.initializers.xavier_normal()(k2, (8, 4))
    trunc = jax.lax.with_sharding_constraint(trunc, P("data", "model"))
    seeded = jax.random.PRNGKey(7)
    keys = jax.random.split(k2, 4)
    bern = jax.random.bernoulli(keys[2], 0.3, (16,))
    word = jnp.uint32(0xF0F0F0F0)
    mixed = (bits >> 3) ^ (bits << 29) ^ ~bits & word | (bits & jnp.uint32(1))
    return bits, normal, uniform, trunc, seeded, keys, bern, mixed


def test_random_draws_and_bit_operations_equal_jaxs(cluster):
    mesh = emulated_mesh()
    key = np.asarray(jax.random.PRNGKey(0))
    with jax.set_mesh(mesh):
        ref = jax.jit(draws)(key)
        out_specs = (P(), P("data", "model"), P(), P("data", "model"), P(), P(), P(), P("data"))
        fn = cluster.jit(draws, in_shardings=P(), out_shardings=out_specs)
        ours = fn(cluster.device_put(key, P()))
    for o, r in zip(ours, ref):
        assert_within_ulp(o, r)
    # The partitioned draws are drawn in their layouts (normal's from its out_sharding, the
    # initialiser's from its sharding constraint), not whole and sliced.
    specs = random_bits_specs(fn.last_program)
    assert (("data",), ("model",)) in specs, specs


def test_threefry2x32_equals_jaxs(cluster):
    import jax.extend as jex

    key = np.array([7, 42], np.uint32)
    counts = np.arange(40, dtype=np.uint32).reshape(8, 5) * np.uint32(2654435761)
    fn = lambda k, c: jex.random.threefry_2x32(k, c.ravel()).reshape(c.shape)
    ref = jax.jit(fn)(key, counts)
    ours = cluster.jit(fn, in_shardings=(P(), P("data")))(cluster.device_put(key, P()),
                                                           cluster.device_put(counts, P("data")))
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))


def test_seed_000_mlp_initialised_on_the_cluster_equals_jaxs_init(cluster):
    mesh = emulated_mesh()
    model = MLP(num_layers=2, depth=64)
    x = np.ones((16, 32), np.float32)
    key = np.asarray(jax.random.PRNGKey(0))
    with jax.set_mesh(mesh):
        abstract = jax.eval_shape(model.init, key, x)
        spec = nn.get_partition_spec(abstract)
        ref = jax.jit(model.init)(key, x)
        init = cluster.jit(model.init, in_shardings=(P(), P("data")), out_shardings=spec)
        ours = init(cluster.device_put(key, P()), cluster.device_put(x, P("data")))
    ref_leaves = jax.tree_util.tree_leaves(nn.unbox(ref))
    our_leaves = jax.tree_util.tree_leaves(ours)
    assert len(ref_leaves) == len(our_leaves) == 2  # W1 and W2, stacked over the 2 layers
    for o, r in zip(our_leaves, ref_leaves):
        assert_within_ulp(o, np.asarray(r))
    for o, s in zip(our_leaves, jax.tree_util.tree_leaves(spec, is_leaf=lambda v: isinstance(v, P))):
        assert _sharding.normalize_spec(o.sharding.spec, cluster.mesh) == _sharding.normalize_spec(s, cluster.mesh)
    # Each worker drew only its block: each layer's weights are drawn laid out as the weight.
    specs = random_bits_specs(init.last_program)
    assert specs.count(((), ("model",))) == 2 and specs.count((("model",),)) == 2, specs


class Dropped(nn.Module):
    """DotReluDot with dropout after the relu (a model beyond the seeds)."""

    @nn.compact
    def __call__(self, x, train: bool):
        y = nn.Dense(64, kernel_init=nn.with_partitioning(nn.initializers.xavier_normal(), (None, "model")),
                     use_bias=False)(x)
        y = jax.lax.with_sharding_constraint(jax.nn.relu(y), P("data", "model"))
        y = nn.Dropout(rate=0.25, deterministic=not train)(y)
        return nn.Dense(x.shape[-1], kernel_init=nn.with_partitioning(nn.initializers.xavier_normal(), ("model", None)),
                        use_bias=False)(y)


def test_a_step_with_dropout_keyed_from_the_state_matches_jax(cluster):
    mesh = emulated_mesh()
    model, tx = Dropped(), optax.adam(1e-2)
    rng = np.random.default_rng(1)
    data = [(rng.normal(size=(16, 32)).astype(np.float32), rng.normal(size=(16, 32)).astype(np.float32))
            for _ in range(5)]

    def init(key, x):
        params = model.init(key, x, train=False)["params"]
        return params, tx.init(params), jax.random.fold_in(key, 1)

    def step(state, x, y):
        params, opt_state, key = state
        key, dropout_key = jax.random.split(key)

        def loss_fn(p):
            z = model.apply({"params": p}, x, train=True, rngs={"dropout": dropout_key})
            return jnp.mean(optax.l2_loss(z, y))

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, key), loss

    key = np.asarray(jax.random.PRNGKey(0))
    with jax.set_mesh(mesh):
        abstract = jax.eval_shape(init, key, data[0][0])
        spec = nn.get_partition_spec(abstract)
        spec = jax.tree_util.tree_map(lambda s: s if isinstance(s, P) else P(), spec,
                                      is_leaf=lambda s: isinstance(s, P) or s is None)
        ref_state = nn.unbox(jax.jit(init)(key, data[0][0]))
        ref_losses = []
        plain = jax.jit(step)
        for x, y in data:
            ref_state, loss = plain(ref_state, x, y)
            ref_losses.append(float(loss))
        state = cluster.jit(init, in_shardings=(P(), P("data")), out_shardings=spec)(
            cluster.device_put(key, P()), cluster.device_put(data[0][0], P("data")))
        ours = cluster.jit(step, in_shardings=(spec, P("data"), P("data")), out_shardings=(spec, P()),
                           donate_argnums=0)
        losses = []
        for x, y in data:
            state, loss = ours(state, cluster.device_put(x, P("data")), cluster.device_put(y, P("data")))
            losses.append(float(np.asarray(loss)))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(state[2]), np.asarray(ref_state[2]))  # the key threaded
    # The mask is drawn in the activations' layout.
    assert (("data",), ("model",)) in random_bits_specs(ours.last_program)


def test_a_typed_key_argument_is_traced_as_a_key(cluster):
    # jax.jit takes a new-style key (jax.random.key) as an argument, as a dropout key passed to
    # each step is; cluster.jit sends its words and traces the function with the key itself.
    # Layout primitives over key arrays act on whole keys: unpacking a split (slice, squeeze),
    # reshape, transpose, indexing with a traced index (dynamic_slice), broadcast.
    def draw(key, x, i):
        k1, k2 = jax.random.split(key)
        keys = jax.random.split(k2, 4).reshape(2, 2).T
        picked = jax.lax.dynamic_index_in_dim(keys.reshape(4), i, keepdims=False)
        many = jnp.broadcast_to(picked, (3,))
        return (x + jax.random.normal(k1, x.shape), jax.random.key_data(keys), jax.random.uniform(picked, (5,)),
                jax.random.key_data(many), jax.random.fold_in(key, 3))

    x = np.arange(16 * 4, dtype=np.float32).reshape(16, 4)
    ours = cluster.jit(draw, in_shardings=(P(), P("data"), P()))
    with jax.set_mesh(emulated_mesh()):
        for seed, i in ((0, 1), (1, 2)):
            key, index = jax.random.key(seed), np.int32(i)
            got = ours(key, x, index)
            want = jax.jit(draw)(key, x, index)
            assert_within_ulp(got[0], want[0])
            assert_within_ulp(got[2], want[2])
            for k in (1, 3):
                np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))
            # A key result comes back as its words, as jax.random.key_data gives them.
            np.testing.assert_array_equal(np.asarray(got[4]), np.asarray(jax.random.key_data(want[4])))


def test_a_typed_key_the_function_closes_over_draws_as_jax(cluster):
    """jax.random.key(3) made outside the function and captured by it (a constant of the jaxpr,
    as a script's module-level key is): its words go up with the program, and permutation,
    categorical, a fold_in and a split of it draw as under jax.jit."""
    key, batch = jax.random.key(3), jax.random.split(jax.random.key(1), 3)
    x = np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32)

    def f(x):
        return (jax.random.permutation(key, x), jax.random.categorical(key, x, axis=-1),
                x * jax.random.bernoulli(jax.random.fold_in(key, 7), 0.5, x.shape),
                x + jax.random.uniform(batch[1], x.shape), jax.random.split(key)[0])

    got, want = cluster.jit(f)(x), jax.jit(f)(x)
    for g, w in zip(got[:4], want[:4]):
        assert_within_ulp(g, w)
    np.testing.assert_array_equal(np.asarray(got[4]), np.asarray(jax.random.key_data(want[4])))


class _NnxDropped(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(16, 32, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.l2 = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.l1(x))))


def test_an_nnx_state_holding_rng_keys_round_trips_and_drops_out_as_jax(cluster):
    # nnx.Rngs keeps typed keys in the module's state: device_put sends their words, each step
    # splits them for its dropout mask and returns them as key arrays, and the next step traces
    # them as keys again.
    model = _NnxDropped(nnx.Rngs(0, dropout=1))
    graphdef, state = nnx.split((model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)))
    rng = np.random.default_rng(8)
    x, y = rng.normal(size=(16, 16)).astype(np.float32), rng.normal(size=(16, 4)).astype(np.float32)

    def step(state, x, y):
        model, opt = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        opt.update(model, grads)
        return nnx.state((model, opt)), loss

    want, ref = [], state
    plain = jax.jit(step)
    for _ in range(4):
        ref, loss = plain(ref, x, y)
        want.append(float(loss))
    ours = cluster.jit(step, donate_argnums=0)
    got, held = [], cluster.device_put(state, P())
    with jax.set_mesh(emulated_mesh()):
        for _ in range(4):
            held, loss = ours(held, cluster.device_put(x, P("data")), cluster.device_put(y, P("data")))
            got.append(float(np.asarray(loss)))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    keys = [a for a in jax.tree_util.tree_leaves(held) if a.key_dtype is not None]
    ref_keys = [k for k in jax.tree_util.tree_leaves(ref) if jax.dtypes.issubdtype(k.dtype, jax.dtypes.prng_key)]
    assert len(keys) == len(ref_keys) > 0
    for k, r in zip(keys, ref_keys):
        np.testing.assert_array_equal(np.asarray(k), np.asarray(jax.random.key_data(r)))


def test_draws_from_a_batch_of_keys_under_vmap_match_jax(cluster):
    """jax.vmap over split keys (an ensemble's or per-example noise): each key draws its own
    block, bits exactly as JAX's, normals within JAX's ulp bound."""

    def f(x):
        keys = jax.random.split(jax.random.key(0), 8)
        noise = jax.vmap(lambda k: jax.random.normal(k, (4,)))(keys)
        grid = jax.random.split(jax.random.key(1), (2, 3))
        sub = jax.vmap(jax.vmap(lambda k: jax.random.uniform(jax.random.split(k)[1], (5,))))(grid)
        return x + noise, sub, jax.vmap(lambda k: jax.random.bits(k, (3,)))(keys)

    x = np.zeros((8, 4), np.float32)
    (noise, sub, bits), (want_noise, want_sub, want_bits) = (
        cluster.jit(f, out_shardings=P())(cluster.device_put(x, P())), jax.jit(f)(x))
    np.testing.assert_array_equal(np.asarray(bits), np.asarray(want_bits))
    np.testing.assert_array_equal(np.asarray(sub), np.asarray(want_sub))
    assert_within_ulp(noise, want_noise)


def test_a_batch_of_more_keys_than_ops_could_unroll_draws_as_jax(cluster):
    """1024 keys (once refused above 256): one THREEFRY2X32 over every key's counters, as JAX's
    partitionable threefry computes it, splits and bits exactly as JAX's."""

    def f(key):
        keys = jax.random.split(key, 1024)
        return (jax.vmap(lambda k: jax.random.bits(k, (3, 2)))(keys),
                jax.random.key_data(jax.vmap(jax.random.split)(keys)),
                jax.vmap(lambda k: jax.random.uniform(k))(keys))

    got, want = cluster.jit(f)(jax.random.key(11)), jax.jit(f)(jax.random.key(11))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_gamma_beta_dirichlet_and_poisson_draws_match_jax(cluster):
    """jax.random.gamma (and beta, dirichlet, built on it) and poisson sample by rejection in
    while loops whose trip counts depend on the draws: their loops are unrolled to while_trips
    iterations, each applied where the loop had not finished, so the draws are JAX's."""

    def f(key, x):
        k = jax.random.split(key, 4)
        lam = jax.random.beta(k[0], 0.4, 0.4, (x.shape[0],))  # mixup's coefficient per example
        return (jax.random.gamma(k[1], jnp.array([0.3, 1.0, 2.5, 9.0]), (16, 4)), lam[:, None] * x,
                jax.random.dirichlet(k[2], jnp.ones(3), (5,)), jax.random.poisson(k[3], 3.0, (8, 4)))

    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    key = jax.random.key(5)
    got = cluster.jit(f)(key, cluster.device_put(x, P("data")))
    want = jax.jit(f)(key, x)
    for g, w in zip(got, want):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-6)


def bit_equal(got, want):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, g.shape, w.dtype, w.shape)
        np.testing.assert_array_equal(g.reshape(-1).view(np.uint8), w.reshape(-1).view(np.uint8))


def test_bf16_draws_and_a_bf16_flax_init_equal_jaxs_bit_for_bit(cluster):
    """bf16 draws come from 8-bit random bits (partitionable threefry: the 32-bit draw's low 8)
    and bf16 arithmetic, each op rounded to bf16 as XLA's: uniform, normal, truncated normal, a
    vmap over keys, and a flax Dense with param_dtype=bf16 initialised on the cluster, its kernel
    drawn in its layout. They were refused (bit_width 8)."""
    dense = nn.Dense(16, param_dtype=jnp.bfloat16,
                     kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), ("data", "model")))

    def f(key):
        k = jax.random.split(key, 5)
        return (jax.random.uniform(k[0], (16, 8), jnp.bfloat16, -3.0, 5.0),
                jax.random.normal(k[1], (16, 8), jnp.bfloat16),
                jax.random.truncated_normal(k[2], -2.0, 2.0, (64, 32), jnp.bfloat16),
                jax.vmap(lambda kk: jax.random.uniform(kk, (3,), jnp.bfloat16))(jax.random.split(k[3], 6)),
                nn.unbox(dense.init(k[4], jnp.ones((2, 8), jnp.bfloat16))))

    key = jax.random.key(3)
    out_specs = (P(), P("data", "model"), P(), P(), P())
    mesh = emulated_mesh()
    with jax.set_mesh(mesh):
        fn = cluster.jit(f, out_shardings=out_specs)
        bit_equal(fn(key), jax.jit(f)(key))
    specs = random_bits_specs(fn.last_program)
    assert (("data",), ("model",)) in specs, specs


def test_8_and_16_bit_integers_wrap_as_jaxs(cluster):
    """uint8 / uint16 values are u32 on the cluster, wrapped to their width wherever XLA's would
    wrap: sums and products past 2**16, shifts past the top bit, not, integer conversions (a
    negative int32 to uint16, a uint32 to uint8), and bf16 <-> uint16 bitcasts both ways."""

    def f(key, x):
        b8 = jax.random.bits(key, (6, 8), jnp.uint8)
        b16 = jax.random.bits(jax.random.fold_in(key, 1), (6, 8), jnp.uint16)
        wrapped = (b16 * jnp.uint16(7) + jnp.uint16(65000)) ^ (b16 << jnp.uint16(9)) ^ ~(b16 >> jnp.uint16(3))
        small = (b8 + jnp.uint8(200)) * jnp.uint8(3) - (b8 << jnp.uint8(6))
        narrowed = (x.astype(jnp.int32) * -977).astype(jnp.uint16), jnp.uint32(0xDEADBEEF).astype(jnp.uint8)
        bits_of = jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16) * jnp.bfloat16(3.3), jnp.uint16)
        back = jax.lax.bitcast_convert_type(bits_of | jnp.uint16(1), jnp.bfloat16)
        as32 = [v.astype(jnp.uint32) for v in (b8, b16, wrapped, small, narrowed[0], narrowed[1], bits_of)]
        return as32, back, jnp.maximum(b16, jnp.uint16(40000)).astype(jnp.float32), b8 > jnp.uint8(128)

    x = np.random.default_rng(1).normal(size=(6, 8)).astype(np.float32) * 50
    key = jax.random.key(9)
    bit_equal(cluster.jit(f)(key, cluster.device_put(x, P("data"))), jax.jit(f)(key, x))


def test_narrow_integers_are_refused_where_they_would_not_wrap(cluster):
    """What meshrun cannot give as JAX does is refused by name, before anything runs: a
    reduction over uint16 values, a uint16 result (the cluster holds no uint16 arrays), and
    8-bit draws with legacy threefry (which packs four to a word)."""
    key = jax.random.key(0)
    with pytest.raises(meshrun.errors.UnsupportedPrimitiveError, match=r"'reduce_sum' at .*over uint16"):
        cluster.jit(lambda k: jax.lax.reduce(jax.random.bits(k, (5,), jnp.uint16), np.uint16(0),
                                             jax.lax.add, (0,)).astype(jnp.uint32))(key)
    with pytest.raises(meshrun.errors.InvalidArgumentError, match="a result of dtype uint16"):
        cluster.jit(lambda k: jax.random.bits(k, (5,), jnp.uint16))(key)
    with jax.threefry_partitionable(False):
        with pytest.raises(meshrun.errors.UnsupportedPrimitiveError, match="bit_width 8 with legacy threefry"):
            cluster.jit(lambda k: jax.random.uniform(k, (4,), jnp.bfloat16))(jax.random.key(0))
    # The cluster serves the next program.
    bit_equal(cluster.jit(lambda k: jax.random.uniform(k, (4,), jnp.bfloat16))(key),
              jax.jit(lambda k: jax.random.uniform(k, (4,), jnp.bfloat16))(key))
