"""Meshes, PartitionSpecs and dtypes between JAX's Python objects and meshrun's protos.

A meshrun mesh is JAX's: named axes, devices (worker ranks) laid out row-major over them, as
`Mesh(mesh_utils.create_device_mesh((2, 4)), ('data', 'model'))` lays out devices 0..7.
"""
import numpy as np

from meshrun import errors
from meshrun.v1 import common_pb2

try:  # bfloat16 comes with jax (ml_dtypes)
    import ml_dtypes

    _BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - numpy-only installs have no bf16
    _BF16 = None

_TO_PROTO = {
    np.dtype(np.float32): common_pb2.DTYPE_F32,
    np.dtype(np.int32): common_pb2.DTYPE_I32,
    np.dtype(np.uint32): common_pb2.DTYPE_U32,
    np.dtype(np.uint8): common_pb2.DTYPE_U8,
}
if _BF16 is not None:
    _TO_PROTO[_BF16] = common_pb2.DTYPE_BF16
_FROM_PROTO = {v: k for k, v in _TO_PROTO.items()}


def dtype_to_proto(dtype) -> int:
    """meshrun's DType for a numpy/JAX dtype; InvalidArgumentError naming it otherwise."""
    dt = np.dtype(dtype)
    if dt not in _TO_PROTO:
        names = ", ".join(sorted(str(d) for d in _TO_PROTO))
        raise errors.InvalidArgumentError(f"dtype {dt} is not supported by meshrun; expected one of {names}")
    return _TO_PROTO[dt]


# The dtype the cluster holds a host array of as (device_put's conversions): bool as f32 0 / 1,
# float64 and int64 narrowed as JAX does without x64; any other dtype as itself.
_STORED_AS = {np.dtype(np.bool_): np.dtype(np.float32), np.dtype(np.float64): np.dtype(np.float32),
              np.dtype(np.int64): np.dtype(np.int32)}


# JAX's unsigned integers narrower than 32 bits -> their width. Inside a program (meshrun._convert)
# they are u32 values within their range: JAX's 8-bit random bits, which its bf16 samplers draw,
# and the bit arithmetic those samplers do on them; the converter wraps what could leave the range.
# Not an array dtype of the cluster's for uint16 (device_put's uint8 stays u8, datasets' bytes).
NARROW_UNSIGNED = {np.dtype(np.uint8): 8, np.dtype(np.uint16): 16}


def carrier_dtype(dtype) -> np.dtype:
    """The dtype a program holds values of `dtype` in: u32 for a narrow unsigned integer
    (NARROW_UNSIGNED), else `dtype` itself."""
    dt = np.dtype(dtype)
    return np.dtype(np.uint32) if dt in NARROW_UNSIGNED else dt


def stored_dtype(dtype) -> np.dtype:
    dt = np.dtype(dtype)
    if not dt.isnative:
        dt = dt.newbyteorder("=")  # a big-endian array is held as its values, as jnp.asarray does
    return _STORED_AS.get(dt, dt)


def dtype_from_proto(dtype: int) -> np.dtype:
    if dtype not in _FROM_PROTO:
        raise errors.InvalidArgumentError(f"unknown meshrun dtype {dtype}")
    return _FROM_PROTO[dtype]


class Mesh:
    """The cluster's mesh, as jax.sharding.Mesh describes one: `axis_names`, `shape` (a dict of
    axis name -> size, in order), `devices` (the worker ranks, row-major). Immutable."""

    def __init__(self, axes):
        self._axes = tuple((str(n), int(s)) for n, s in axes)
        self.axis_names = tuple(n for n, _ in self._axes)
        self.shape = dict(self._axes)
        sizes = [s for _, s in self._axes]
        self.size = int(np.prod(sizes)) if sizes else 1
        self.devices = np.arange(self.size).reshape(sizes)

    @classmethod
    def from_proto(cls, proto):
        return cls((a.name, a.size) for a in proto.axes)

    def to_proto(self):
        m = common_pb2.Mesh()
        for n, s in self._axes:
            a = m.axes.add()
            a.name, a.size = n, s
        return m

    def coords(self, rank: int):
        """The rank's index on each axis (row-major, the first axis major)."""
        return [int(c) for c in np.unravel_index(rank, [s for _, s in self._axes])] if self._axes else []

    def __eq__(self, other):
        return isinstance(other, Mesh) and self._axes == other._axes

    def __hash__(self):
        return hash(self._axes)

    def __repr__(self):
        return "Mesh(" + ", ".join(f"'{n}': {s}" for n, s in self._axes) + ")"


def _entries(spec):
    """A PartitionSpec (jax's, a tuple, or None) as a list of tuples of axis names."""
    if spec is None:
        return []
    out = []
    for e in tuple(spec):
        if e is None:
            out.append(())
        elif isinstance(e, str):
            out.append((e,))
        elif isinstance(e, (tuple, list)):
            out.append(tuple(str(a) for a in e))
        else:
            raise errors.InvalidArgumentError(
                f"PartitionSpec entry {e!r}: expected None, a mesh axis name or a tuple of names")
    return out


def _is_named_sharding(sharding):
    """Whether `sharding` is a NamedSharding (jax's or meshrun's: a mesh and a spec), not a spec."""
    return hasattr(sharding, "mesh") and hasattr(sharding, "spec")


def check_rank(sharding, shape, what):
    """InvalidArgumentError when `sharding` (a PartitionSpec or NamedSharding) has more entries
    than `shape` has dims, as jax.device_put and jax.jit refuse it ("only valid for values of rank
    at least N"); trailing Nones count, as in JAX. `what` names the value in the message."""
    spec = sharding.spec if _is_named_sharding(sharding) else sharding
    n = len(_entries(spec))
    if n > len(shape):
        raise errors.InvalidArgumentError(
            f"{what}: PartitionSpec {spec} has {n} entries but the value has rank {len(shape)} "
            f"(shape {list(shape)}); a sharding is only valid for values of rank at least {n}")


def normalize_spec(sharding, mesh: Mesh):
    """The entries (tuples of axis names) of a PartitionSpec or NamedSharding for `mesh`.

    A NamedSharding may be over any mesh with the cluster's axis names and sizes (e.g. the seeds'
    Mesh(create_device_mesh((2, 4)), ('data', 'model')) on 8 emulated devices); InvalidArgumentError
    otherwise, or for an axis the mesh lacks or uses twice."""
    spec = sharding
    if _is_named_sharding(sharding):
        theirs = sharding.mesh
        axes = tuple(theirs.shape.items()) if hasattr(theirs, "shape") else ()
        if tuple(axes) != tuple(mesh.shape.items()):
            raise errors.InvalidArgumentError(
                f"sharding's mesh {dict(axes)} differs from the cluster's mesh {mesh.shape}: "
                "expected the same axis names and sizes")
        spec = sharding.spec
    entries = _entries(spec)
    seen = set()
    for e in entries:
        for a in e:
            if a not in mesh.shape:
                raise errors.InvalidArgumentError(
                    f"PartitionSpec {spec}: axis '{a}' is not in the cluster's mesh {mesh.shape}")
            if a in seen:
                raise errors.InvalidArgumentError(f"PartitionSpec {spec}: axis '{a}' is used twice")
            seen.add(a)
    while entries and not entries[-1]:
        entries.pop()
    return tuple(entries)


def spec_to_proto(entries):
    p = common_pb2.PartitionSpec()
    for e in entries:
        p.entries.add().axis_names.extend(e)
    return p


def spec_from_proto(proto):
    entries = [tuple(e.axis_names) for e in proto.entries]
    while entries and not entries[-1]:
        entries.pop()
    return tuple(entries)


def to_partition_spec(entries):
    """A jax.sharding.PartitionSpec for entries (needs jax), else a tuple."""
    try:
        from jax.sharding import PartitionSpec
    except ImportError:  # pragma: no cover
        return tuple(entries)
    return PartitionSpec(*[None if not e else (e[0] if len(e) == 1 else e) for e in entries])


def block_index(mesh: Mesh, entries, rank: int, ndim: int):
    """The index of `rank`'s block along each dim of an array laid out as `entries`."""
    coords = dict(zip(mesh.axis_names, mesh.coords(rank)))
    index = []
    for d in range(ndim):
        i = 0
        for a in (entries[d] if d < len(entries) else ()):
            i = i * mesh.shape[a] + coords[a]
        index.append(i)
    return index


def blocks_per_dim(mesh: Mesh, entries, ndim: int):
    return [int(np.prod([mesh.shape[a] for a in entries[d]])) if d < len(entries) else 1
            for d in range(ndim)]


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def tensor_field_bytes(field: int, x: np.ndarray) -> list:
    """The wire encoding of a Tensor holding `x` as message field `field` of its parent, as a
    list of byte strings and one memoryview of x's own memory, for b"".join: x's bytes are copied
    once, by the join, where building the message and serialising it copies them three times
    (upb copies a bytes field on assignment and a sub-message on construction, and serialising
    copies again). The Tensor goes as two occurrences of the field, its dtype and shape then its
    data, which protobuf parsers merge into one (the wire format's rule for a repeated singular
    message field)."""
    meta = common_pb2.Tensor()
    meta.dtype = dtype_to_proto(x.dtype)
    meta.shape.dims.extend(int(d) for d in x.shape)
    meta = meta.SerializeToString()
    data = np.ascontiguousarray(x).astype(x.dtype.newbyteorder("<"), copy=False)
    data = memoryview(data.reshape(-1).view(np.uint8))
    tag = _varint(field << 3 | 2)  # length-delimited
    data_prefix = b"\x1a" + _varint(data.nbytes)  # Tensor.data: field 3, length-delimited
    return [tag, _varint(len(meta)), meta,
            tag, _varint(len(data_prefix) + data.nbytes), data_prefix, data]


def _read_varint(buf, i: int):
    """The varint at buf[i] and the offset after it."""
    value, shift = 0, 0
    while True:
        if i >= len(buf) or shift > 63:
            raise errors.InternalError("a truncated or overlong varint in a response")
        b = buf[i]
        value |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if b < 0x80:
            return value, i


def _fields(buf, begin: int, end: int):
    """(field number, wire type, value) of each field in buf[begin:end], in order: an int for a
    varint, the (begin, end) offsets of a length-delimited field's bytes; fixed-width fields are
    skipped (none of the messages read this way has them)."""
    i = begin
    while i < end:
        key, i = _read_varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _read_varint(buf, i)
            yield field, wire, value
        elif wire == 2:
            n, i = _read_varint(buf, i)
            if i + n > end:
                raise errors.InternalError("a length-delimited field runs past its message")
            yield field, wire, (i, i + n)
            i += n
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        else:
            raise errors.InternalError(f"wire type {wire} in a response")


def _varints(buf, field_wire, value):
    """A repeated integer field's occurrence: one varint, or a packed run of them."""
    if field_wire == 0:
        return [value]
    out, i = [], value[0]
    while i < value[1]:
        v, i = _read_varint(buf, i)
        out.append(v)
    return out


def _int32(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _tensor_view(buf, begin: int, end: int) -> np.ndarray:
    """A read-only view of the Tensor message at buf[begin:end]: its data is not copied."""
    dtype, dims, data = 0, [], (begin, begin)
    for field, wire, value in _fields(buf, begin, end):
        if field == 1 and wire == 0:
            dtype = value
        elif field == 2 and wire == 2:
            for f, w, v in _fields(buf, *value):
                if f == 1 and w in (0, 2):
                    dims.extend(_varints(buf, w, v))
        elif field == 3 and wire == 2:
            data = value
    dt = dtype_from_proto(dtype)
    count = int(np.prod(dims, dtype=np.int64))
    if count * dt.itemsize != data[1] - data[0]:
        raise errors.InternalError(f"a block of shape {dims} {dt} came with {data[1] - data[0]} bytes")
    return np.frombuffer(buf, dtype=dt, count=count, offset=data[0]).reshape(dims)


def get_array_blocks(buf: bytes):
    """GetArrayResponse's wire bytes -> (ArrayInfo, [block], [rank]): each block a read-only view
    of `buf` (not copied, as parsing the message would copy it), shaped and typed, beside the rank
    it came from. Errors: InternalError for bytes that are not such a message."""
    from meshrun.v1 import coordinator_pb2

    info, blocks, ranks = coordinator_pb2.ArrayInfo(), [], []
    mv = memoryview(buf)
    for field, wire, value in _fields(buf, 0, len(buf)):
        if field == 1 and wire == 2:
            info.MergeFromString(mv[value[0]:value[1]])
        elif field == 2 and wire == 2:
            blocks.append(_tensor_view(buf, *value))
        elif field == 3 and wire in (0, 2):
            ranks.extend(_int32(r) for r in _varints(buf, wire, value))
    if len(blocks) != len(ranks):
        raise errors.InternalError(f"{len(blocks)} blocks came with {len(ranks)} ranks")
    return info, blocks, ranks
