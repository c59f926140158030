"""A model beyond the seeds: a Flax CNN (convolutions, max and average pooling) trained on
Fashion-MNIST through cluster.jit, data-parallel over 'data' with the first convolution's output
features over 'model', then evaluated on the test set on the cluster.

What a user changes from plain JAX: `meshrun.local_cluster` (or `meshrun.connect`), the state put
on the cluster with `cluster.device_put`, and `cluster.jit` in place of `jax.jit`; the model, the
loss and the optax optimizer are unchanged.

Usage: python examples/python/cnn_fashion_mnist.py [--steps N]   (MESHRUN_BIN_DIR: build/bin)
"""
import argparse
import gzip
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import meshrun  # noqa: E402

FASHION_MNIST = "/usr/share/datasets/fashion-mnist"  # Debian's dataset-fashion-mnist
BATCH = 64


def load(split):
    """Images [n, 28, 28, 1] f32 in [0, 1] and int32 labels [n] of an IDX split."""
    with gzip.open(os.path.join(FASHION_MNIST, f"{split}-images-idx3-ubyte.gz")) as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28, 1)
    with gzip.open(os.path.join(FASHION_MNIST, f"{split}-labels-idx1-ubyte.gz")) as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)
    return images.astype(np.float32) / 255.0, labels.astype(np.int32)


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(16, (3, 3), kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(),
                                                                 (None, None, None, "model")))(x)
        x = nn.max_pool(nn.relu(x), (2, 2), (2, 2))  # 14 x 14
        x = nn.Conv(32, (3, 3))(x)
        x = nn.avg_pool(nn.relu(x), (2, 2), (2, 2))  # 7 x 7
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    images, labels = load("train")
    test_images, test_labels = load("t10k")
    model, tx = CNN(), optax.adam(3e-3)
    boxed = model.init(jax.random.key(0), images[:BATCH])["params"]
    param_spec = nn.get_partition_spec(boxed)
    params = nn.unbox(boxed)
    opt_state = tx.init(params)
    opt_spec = optax.tree_map_params(tx, lambda _, s: s, opt_state, param_spec,
                                     transform_non_params=lambda *_: P(), is_leaf=lambda s: isinstance(s, P))
    spec = (param_spec, opt_spec)

    def train_step(state, x, y):
        params, opt_state = state

        def loss_fn(p):
            return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, x), y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    def accuracy(params, x, y):
        return jnp.mean(jnp.argmax(model.apply({"params": params}, x), axis=-1) == y)

    with meshrun.local_cluster(mesh="data=2,model=4") as cluster:
        state = cluster.device_put((params, opt_state), spec)
        step = cluster.jit(train_step, in_shardings=(spec, P("data"), P("data")), out_shardings=(spec, P()),
                           donate_argnums=0)
        for i in range(args.steps):
            sl = slice(i * BATCH, (i + 1) * BATCH)
            state, loss = step(state, cluster.device_put(images[sl], P("data")),
                               cluster.device_put(labels[sl], P("data")))
            if i % 20 == 0 or i == args.steps - 1:
                print(f"step {i} loss {float(np.asarray(loss)):.4f}")
        evaluate = cluster.jit(accuracy, in_shardings=(param_spec, P("data"), P("data")), out_shardings=P())
        acc = evaluate(state[0], cluster.device_put(test_images[:1000], P("data")),
                       cluster.device_put(test_labels[:1000], P("data")))
        print(f"test accuracy on 1000 images after {args.steps} steps: {float(np.asarray(acc)):.3f}")


if __name__ == "__main__":
    main()
