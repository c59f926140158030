"""Seed 001 (data parallelism with shard_map, the UvA scaling tutorial) on a cluster of 8 worker
processes on a 1-D `data` mesh, as the seed writes it: initialised on the cluster, trained with
dropout keyed by fold_rng_over_axis, gradient accumulation over minibatches (lax.scan with
dynamic_slice_in_dim), integer-label cross-entropy, pmean'd gradients and psum'd metrics, on
Fashion-MNIST batches. Its metrics and parameters match the same code under plain jax.jit."""
import gzip
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import meshrun
from meshrun.seeds import Batch, DPClassifier, FSDPClassifier, seed001_dp_functions, sync_gradients

FASHION_MNIST = "/usr/share/datasets/fashion-mnist"


@pytest.fixture(scope="module")
def cluster8():
    with meshrun.local_cluster(mesh="data=8") as c:
        yield c


def fashion_mnist(n):
    """The first n training examples: images f32 [n, 784] scaled to [0, 1], labels i32 [n]."""
    with gzip.open(os.path.join(FASHION_MNIST, "train-images-idx3-ubyte.gz")) as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16)[: n * 784].reshape(n, 784)
    with gzip.open(os.path.join(FASHION_MNIST, "train-labels-idx1-ubyte.gz")) as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)[:n]
    return images.astype(np.float32) / 255.0, labels.astype(np.int32)


def seed_batches(steps, batch_size=128):
    """The seed's Batch of each step: consecutive Fashion-MNIST examples."""
    images, labels = fashion_mnist(steps * batch_size)
    return [Batch(inputs=images[i * batch_size:(i + 1) * batch_size],
                  labels=labels[i * batch_size:(i + 1) * batch_size]) for i in range(steps)]


def train_both(cluster, init_fn, step_fn, batches, check_init=None):
    """The seed's init and steps (fresh zero metrics each step) under plain jax.jit on 8 emulated
    devices (the reference), then the same code under cluster.jit; check_init(state) sees the
    cluster's initial state. Returns (ref_state, ref_metrics, state, metrics), metrics as numpy."""
    model_init_rng = np.asarray(jax.random.PRNGKey(42))
    ref_state = jax.jit(init_fn)(model_init_rng, batches[0].inputs)
    _, metric_shapes = jax.eval_shape(step_fn, ref_state, None, batches[0])
    zeros = lambda: jax.tree_util.tree_map(lambda x: np.zeros(x.shape, x.dtype), metric_shapes)
    ref_step = jax.jit(step_fn, donate_argnames=("state", "metrics"))
    ref_metrics = []
    for batch in batches:
        ref_state, m = ref_step(ref_state, zeros(), batch)
        ref_metrics.append(jax.tree_util.tree_map(np.asarray, m))

    # The same code on the cluster: jax.jit -> cluster.jit.
    state = cluster.jit(init_fn)(cluster.device_put(model_init_rng, P()),
                                 cluster.device_put(batches[0].inputs, P("data")))
    if check_init is not None:
        check_init(state)
    step = cluster.jit(step_fn, donate_argnums=(0, 1))
    metrics = []
    for batch in batches:
        state, m = step(state, zeros(), cluster.device_put(batch, P("data")))
        metrics.append(jax.tree_util.tree_map(np.asarray, m))
    return ref_state, ref_metrics, state, metrics


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_seed_001_data_parallel_training_matches_jax(cluster8, dtype):
    """In f32, and in bf16 as the seed configures it (bf16 compute, f32 parameters and
    optimizer state): bf16 products round differently from XLA's, so bf16 metrics agree to 2e-3."""
    steps, batch_size = 5, 128
    rtol = 1e-5 if dtype == jnp.float32 else 2e-3
    model = DPClassifier(hidden_size=512, num_classes=10, dropout_rate=0.1, dtype=dtype)
    init_dp, train_step_dp = seed001_dp_functions(model, optax.adamw(learning_rate=1e-3), num_minibatches=4)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    # The seed's two jitted shard_maps (jax.shard_map's check_vma is the seed's check_rep).
    init_dp_fn = jax.shard_map(init_dp, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=False)
    train_step_dp_fn = jax.shard_map(train_step_dp, mesh=mesh, in_specs=(P(), P(), P("data")),
                                     out_specs=(P(), P()), check_vma=False)
    ref_state, ref_metrics, state, metrics = train_both(cluster8, init_dp_fn, train_step_dp_fn,
                                                        seed_batches(steps, batch_size))
    for m, ref in zip(metrics, ref_metrics):
        np.testing.assert_allclose(m["loss"][0], ref["loss"][0], rtol=rtol)
        assert abs(int(m["accuracy"][0]) - int(ref["accuracy"][0])) <= (0 if dtype == jnp.float32 else 2)
        for k in ("loss", "accuracy"):
            assert int(m[k][1]) == int(ref[k][1]) == batch_size
    # Dropout drew the same masks: the losses above would differ by far more otherwise. The
    # parameters, optimizer state and rng after the steps:
    np.testing.assert_array_equal(np.asarray(state.rng), np.asarray(ref_state.rng))
    for ours, theirs in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(ref_state)):
        assert ours.dtype == theirs.dtype  # f32 masters and optimizer state under bf16 compute
    for ours, theirs in zip(jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(ref_state.params)):
        # Within 5% of one AdamW step (lr 1e-3): where a gradient is near 0, Adam's m / sqrt(v)
        # turns summation-order rounding into a visible part of a step. In bf16 such a gradient's
        # sign can flip: an element may then move a whole step (lr) the other way, each step.
        atol = 5e-5 if dtype == jnp.float32 else 2 * 1e-3 * steps
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-4, atol=atol)


def test_seed_001_fsdp_training_matches_jax(cluster8):
    """The seed's FSDP version: parameters sharded by nn.map_variables (dynamic_slice_in_dim at
    axis_index), gathered with all_gather under a custom_gradient whose backward is a
    psum_scatter, gradients synced by sync_gradients; state laid out as nn.get_partition_spec
    of the boxed state, which cluster.jit keeps without out_shardings (the shard_map's out_specs)."""
    steps, batch_size = 4, 128
    model = FSDPClassifier(hidden_size=512, num_classes=10, dropout_rate=0.1, dtype=jnp.float32,
                           min_weight_size=2**4)
    init_fsdp, train_step_fsdp = seed001_dp_functions(model, optax.adamw(learning_rate=1e-3), num_minibatches=4,
                                                      sync=sync_gradients)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    batches = seed_batches(steps, batch_size)
    model_init_rng = np.asarray(jax.random.PRNGKey(42))
    shapes = jax.eval_shape(jax.shard_map(init_fsdp, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(),
                                          check_vma=False), model_init_rng, batches[0].inputs)
    specs = nn.get_partition_spec(shapes)
    assert specs.params["input_dense"]["kernel"] == P("data", None)  # as the seed prints
    init_fn = jax.shard_map(init_fsdp, mesh=mesh, in_specs=(P(), P("data")), out_specs=specs, check_vma=False)
    step_fn = jax.shard_map(train_step_fsdp, mesh=mesh, in_specs=(specs, P(), P("data")), out_specs=(specs, P()),
                            check_vma=False)

    def check_init(state):  # laid out as the shard_map's out_specs, with no out_shardings given
        kernel = state.params["input_dense"]["kernel"]
        assert kernel.value.sharding.spec == P("data") and kernel.value.shape == (784, 512)

    ref_state, ref_metrics, state, metrics = train_both(cluster8, init_fn, step_fn, batches, check_init)
    for m, ref in zip(metrics, ref_metrics):
        for k in ("loss", "accuracy"):
            np.testing.assert_allclose(m[k][0], ref[k][0], rtol=1e-5, err_msg=k)
    for ours, theirs in zip(jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(ref_state.params)):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-4, atol=5e-5)
