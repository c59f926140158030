"""meshrun's Python SDK: run JAX train steps partitioned over a meshrun cluster.

    import meshrun
    with meshrun.local_cluster(mesh="data=2,model=4") as cluster:   # or meshrun.connect("host:port")
        params = cluster.device_put(params, param_specs)             # PartitionSpec pytrees
        step = cluster.jit(train_step, in_shardings=..., out_shardings=..., donate_argnums=0)
        params, loss = step(params, batch)                           # meshrun.Array pytrees
        print(np.asarray(loss))

Names follow JAX (jax.jit, jax.device_put, NamedSharding, PartitionSpec). See meshrun._convert for
the primitives a traced function may use.
"""
from meshrun._array import Array, NamedSharding
from meshrun._cluster import Cluster, connect, local_cluster
from meshrun._convert import SUPPORTED as SUPPORTED_PRIMITIVES
from meshrun._sharding import Mesh
from meshrun import errors

__all__ = ["Array", "Cluster", "Mesh", "NamedSharding", "SUPPORTED_PRIMITIVES", "connect", "errors", "local_cluster"]
