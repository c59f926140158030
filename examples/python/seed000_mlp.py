"""Seed 000 (Flax's pjit guide) on a meshrun cluster: the scanned MLP of DotReluDot blocks in a flax
TrainState, optax.adam, trained under the 2x4 ('data', 'model') mesh.

What changed from the seed: `meshrun.local_cluster` (or `meshrun.connect("host:port")`) instead
of 8 emulated devices; the state initialised locally and put on the cluster with
`cluster.device_put(state, state_spec)`; `cluster.jit` instead of `pjit`; the loss returned beside
the state to print it. The model, `init_fn` and `train_step` are the seed's.

Usage: python examples/python/seed000_mlp.py   (MESHRUN_BIN_DIR: where `meshrun` is, e.g. build/bin)
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.experimental import mesh_utils  # noqa: E402
from jax.sharding import Mesh, PartitionSpec  # noqa: E402

import meshrun  # noqa: E402
from meshrun.seeds import MLP  # noqa: E402  (seed 000's DotReluDot and MLP, unchanged)

BATCH, LAYERS, DEPTH = 8, 4, 1024  # the seed's


def init_fn(k, x, model, optimizer):
    variables = model.init(k, x)
    return train_state.TrainState.create(apply_fn=model.apply, params=variables["params"], tx=optimizer)


def main():
    mesh = Mesh(mesh_utils.create_device_mesh((2, 4)), ("data", "model"))
    model, optimizer = MLP(LAYERS, DEPTH), optax.adam(learning_rate=0.001)
    x = jax.random.normal(jax.random.key(1), (BATCH, DEPTH))
    with jax.set_mesh(mesh):
        boxed = init_fn(jax.random.key(0), x, model, optimizer)
    state_spec = nn.get_partition_spec(boxed)
    x_spec = PartitionSpec("data", None)

    def train_step(state, x):
        def loss_unrolled(params):
            y = model.apply({"params": params}, x)
            return y.sum()

        loss, grads = jax.value_and_grad(loss_unrolled)(state.params)
        return state.apply_gradients(grads=grads), loss

    with meshrun.local_cluster(mesh="data=2,model=4") as cluster:
        state = cluster.device_put(nn.unbox(boxed), state_spec)
        xs = cluster.device_put(np.asarray(x), x_spec)
        step = cluster.jit(train_step, in_shardings=(state_spec, x_spec), out_shardings=(state_spec, PartitionSpec()),
                           donate_argnums=0)
        with jax.set_mesh(mesh):
            for i in range(5):
                state, loss = step(state, xs)
                print(f"step {i} loss {float(np.asarray(loss)):.4f}")
        print("collectives the coordinator inserted:", ", ".join(sorted(set(step.last_collectives))))
        cluster.visualize_array_sharding(xs)  # the batch: rows over data, replicated over model


if __name__ == "__main__":
    main()
