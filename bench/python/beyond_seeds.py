"""Two Flax models beyond the seeds, trained on a local meshrun cluster through the Python SDK and
with jax.jit on as many emulated devices, in one run: ms per step (p50 over --steps after 5
warm-up steps), both losses after the last step.

  mlp:         784-1024-1024-10 with LayerNorm, GELU and dropout; AdamW; batch 128.
  transformer: two blocks (LayerNorm, 4-head self-attention with dropout, a GELU MLP), width 128,
               64 tokens, vocabulary 1000; AdamW; batch 16.

Usage (the build's venv, as scripts/python-env.sh makes it):
  build/venv/bin/python bench/python/beyond_seeds.py --bin-dir build/bin [--models mlp,transformer]
      [--mesh data=2] [--steps 50]
"""
import argparse
import os
import time

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--bin-dir", default="build/bin")
parser.add_argument("--models", default="mlp,transformer")
parser.add_argument("--mesh", default="data=2", help="one 'data' axis: the batch is split over it")
parser.add_argument("--steps", type=int, default=50)
args = parser.parse_args()
devices = int(args.mesh.split("=")[1])
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={devices}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import meshrun  # noqa: E402


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        for width in (1024, 1024):
            x = nn.Dense(width)(x)
            x = nn.gelu(nn.LayerNorm()(x))
            x = nn.Dropout(rate=0.1, deterministic=not train)(x)
        return nn.Dense(10)(x)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=4, dropout_rate=0.1, deterministic=not train)(h, h)
        h = nn.Dense(128)(nn.gelu(nn.Dense(512)(nn.LayerNorm()(x))))
        return x + h


class Transformer(nn.Module):
    @nn.compact
    def __call__(self, tokens, train: bool):
        x = nn.Embed(1000, 128)(tokens)
        for _ in range(2):
            x = Block()(x, train)
        return nn.Dense(1000)(nn.LayerNorm()(x))


def batch(name):
    rng = np.random.default_rng(0)
    if name == "mlp":
        return Mlp(), rng.normal(size=(128, 784)).astype(np.float32), rng.integers(0, 10, size=(128,)).astype(np.int32)
    return (Transformer(), rng.integers(0, 1000, size=(16, 64)).astype(np.int32),
            rng.integers(0, 1000, size=(16, 64)).astype(np.int32))


def functions(model):
    tx = optax.adamw(1e-3)

    def init(key, x):
        params = model.init(key, x, train=False)["params"]
        return params, tx.init(params), jax.random.fold_in(key, 1)

    def step(state, x, y):
        params, opt_state, key = state
        key, dropout_key = jax.random.split(key)

        def loss_fn(p):
            z = model.apply({"params": p}, x, train=True, rngs={"dropout": dropout_key})
            return optax.softmax_cross_entropy_with_integer_labels(z, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, key), loss

    return init, step


def timed(f, state, x, y, steps):
    for _ in range(5):
        state, loss = f(state, x, y)
    float(np.asarray(loss))
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state, loss = f(state, x, y)
        float(np.asarray(loss))  # waits for the step
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times)), float(np.asarray(loss))


def main():
    key = np.asarray(jax.random.PRNGKey(0))
    rows = []
    with meshrun.local_cluster(mesh=args.mesh, bin_dir=args.bin_dir) as cluster:
        for name in args.models.split(","):
            model, x, y = batch(name)
            init, step = functions(model)
            # jax.jit with the same shardings over the emulated devices: the batch split over 'data'.
            mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
            rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
            state = jax.jit(init, out_shardings=rep)(key, x)
            jitted = jax.jit(step, in_shardings=(rep, split, split), out_shardings=(rep, rep), donate_argnums=0)
            jax_ms, jax_loss = timed(jitted, state, jax.device_put(x, split), jax.device_put(y, split), args.steps)
            state = cluster.jit(init, in_shardings=(P(), P("data")), out_shardings=P())(
                cluster.device_put(key, P()), cluster.device_put(x, P("data")))
            ours = cluster.jit(step, in_shardings=(P(), P("data"), P("data")), out_shardings=(P(), P()),
                               donate_argnums=0)
            ms, loss = timed(ours, state, cluster.device_put(x, P("data")), cluster.device_put(y, P("data")),
                             args.steps)
            rows.append((name, ms, jax_ms, loss, jax_loss))
    print(f"# mesh {args.mesh}, p50 of {args.steps} steps; jax.jit on {devices} emulated devices; one run")
    print(f"{'model':<12} {'meshrun ms':>10} {'jax ms':>8} {'jax/meshrun':>11} {'loss':>10} {'jax loss':>10}")
    for name, ms, jax_ms, loss, jax_loss in rows:
        print(f"{name:<12} {ms:>10.1f} {jax_ms:>8.1f} {jax_ms / ms:>10.2f}x {loss:>10.4f} {jax_loss:>10.4f}")


if __name__ == "__main__":
    main()
