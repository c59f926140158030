"""The seeds' models (../shared/seeds), as their guides write them, for the SDK's benchmark and
tests: seed 000's DotReluDot and scanned MLP (Flax's pjit guide; linen), and seeds 002/003's NNX
DotReluDot (Flax NNX's GSPMD guide). Shapes row-major, f32; parameters annotated for the
('data', 'model') mesh. Needs flax (the `jax` extra)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.lax import with_sharding_constraint
from jax.sharding import PartitionSpec


class DotReluDot(nn.Module):
    """Seed 000: x [b, d] -> (z [b, d], None); W1 [d, depth] over (None, 'model'), W2 [depth, d]
    over ('model', None); the tuple is what flax.linen.scan expects."""

    depth: int

    @nn.compact
    def __call__(self, x):
        W1 = self.param("W1", nn.with_partitioning(nn.initializers.xavier_normal(), (None, "model")),
                        (x.shape[-1], self.depth))
        y = jax.nn.relu(jnp.dot(x, W1))
        y = with_sharding_constraint(y, PartitionSpec("data", "model"))
        W2 = self.param("W2", nn.with_partitioning(nn.initializers.xavier_normal(), ("model", None)),
                        (self.depth, x.shape[-1]))
        z = jnp.dot(y, W2)
        z = with_sharding_constraint(z, PartitionSpec("data", None))
        return z, None


class MLP(nn.Module):
    """Seed 000 with use_scan=True: num_layers DotReluDot blocks stacked by nn.scan (their
    parameters get a leading layer dim, not partitioned)."""

    num_layers: int
    depth: int

    @nn.compact
    def __call__(self, x):
        x, _ = nn.scan(DotReluDot, length=self.num_layers, variable_axes={"params": 0},
                       split_rngs={"params": True}, metadata_params={nn.PARTITION_NAME: None})(self.depth)(x)
        return x


class NnxDotReluDot(nnx.Module):
    """Seeds 002/003: x [b, depth] -> [b, depth]; dot1's kernel over (None, 'model'), w2 over
    ('model', None). Create it under jax.set_mesh (Flax's eager sharding)."""

    def __init__(self, depth: int, rngs: nnx.Rngs):
        init_fn = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(depth, depth, kernel_init=nnx.with_partitioning(init_fn, (None, "model")),
                               use_bias=False, rngs=rngs)
        self.w2 = nnx.Param(init_fn(rngs.params(), (depth, depth)), sharding=("model", None))

    def __call__(self, x: jax.Array):
        y = self.dot1(x)
        y = jax.nn.relu(y)
        y = jax.lax.with_sharding_constraint(y, PartitionSpec("data", "model"))
        z = jnp.dot(y, self.w2[...])
        return z


# -- Seed 001: data parallelism with shard_map (the UvA scaling tutorial) ------------------------
# As the seed writes it, with its single_gpu.py helpers (TrainState with an rng, Batch,
# accumulate_gradients over minibatches with lax.scan). The seed imports shard_map from
# jax.experimental (check_rep=False); JAX 0.10 names it jax.shard_map (check_vma=False).

import functools  # noqa: E402

import numpy as np  # noqa: E402
from typing import Any, Callable, Dict, Tuple  # noqa: E402

import flax  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

PyTree = Any
Metrics = Dict[str, Tuple[jax.Array, ...]]


class TrainState(train_state.TrainState):
    rng: jax.Array


@flax.struct.dataclass
class Batch:
    inputs: jax.Array
    labels: jax.Array


def accumulate_gradients(state: TrainState, batch: Batch, rng: jax.Array, num_minibatches: int,
                         loss_fn: Callable) -> Tuple[PyTree, Metrics]:
    """single_gpu.py's scan version: the batch split into minibatches with dynamic_slice_in_dim,
    one dropout key per minibatch, gradients and metrics summed, gradients averaged."""
    batch_size = batch.inputs.shape[0]
    minibatch_size = batch_size // num_minibatches
    rngs = jax.random.split(rng, num_minibatches)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def _minibatch_step(minibatch_idx):
        minibatch = jax.tree_util.tree_map(
            lambda x: jax.lax.dynamic_slice_in_dim(x, start_index=minibatch_idx * minibatch_size,
                                                   slice_size=minibatch_size, axis=0), batch)
        (_, step_metrics), step_grads = grad_fn(state.params, state.apply_fn, minibatch, rngs[minibatch_idx])
        return step_grads, step_metrics

    def _scan_step(carry, minibatch_idx):
        step_grads, step_metrics = _minibatch_step(minibatch_idx)
        carry = jax.tree_util.tree_map(jnp.add, carry, (step_grads, step_metrics))
        return carry, None

    grads_shapes, metrics_shape = jax.eval_shape(_minibatch_step, 0)
    grads = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), grads_shapes)
    metrics = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), metrics_shape)
    (grads, metrics), _ = jax.lax.scan(_scan_step, init=(grads, metrics), xs=jnp.arange(num_minibatches),
                                       length=num_minibatches)
    grads = jax.tree_util.tree_map(lambda g: g / num_minibatches, grads)
    return grads, metrics


def fold_rng_over_axis(rng: jax.Array, axis_name: str) -> jax.Array:
    """Seed 001: a different key per device index along the axis."""
    axis_index = jax.lax.axis_index(axis_name)
    return jax.random.fold_in(rng, axis_index)


class DPClassifier(nn.Module):
    """Seed 001's classifier: Dense(hidden) -> silu -> Dropout -> Dense(classes), in `dtype`."""

    hidden_size: int = 512
    num_classes: int = 10
    dropout_rate: float = 0.1
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = nn.Dense(features=self.hidden_size, dtype=self.dtype, name="input_dense")(x)
        x = nn.silu(x)
        x = nn.Dropout(rate=self.dropout_rate, deterministic=not train)(x)
        x = nn.Dense(features=self.num_classes, dtype=self.dtype, name="output_dense")(x)
        return x.astype(jnp.float32)


# -- Seed 001's FSDP: parameters sharded over the data axis --------------------------------------

Parameter = Any  # jax.Array | nn.Partitioned


def shard_params(params: PyTree, axis_name: str, min_weight_size: int = 2**18) -> PyTree:
    """Shards each parameter larger than min_weight_size along its largest dim that the axis
    divides, keeping this device's slice (lax.dynamic_slice_in_dim at axis_index)."""
    axis_idx = jax.lax.axis_index(axis_name)
    axis_size = jax.lax.psum(1, axis_name)

    def _split(x: Parameter) -> Parameter:
        if isinstance(x, nn.Partitioned):
            value, names = x.value, x.names
        else:
            value = x
            names = (None,) * value.ndim
        if axis_name in names or value.size <= min_weight_size:
            return x
        shape = value.shape
        idx = np.argsort(shape)[::-1]  # Shard along largest possible axis.
        for i in idx:
            if shape[i] % axis_size == 0 and names[i] is None:
                split_size = shape[i] // axis_size
                return nn.Partitioned(
                    value=jax.lax.dynamic_slice_in_dim(value, axis_idx * split_size, split_size, axis=i),
                    names=names[:i] + (axis_name,) + names[i + 1:])
        return x

    return jax.tree_util.tree_map(_split, params, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def gather_array_with_mean_grads(x: jax.Array, axis: int, axis_name: str):
    """all_gather whose gradient is the pmean_scatter (jax.custom_gradient)."""
    axis_size = jax.lax.psum(1, axis_name)

    @jax.custom_gradient
    def f(x):
        def grad_fn(g):
            return jax.lax.psum_scatter(g, axis_name, scatter_dimension=axis, tiled=True) / axis_size

        return jax.lax.all_gather(x, axis_name, axis=axis, tiled=True), grad_fn

    return f(x)


def gather_params(params: PyTree, axis_name: str) -> PyTree:
    def _gather(p: Parameter) -> Parameter:
        if isinstance(p, nn.Partitioned) and axis_name in p.names:
            param_shard = p.names
            shard_axis = param_shard.index(axis_name)
            value = gather_array_with_mean_grads(p.value, axis=shard_axis, axis_name=axis_name)
            param_shard = param_shard[:shard_axis] + (None,) + param_shard[shard_axis + 1:]
            if any(name is not None for name in param_shard):
                return nn.Partitioned(value, param_shard)
            return value
        return p

    return jax.tree_util.tree_map(_gather, params, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def shard_module_params(target, axis_name: str, min_weight_size: int = 2**18):
    return nn.map_variables(
        target, trans_in_fn=functools.partial(gather_params, axis_name=axis_name),
        trans_out_fn=functools.partial(shard_params, axis_name=axis_name, min_weight_size=min_weight_size),
        mapped_collections="params", mutable=True)


class FSDPClassifier(nn.Module):
    """Seed 001's FSDP classifier: DPClassifier with each Dense's parameters sharded."""

    hidden_size: int = 512
    num_classes: int = 10
    dropout_rate: float = 0.1
    dtype: Any = jnp.float32
    data_axis_name: str = "data"
    min_weight_size: int = 2**18

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        sharded_dense = shard_module_params(nn.Dense, axis_name=self.data_axis_name,
                                            min_weight_size=self.min_weight_size)
        x = sharded_dense(features=self.hidden_size, dtype=self.dtype, name="input_dense")(x)
        x = nn.silu(x)
        x = nn.Dropout(rate=self.dropout_rate, deterministic=not train)(x)
        x = sharded_dense(features=self.num_classes, dtype=self.dtype, name="output_dense")(x)
        return x.astype(jnp.float32)


def sync_gradients(grads: PyTree, axis_names) -> PyTree:
    """pmean over the axes a gradient is replicated over; a partitioned one is already a mean."""

    def sync_grad(g: Parameter) -> Parameter:
        if isinstance(g, nn.Partitioned):
            replication_axis_names = [name for name in axis_names if name not in jax.tree_util.tree_leaves(g.names)]
            if len(replication_axis_names) == 0:
                return g
            return g.replace(value=jax.lax.pmean(g.value, axis_name=replication_axis_names))
        return jax.lax.pmean(g, axis_name=axis_names)

    return jax.tree_util.tree_map(sync_grad, grads, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def _pmean_all(grads: PyTree, axis_names) -> PyTree:
    """Seed 001's DP gradient sync: every gradient pmean'd."""
    return jax.tree_util.tree_map(lambda g: jax.lax.pmean(g, axis_name=axis_names[0]), grads)


def seed001_dp_functions(model: nn.Module, optimizer, num_minibatches: int, data_axis_name: str = "data",
                         sync=_pmean_all):
    """Seed 001's init_dp, loss_fn and train_step_dp (train_step_fsdp with sync=sync_gradients),
    unchanged but for tree_util.tree_map, returned as (init, train_step) to be wrapped in
    shard_map and jit."""

    def init_dp(rng: jax.Array, x: jax.Array) -> TrainState:
        init_rng, rng = jax.random.split(rng)
        variables = model.init({"params": init_rng}, x, train=False)
        params = variables.pop("params")
        return TrainState.create(apply_fn=model.apply, params=params, tx=optimizer, rng=rng)

    def loss_fn(params: PyTree, apply_fn: Any, batch: Batch, rng: jax.Array):
        dropout_rng = fold_rng_over_axis(rng, data_axis_name)
        logits = apply_fn({"params": params}, batch.inputs, train=True, rngs={"dropout": dropout_rng})
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch.labels)
        correct_pred = jnp.equal(jnp.argmax(logits, axis=-1), batch.labels)
        batch_size = batch.inputs.shape[0]
        step_metrics = {"loss": (loss.sum(), batch_size), "accuracy": (correct_pred.sum(), batch_size)}
        loss = loss.mean()
        return loss, step_metrics

    def train_step_dp(state: TrainState, metrics, batch: Batch):
        rng, step_rng = jax.random.split(state.rng)
        grads, step_metrics = accumulate_gradients(state, batch, step_rng, num_minibatches, loss_fn=loss_fn)
        with jax.named_scope("sync_gradients"):
            grads = sync(grads, (data_axis_name,))
        new_state = state.apply_gradients(grads=grads, rng=rng)
        with jax.named_scope("sync_metrics"):
            step_metrics = jax.tree_util.tree_map(lambda x: jax.lax.psum(x, axis_name=data_axis_name),
                                                  step_metrics)
        if metrics is None:
            metrics = step_metrics
        else:
            metrics = jax.tree_util.tree_map(jnp.add, metrics, step_metrics)
        return new_state, metrics

    return init_dp, train_step_dp
