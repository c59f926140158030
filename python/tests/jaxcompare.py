"""Shared by the SDK's tests: a train step run under plain jax.jit, JAX's own sharded jit on 8
emulated devices and cluster.jit, compared."""
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def emulated_mesh():
    return Mesh(mesh_utils.create_device_mesh((2, 4)), ("data", "model"))


def compare(cluster, step, state, state_spec, data, mesh, floor=1e-6):
    """Runs `step(state, x, y) -> (state, loss)` over `data` with plain jax.jit (the reference),
    with JAX's own sharded jit on 8 emulated devices, and with cluster.jit; asserts the losses
    match within 1e-5 relative and the final state is as close to the reference as JAX's sharded
    run is (4x its difference, or `floor` where JAX's sharded run happens to be exact). Returns
    the Jitted."""
    ref_state, ref_losses = state, []
    plain = jax.jit(step)
    with jax.set_mesh(mesh):
        for x, y in data:
            ref_state, loss = plain(ref_state, x, y)
            ref_losses.append(float(loss))
    is_p = lambda s: isinstance(s, P)
    shard = lambda spec: jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), spec, is_leaf=is_p)
    jax_step = jax.jit(step, in_shardings=(shard(state_spec), shard(P("data")), shard(P("data"))),
                       out_shardings=(shard(state_spec), shard(P())))
    jax_state = jax.device_put(state, shard(state_spec))
    with jax.set_mesh(mesh):
        for x, y in data:
            jax_state, _ = jax_step(jax_state, x, y)

    # The same code on the cluster: jax.jit -> cluster.jit.
    on_cluster = cluster.device_put(state, state_spec)
    ours = cluster.jit(step, in_shardings=(state_spec, P("data"), P("data")),
                       out_shardings=(state_spec, P()), donate_argnums=0)
    losses = []
    with jax.set_mesh(mesh):
        for x, y in data:
            on_cluster, loss = ours(on_cluster, cluster.device_put(x, P("data")), cluster.device_put(y, P("data")))
            losses.append(float(np.asarray(loss)))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)

    def max_diff(a, b):  # per leaf, relative to the leaf's scale (Adam's nu holds squares)
        la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
        assert len(la) == len(lb)
        diffs = []
        for x, y in zip(la, lb):
            x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
            diffs.append(float(np.max(np.abs(x - y))) / max(1.0, float(np.max(np.abs(y)))))
        return max(diffs)

    ours_diff = max_diff(on_cluster, ref_state)
    jax_diff = max_diff(jax_state, ref_state)
    print(f"final state vs plain jax.jit: meshrun {ours_diff:.3g}, JAX sharded {jax_diff:.3g}")
    assert ours_diff <= max(4 * jax_diff, floor), (ours_diff, jax_diff)
    return ours
