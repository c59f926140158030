"""meshrun.Array: a sharded array that lives on the cluster, like a jax.Array with a NamedSharding."""
import numpy as np

from meshrun import _eager, _sharding


class NamedSharding:
    """Mirrors jax.sharding.NamedSharding: the cluster's `mesh` and a `spec` (PartitionSpec)."""

    def __init__(self, mesh, spec_entries):
        self.mesh = mesh
        self._entries = tuple(spec_entries)
        self.spec = _sharding.to_partition_spec(self._entries)

    def __eq__(self, other):
        return isinstance(other, NamedSharding) and (self.mesh, self._entries) == (other.mesh, other._entries)

    def __hash__(self):
        return hash((self.mesh, self._entries))

    def __repr__(self):
        return f"NamedSharding(mesh={self.mesh!r}, spec={self.spec})"


class Array(_eager.EagerOps):
    """One global array on the cluster: `shape` (global, row-major), `dtype` (numpy), `sharding`.

    Every worker holds its own block; nothing is on the client until `np.asarray(a)` (or
    `a.fetch()`) assembles the global array from one replica of every block. `a.delete()` frees
    it on the cluster at once (as jax.Array.delete); an array garbage-collected is freed soon
    after, as a jax.Array's buffers are (the Cluster's release thread sends the deletes in
    batches), so a loop that puts a batch per step holds no more than a few. Arrays are
    immutable: copy.copy and copy.deepcopy return the same Array. A donated argument of `cluster.jit` is consumed:
    using it afterwards raises RuntimeError, as JAX does. An array of typed PRNG keys
    (jax.random.key) is held as its words: `shape` and `dtype` are jax.random.key_data's (u32, the
    keys' shape plus a trailing 2), `np.asarray` gives those words, and `key_dtype` is the keys'
    dtype (None for any other array), with which cluster.jit traces it. Operators and jax.Array's
    methods (`loss + 1`, `a * 2`, `a > 0`, `a.T`, `a.sum(axis=0)`, `a.astype(...)`) run on the
    cluster and return meshrun.Arrays (meshrun._eager). Not thread-safe."""

    def __init__(self, cluster, info, logical_dtype=None, key_dtype=None):
        self._cluster = cluster
        self.id = info.id
        self.shape = tuple(int(d) for d in info.shape.dims)
        # bool arrays are stored as f32 0 / 1 on the cluster (as comparisons give them)
        self.dtype = np.dtype(logical_dtype) if logical_dtype is not None else _sharding.dtype_from_proto(info.dtype)
        self._entries = _sharding.spec_from_proto(info.sharding.spec)
        self.key_dtype = key_dtype
        self._deleted = False

    @property
    def sharding(self):
        """A NamedSharding over the cluster's mesh (made when asked: a train step's results are
        rarely looked at)."""
        return NamedSharding(self._cluster.mesh, self._entries)

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        return int(np.prod(self.shape)) if self.shape else 1

    def _check_live(self):
        if self._deleted:
            raise RuntimeError(f"Array '{self.id}' has been deleted or donated")

    def fetch(self) -> np.ndarray:
        """The global array, assembled on the client (jax.device_get)."""
        self._check_live()
        x = self._cluster._get(self.id)
        return x if x.dtype == self.dtype else x.astype(self.dtype)

    def __array__(self, dtype=None, copy=None):
        x = self.fetch()
        return x if dtype is None else x.astype(dtype)

    @property
    def itemsize(self):
        return self.dtype.itemsize

    @property
    def nbytes(self):
        """The global array's bytes (as jax.Array.nbytes; each worker holds its block of it)."""
        return self.size * self.itemsize

    def block_until_ready(self):
        """Returns self, as jax.Array.block_until_ready: cluster.jit and device_put return once
        the workers hold the result, so it is always ready (a deleted or donated array raises
        RuntimeError)."""
        self._check_live()
        return self

    def copy_to_host_async(self):
        """Accepted for jax.Array's API; the copy happens when the array is read (np.asarray)."""
        self._check_live()

    def item(self, *args):
        """The element as a Python scalar (numpy.ndarray.item), fetched from the cluster."""
        return self.fetch().item(*args)

    def tolist(self):
        """The array fetched from the cluster as nested Python lists (numpy.ndarray.tolist)."""
        return self.fetch().tolist()

    def __float__(self):
        return float(self.fetch())

    def __int__(self):
        return int(self.fetch())

    def __format__(self, spec):
        """f"{loss:.4f}" formats the fetched value, as a jax.Array of one element formats."""
        if not spec:
            return repr(self)
        x = self.fetch()
        return format(x.item() if x.size == 1 else x, spec)

    def __getitem__(self, index):
        """numpy indexing of the array fetched from the cluster (the whole array is fetched)."""
        return self.fetch()[index]

    def delete(self):
        """Frees the array on the cluster. Idempotent."""
        if not self._deleted:
            self._deleted = True
            self._cluster._delete(self.id)

    def __del__(self):
        try:
            if not self._deleted:
                self._cluster._release(self.id)
        except Exception:  # noqa: BLE001 (a half-made Array; interpreter shutdown)
            pass

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def is_deleted(self):
        return self._deleted

    def __repr__(self):
        state = " deleted" if self._deleted else ""
        keys = f", key_dtype={self.key_dtype}" if self.key_dtype is not None else ""
        return (f"meshrun.Array(id='{self.id}', shape={self.shape}, dtype={self.dtype}{keys}, "
                f"spec={self.sharding.spec}{state})")
