"""Seed 001 (the UvA scaling tutorial's data parallelism with shard_map) on a meshrun cluster of
8 workers on a 1-D `data` mesh: the DP classifier with dropout keyed by fold_rng_over_axis,
gradient accumulation over 4 minibatches, AdamW, pmean'd gradients and psum'd metrics; with
--fsdp, its FSDP version (parameters sharded by nn.map_variables, gathered with all_gather under
a custom_gradient). Initialised on the cluster, trained on Fashion-MNIST batches.

What changed from the seed: `jax.jit(shard_map(...))` becomes `cluster.jit(jax.shard_map(...))`
(JAX 0.10 names the seed's jax.experimental.shard_map `jax.shard_map` and its check_rep
`check_vma`); donate_argnames=("state", "metrics") becomes donate_argnums=(0, 1); the batch is
`cluster.device_put(batch, P("data"))`. The model, loss, step and helpers are the seed's
(meshrun.seeds).

Usage: python examples/python/seed001_dp.py [--fsdp] [--steps N]   (MESHRUN_BIN_DIR: where
`meshrun` is)
"""
import argparse
import gzip
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import meshrun  # noqa: E402
from meshrun.seeds import Batch, DPClassifier, FSDPClassifier, seed001_dp_functions, sync_gradients  # noqa: E402

FASHION_MNIST = "/usr/share/datasets/fashion-mnist"  # Debian's dataset-fashion-mnist


def batches(batch_size, steps):
    with gzip.open(os.path.join(FASHION_MNIST, "train-images-idx3-ubyte.gz")) as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 784)
    with gzip.open(os.path.join(FASHION_MNIST, "train-labels-idx1-ubyte.gz")) as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)
    for i in range(steps):
        sl = slice(i * batch_size, (i + 1) * batch_size)
        yield Batch(inputs=images[sl].astype(np.float32) / 255.0, labels=labels[sl].astype(np.int32))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fsdp", action="store_true")
    ap.add_argument("--steps", type=int, default=15)
    args = ap.parse_args()
    if args.fsdp:
        model = FSDPClassifier(hidden_size=512, num_classes=10, dropout_rate=0.1, min_weight_size=2**4)
        init, train_step = seed001_dp_functions(model, optax.adamw(1e-3), 4, sync=sync_gradients)
    else:
        model = DPClassifier(hidden_size=512, num_classes=10, dropout_rate=0.1)
        init, train_step = seed001_dp_functions(model, optax.adamw(1e-3), 4)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    first = next(batches(128, 1))
    rng = np.asarray(jax.random.PRNGKey(42))
    shapes = jax.eval_shape(jax.shard_map(init, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(),
                                          check_vma=False), rng, first.inputs)
    state_specs = nn.get_partition_spec(shapes)  # the seed's state_fsdp_specs (all P() for DP)
    init_fn = jax.shard_map(init, mesh=mesh, in_specs=(P(), P("data")), out_specs=state_specs, check_vma=False)
    step_fn = jax.shard_map(train_step, mesh=mesh, in_specs=(state_specs, P(), P("data")),
                            out_specs=(state_specs, P()), check_vma=False)
    with meshrun.local_cluster(mesh="data=8") as cluster:
        state = cluster.jit(init_fn)(cluster.device_put(rng, P()), cluster.device_put(first.inputs, P("data")))
        _, metric_shapes = jax.eval_shape(step_fn, jax.eval_shape(init_fn, rng, first.inputs), None, first)
        step = cluster.jit(step_fn, donate_argnums=(0, 1))
        for i, batch in enumerate(batches(128, args.steps)):
            metrics = jax.tree_util.tree_map(lambda x: np.zeros(x.shape, x.dtype), metric_shapes)
            state, metrics = step(state, metrics, cluster.device_put(batch, P("data")))
            loss, n = (np.asarray(v) for v in metrics["loss"])
            correct, _ = (np.asarray(v) for v in metrics["accuracy"])
            print(f"step {i} loss {float(loss) / int(n):.4f} accuracy {float(correct) / int(n):.3f}")


if __name__ == "__main__":
    main()
