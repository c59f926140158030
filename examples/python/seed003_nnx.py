"""Seeds 002/003 (Flax NNX's GSPMD guide) on a meshrun cluster: the NNX DotReluDot with
nnx.with_partitioning, MSE loss and nnx.Optimizer(optax.adam), under the 2x4 mesh.

What changed from the seed: the train step is written as a pure function over `nnx.split` state
(merge, step, return `nnx.state`), as jax.jit users of NNX do; `cluster.device_put(state,
nnx.get_partition_spec(state))` places it; `cluster.jit` replaces `nnx.jit`. The module is the
seed's.

Usage: python examples/python/seed003_nnx.py   (MESHRUN_BIN_DIR: where `meshrun` is)
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, PartitionSpec  # noqa: E402

import meshrun  # noqa: E402
from meshrun.seeds import NnxDotReluDot as DotReluDot  # noqa: E402  (the seed's module)


def main():
    mesh = Mesh(devices=np.array(jax.devices()).reshape(2, 4), axis_names=("data", "model"))
    with jax.set_mesh(mesh):
        model = DotReluDot(1024, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        graphdef, state = nnx.split((model, optimizer))
    state_spec = nnx.get_partition_spec(state)
    data_spec = PartitionSpec("data", None)

    def train_step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model: DotReluDot):
            y_pred = model(x)
            return jnp.mean((y_pred - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    with meshrun.local_cluster(mesh="data=2,model=4") as cluster:
        state = cluster.device_put(state, state_spec)
        x = cluster.device_put(np.asarray(jax.random.normal(jax.random.key(1), (8, 1024))), data_spec)
        y = cluster.device_put(np.asarray(jax.random.normal(jax.random.key(2), (8, 1024))), data_spec)
        step = cluster.jit(train_step, in_shardings=(state_spec, data_spec, data_spec),
                           out_shardings=(state_spec, PartitionSpec()), donate_argnums=0)
        with jax.set_mesh(mesh):
            for i in range(5):
                state, loss = step(state, x, y)
                print(f"step {i} loss {float(np.asarray(loss)):.4f}")  # fitting the labels quickly


if __name__ == "__main__":
    main()
