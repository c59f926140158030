"""python -m meshrun.bench: seed 000's MLP and seed 003's DotReluDot under the 2x4 `2d` layout
(batch over 'data', hidden over 'model'), trained through cluster.jit, beside the same workloads
through the C++ SDK (`meshrun bench step --layouts 2d`, its own cluster of the same shape, same
run) and plain jax.jit on 8 emulated CPU devices. Prints p50 step times in ms and the tracing
plus conversion time of each program. The C++ SDK also runs the workloads in bf16 compute
(`meshrun bench step --precision bf16`: bf16 GEMMs, f32 parameters and Adam state), printed
beside jax.jit's f32 step as the speed-up over it. A benchmark, not a test: nothing is asserted.

Usage: python -m meshrun.bench [--steps N] [--bin-dir DIR] [--workloads mlp,dot_relu_dot]
"""
import argparse
import os
import re
import statistics
import subprocess
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import mesh_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import meshrun  # noqa: E402
from meshrun import _cluster  # noqa: E402
from meshrun.seeds import MLP, NnxDotReluDot  # noqa: E402

DEPTH, BATCH, LAYERS = 1024, 8, 4


def mlp_case(mesh):
    """(state, state_spec, step(state, *batch) -> (state, loss), batch, batch_specs)."""
    model, tx = MLP(LAYERS, DEPTH), optax.adam(1e-3)
    x = np.asarray(jax.random.normal(jax.random.key(1), (BATCH, DEPTH)))
    with jax.set_mesh(mesh):
        boxed = model.init(jax.random.PRNGKey(0), x)["params"]
    params_spec = nn.get_partition_spec(boxed)
    params = jax.tree_util.tree_map(np.asarray, nn.unbox(boxed))
    opt_state = jax.tree_util.tree_map(np.asarray, tx.init(params))
    opt_spec = optax.tree_map_params(tx, lambda _, s: s, opt_state, params_spec,
                                     transform_non_params=lambda *_: P(), is_leaf=lambda s: isinstance(s, P))

    def step(state, x):
        params, opt_state = state
        loss, grads = jax.value_and_grad(lambda p: model.apply({"params": p}, x).sum())(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return (params, opt_state), (params_spec, opt_spec), step, (x,), (P("data", None),)


def dot_relu_dot_case(mesh):
    with jax.set_mesh(mesh):
        model = NnxDotReluDot(DEPTH, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        graphdef, state = nnx.split((model, optimizer))
    spec = nnx.get_partition_spec(state)
    state = jax.tree_util.tree_map(np.asarray, state)
    x = np.asarray(jax.random.normal(jax.random.key(1), (BATCH, DEPTH)))
    y = np.asarray(jax.random.normal(jax.random.key(2), (BATCH, DEPTH)))

    def step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    return state, spec, step, (x, y), (P("data", None), P("data", None))


CASES = {"mlp": mlp_case, "dot_relu_dot": dot_relu_dot_case}


def p50_ms(fn, steps, warmup=2):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def cpp_step_ms(binary, workloads, steps, precision="f32"):
    out = subprocess.run([binary, "bench", "step", "--workloads", ",".join(workloads), "--layouts", "2d",
                          "--steps", str(steps), "--precision", precision],
                         capture_output=True, text=True, timeout=900)
    found = {}
    for line in out.stdout.splitlines():
        m = re.match(r"(\S+)\s+2d\s+\d+\s+([\d.]+)", line)
        if m:
            found[m.group(1)] = float(m.group(2))
    if out.returncode != 0:
        print(f"meshrun bench step failed ({out.returncode}): {out.stderr.strip()[-400:]}")
    return found


def jax_step_ms(case, mesh, steps):
    state, spec, step, batch, batch_specs = case
    shard = lambda s: jax.tree_util.tree_map(lambda p: NamedSharding(mesh, p), s, is_leaf=lambda p: isinstance(p, P))
    fn = jax.jit(step, in_shardings=(shard(spec), *[shard(s) for s in batch_specs]),
                 out_shardings=(shard(spec), shard(P())), donate_argnums=0)
    holder = [jax.device_put(state, shard(spec))]
    placed = [jax.device_put(b, shard(s)) for b, s in zip(batch, batch_specs)]

    def run():
        with jax.set_mesh(mesh):
            holder[0], loss = fn(holder[0], *placed)
        loss.block_until_ready()

    return p50_ms(run, steps)


def cluster_step_ms(cluster, case, mesh, steps):
    state, spec, step, batch, batch_specs = case
    fn = cluster.jit(step, in_shardings=(spec, *batch_specs), out_shardings=(spec, P()), donate_argnums=0)
    holder = [cluster.device_put(state, spec)]
    placed = [cluster.device_put(b, s) for b, s in zip(batch, batch_specs)]

    def run():
        with jax.set_mesh(mesh):
            holder[0], loss = fn(holder[0], *placed)

    ms = p50_ms(run, steps)
    return ms, fn.last_trace_seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--bin-dir", default=None)
    ap.add_argument("--workloads", default="mlp,dot_relu_dot")
    args = ap.parse_args()
    if args.steps < 1:
        ap.error(f"--steps {args.steps}: expected >= 1")
    names = args.workloads.split(",")
    for n in names:
        if n not in CASES:
            ap.error(f"--workloads: unknown workload '{n}'; expected some of {', '.join(CASES)}")
    binary = _cluster._find_binary(args.bin_dir)
    mesh = Mesh(mesh_utils.create_device_mesh((2, 4)), ("data", "model"))
    cases = {n: CASES[n](mesh) for n in names}
    cpp = cpp_step_ms(binary, names, args.steps)
    cpp_bf16 = cpp_step_ms(binary, names, args.steps, "bf16")
    jax_ms = {n: jax_step_ms(cases[n], mesh, args.steps) for n in names}
    ours = {}
    with meshrun.local_cluster(mesh="data=2,model=4", bin_dir=os.path.dirname(binary)) as cluster:
        for n in names:
            ours[n] = cluster_step_ms(cluster, cases[n], mesh, args.steps)
    print(f"# 2x4 mesh, layout 2d, batch {BATCH}, p50 of {args.steps} steps; one run on this machine")
    print(f"{'workload':<14}{'cluster.jit ms':>16}{'C++ SDK ms':>12}{'ratio':>8}{'jax.jit (8 emulated) ms':>26}"
          f"{'trace+convert s':>17}{'C++ SDK bf16 ms':>17}{'jax f32 / C++ bf16':>20}")
    for n in names:
        ms, trace = ours[n]
        c, b = cpp.get(n), cpp_bf16.get(n)
        ratio = f"{ms / c:.2f}x" if c else "n/a"
        speedup = f"{jax_ms[n] / b:.2f}x" if b else "n/a"
        print(f"{n:<14}{ms:>16.1f}{(f'{c:.1f}' if c else 'n/a'):>12}{ratio:>8}{jax_ms[n]:>26.1f}{trace:>17.2f}"
              f"{(f'{b:.1f}' if b else 'n/a'):>17}{speedup:>20}")


if __name__ == "__main__":
    main()
