"""jaxpr -> meshrun GlobalProgram (proto/meshrun/v1/program.proto).

Each supported primitive maps to GlobalOps as the table below says (`SUPPORTED`, printed by
`python -m meshrun.primitives`). A primitive outside it is rejected before anything runs, naming
it and the user's file:line. Values are numbered as JitBuilder numbers them (core/spmd/jit.h):
each op below makes exactly one value, OUTPUT none.

Dtypes: f32 and bf16 compute as themselves; bool values are f32 0/1 on the cluster (as the
comparisons give them); integer (i32/u32) arithmetic -- the step counters optax keeps -- is
computed in f32, exact below 2**24, and converted back for results.
"""
import numpy as np

from meshrun import _sharding, errors
from meshrun.v1 import common_pb2, program_pb2

G = program_pb2.GlobalOp
F32, BF16, I32, U32 = common_pb2.DTYPE_F32, common_pb2.DTYPE_BF16, common_pb2.DTYPE_I32, common_pb2.DTYPE_U32

_UNARY = {"neg": "neg", "exp": "exp", "log": "log", "tanh": "tanh", "logistic": "logistic",
          "sqrt": "sqrt", "rsqrt": "rsqrt", "abs": "abs", "square": "square", "erf": "erf", "erfc": "erfc",
          "sin": "sin", "cos": "cos", "tan": "tan", "atan": "atan", "asin": "asin", "acos": "acos",
          "sinh": "sinh", "cosh": "cosh", "atanh": "atanh", "log1p": "log1p", "expm1": "expm1",
          "exp2": "exp2", "floor": "floor", "ceil": "ceil"}
_BINARY = {"add": "add", "add_any": "add", "sub": "sub", "mul": "mul", "div": "div", "max": "max",
           "min": "min", "pow": "pow"}
_COMPARE = {"eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge"}
_IDENTITY = {"stop_gradient", "copy", "copy_p", "optimization_barrier", "pvary"}
# Collectives in a shard_map body -> ManualCollective's fn.
_MANUAL = {"psum": "psum", "psum_invariant": "psum", "psum2": "psum", "pmax": "pmax", "all_gather": "all_gather", "reduce_scatter": "psum_scatter",
           "ppermute": "ppermute", "all_to_all": "all_to_all"}
_CALLS = {"jit", "pjit", "closed_call", "core_call", "remat", "checkpoint", "custom_jvp_call",
          "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin"}

# The conversion table: primitive -> what runs on the cluster.
SUPPORTED = {
    **{k: f"UNARY {v}" for k, v in _UNARY.items()},
    **{k: f"BINARY {v}" for k, v in _BINARY.items()},
    **{k: f"BINARY {v} (f32 1/0)" for k, v in _COMPARE.items()},
    "integer_pow": "UNARY square / BINARY mul chains (div for negative powers)",
    "round": "UNARY round_away / round_even",
    "select_n": "SELECT (two cases)",
    "and": "mul (bool)", "or": "max (bool)", "not": "1 - x (bool)",
    "dot_general": "DOT_GENERAL", "broadcast_in_dim": "BROADCAST_IN_DIM (layout propagated)",
    "reshape": "RESHAPE", "squeeze": "RESHAPE", "expand_dims": "RESHAPE",
    "transpose": "TRANSPOSE", "slice": "SLICE (unit strides; a dim cut short is gathered)",
    "reduce_sum": "REDUCE sum", "reduce_max": "REDUCE max",
    "reduce_min": "-REDUCE max(-x)", "convert_element_type": "CONVERT (or none)",
    "iota": "IOTA", "sharding_constraint": "CONSTRAINT", "reshard": "CONSTRAINT",
    "scan": "unrolled: INDEX of xs[i], the body inlined, STACK of the ys",
    "concatenate": "CONCATENATE (the dim unsharded)",
    "pad": "SLICE / CONCATENATE with the padding value (no interior padding)",
    "split": "SLICEs",
    "gather": "one-hot SELECT and REDUCE sum, or a one-hot DOT_GENERAL for rows (take_along_axis, "
              "jnp.take of rows, one index)",
    "scatter-add": "the transposes of those gathers",
    "shard_map": "SHARD_MAP_ENTER, the body per device, SHARD_MAP_EXIT",
    **{k: f"MANUAL_COLLECTIVE {v} (in a shard_map body)" for k, v in _MANUAL.items()},
    "axis_index": "AXIS_INDEX (in a shard_map body)",
    "sign": "(x > 0) - (x < 0)", "is_finite": "(x - x) == 0", "clamp": "min(max(x, lo), hi)",
    "argmax": "REDUCE max, then the least index holding it", "argmin": "argmax of -x",
    **{k: "the value itself" for k in _IDENTITY},
    **{k: "its body, inlined" for k in _CALLS},
}


def _summary(eqn):
    """file:line of the innermost frame of the equation's traceback outside installed packages
    (the user's code, not optax's or flax's); JAX's own summary otherwise."""
    try:
        tb = eqn.source_info.traceback
        for f in (tb.frames if tb is not None else []):
            if "/site-packages/" not in f.file_name and "/jax/" not in f.file_name:
                return f"{f.file_name}:{getattr(f, 'start_line', getattr(f, 'line_num', '?'))} ({f.function_name})"
        from jax._src import source_info_util

        return source_info_util.summarize(eqn.source_info)
    except Exception:  # pragma: no cover - private API moved
        return ""


class _V:
    """A value: its id in the program, global shape, logical (numpy) dtype, dtype on the cluster."""

    __slots__ = ("id", "shape", "dtype", "store")

    def __init__(self, id_, shape, dtype, store):
        self.id, self.shape, self.dtype, self.store = id_, tuple(shape), np.dtype(dtype), store


def _is_int(dt):
    return np.issubdtype(np.dtype(dt), np.integer)


def _is_bool(dt):
    return np.dtype(dt) == np.bool_


class Converter:
    """Converts one closed jaxpr. Not thread-safe; one per program."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.program = program_pb2.GlobalProgram()
        self.next_id = 0
        self.consts = []  # arrays uploaded as extra (replicated) inputs, after the arguments
        self._scalars = {}
        self._sites = []  # the user's call sites of the nested calls being inlined
        self._dots = {}  # value id -> (lhs, rhs, lhs_contracting, rhs_contracting) of 2-D dots
        self._manual_depth = 0  # > 0 inside a shard_map body

    def where(self, eqn):
        """The user's file:line of an equation; inside a library's nested jit (jnp.cumsum's), the
        user's line that called it."""
        here = _summary(eqn)
        if here and "/site-packages/" not in here and "/jax/" not in here:
            return here
        return self._sites[-1] if self._sites else (here or "unknown location")

    # -- emitting -------------------------------------------------------------------------------

    def emit(self, kind, operands=(), **fields):
        op = self.program.ops.add()
        op.kind = kind
        op.operands.extend(v.id for v in operands)
        for k, v in fields.items():
            f = getattr(op, k)
            if isinstance(v, (list, tuple)):
                f.extend(v)
            elif hasattr(f, "CopyFrom"):
                f.CopyFrom(v)
            else:
                setattr(op, k, v)
        if kind == G.OUTPUT:
            return None
        self.next_id += 1
        return self.next_id - 1

    def scalar(self, value):
        """A replicated f32 scalar constant (cached)."""
        value = float(value)
        if value not in self._scalars:
            self._scalars[value] = _V(self.emit(G.CONSTANT, value=value), (), np.float32, F32)
        return self._scalars[value]

    def f32(self, v):
        """v as f32 on the cluster (integers and bf16 converted)."""
        if v.store == F32:
            return v
        return _V(self.emit(G.CONVERT, [v], dtype=F32), v.shape, np.float32, F32)

    def unary(self, fn, v):
        return _V(self.emit(G.UNARY, [v], fn=fn), v.shape, v.dtype, v.store)

    def binary(self, fn, a, b, dtype=None):
        if a.shape != b.shape and a.shape and b.shape:
            # lax's rank-preserving broadcasting: dims of size 1 grow to the other operand's.
            if len(a.shape) != len(b.shape):
                raise errors.InvalidArgumentError(f"{fn}: operand shapes {a.shape} and {b.shape} differ in rank")
            shape = tuple(max(x, y) for x, y in zip(a.shape, b.shape))
            a, b = self.broadcast(a, shape), self.broadcast(b, shape)
        if a.store != b.store or a.store not in (F32, BF16):
            a, b = self.f32(a), self.f32(b)
        shape = a.shape or b.shape
        return _V(self.emit(G.BINARY, [a, b], fn=fn), shape, dtype or a.dtype, a.store)

    def broadcast(self, v, shape):
        """v broadcast to `shape` (same rank, v's dims equal or 1), laid out as v is."""
        if v.shape == tuple(shape):
            return v
        vid = self.emit(G.BROADCAST_IN_DIM, [v], shape=list(shape), dims=list(range(len(shape))))
        return _V(vid, shape, v.dtype, v.store)

    # -- the program ----------------------------------------------------------------------------

    def convert(self, closed, args, out_entries):
        """The GlobalProgram for `closed` (a ClosedJaxpr) with arguments [(shape, dtype, spec
        entries)] (each laid out as its array on the cluster), results laid out as out_entries.
        Returns (program, consts): arrays the program captured, to be put on the cluster
        (replicated) and passed after the arguments, in order."""
        ins = []
        for shape, dtype, entries in args:
            store = F32 if _is_bool(dtype) else _sharding.dtype_to_proto(dtype)
            vid = self.emit(G.INPUT, dtype=store, shape=list(shape), spec=_sharding.spec_to_proto(entries))
            ins.append(_V(vid, shape, dtype, store))
        outs = self.run(closed.jaxpr, list(closed.consts), ins)
        for v, entries in zip(outs, out_entries):
            want = _sharding.dtype_to_proto(v.dtype) if not _is_bool(v.dtype) else F32
            if v.store != want:
                v = _V(self.emit(G.CONVERT, [v], dtype=want), v.shape, v.dtype, want)
            self.emit(G.OUTPUT, [v], spec=_sharding.spec_to_proto(entries))
        return self.program, self.consts

    def const(self, value):
        x = np.asarray(value)
        if x.ndim == 0:
            v = self.scalar(x)
            return _V(v.id, (), x.dtype if x.dtype != np.float64 else np.float32, F32)
        if x.dtype == np.float64:
            x = x.astype(np.float32)
        if x.dtype == np.bool_:
            x = x.astype(np.float32)
        store = _sharding.dtype_to_proto(x.dtype)
        self.consts.append(x)
        vid = self.emit(G.INPUT, dtype=store, shape=list(x.shape), spec=common_pb2.PartitionSpec())
        return _V(vid, x.shape, value.dtype if hasattr(value, "dtype") else x.dtype, store)

    def run(self, jaxpr, consts, ins):
        env = {}
        for var, c in zip(jaxpr.constvars, consts):
            env[var] = self.const(c)
        for var, v in zip(jaxpr.invars, ins):
            env[var] = v

        def read(var):
            if type(var).__name__ == "Literal":
                return self.const(var.val)
            return env[var]

        for eqn in jaxpr.eqns:
            outs = self.equation(eqn, [read(v) for v in eqn.invars])
            for var, v in zip(eqn.outvars, outs):
                if type(var).__name__ != "DropVar":
                    env[var] = v
        return [read(v) for v in jaxpr.outvars]

    def equation(self, eqn, ins):
        name = eqn.primitive.name
        p = eqn.params
        avals = [v.aval for v in eqn.outvars]
        out_dtype = np.dtype(avals[0].dtype) if avals and hasattr(avals[0], "dtype") else None
        out_shape = tuple(avals[0].shape) if avals and hasattr(avals[0], "shape") else ()
        try:
            return self._equation(name, p, ins, out_dtype, out_shape, eqn)
        except errors.MeshrunError as e:
            if isinstance(e, errors.UnsupportedPrimitiveError) or "(at " in str(e):
                raise
            raise type(e)(f"{e} (primitive '{name}' at {self.where(eqn)})") from None

    def _unsupported(self, name, eqn, why=""):
        raise errors.UnsupportedPrimitiveError(
            f"primitive '{name}' at {self.where(eqn)} is not supported by meshrun{': ' + why if why else ''} "
            f"(supported: {', '.join(sorted(SUPPORTED))})")

    def _equation(self, name, p, ins, out_dtype, out_shape, eqn):
        if name in _CALLS:
            sub = next((p[k] for k in ("jaxpr", "call_jaxpr", "fun_jaxpr") if p.get(k) is not None), None)
            if sub is None:
                self._unsupported(name, eqn, "no body")
            closed_consts = list(getattr(sub, "consts", []))
            body = getattr(sub, "jaxpr", sub)
            self._sites.append(self.where(eqn))
            try:
                return self.run(body, closed_consts, ins[len(ins) - len(body.invars):])
            finally:
                self._sites.pop()
        if name == "scan":
            return self._scan(eqn, p, ins)
        if name == "shard_map":
            return self._shard_map(name, eqn, p, ins)
        if name in _MANUAL:
            return [self._manual(name, eqn, p, ins[0])]
        if name == "axis_index":
            if not self._manual_depth:
                self._unsupported(name, eqn, "axis_index outside a shard_map body")
            axes = p["axis_name"] if isinstance(p["axis_name"], tuple) else (p["axis_name"],)
            vid = self.emit(G.AXIS_INDEX, axes=list(axes))
            return [_V(vid, (), np.int32, I32)]
        if name in _IDENTITY:
            return ins
        if name in _UNARY:
            (x,) = ins
            if x.store not in (F32, BF16):
                x = self.f32(x)
            return [_V(self.unary(_UNARY[name], x).id, x.shape, out_dtype, x.store)]
        if name in _BINARY:
            return [self.binary(_BINARY[name], ins[0], ins[1], out_dtype)]
        if name in _COMPARE:
            v = self.binary(_COMPARE[name], ins[0], ins[1])
            return [_V(v.id, v.shape, np.bool_, F32)]
        if name == "integer_pow":
            return [self._integer_pow(ins[0], int(p["y"]))]
        if name == "round":  # lax.RoundingMethod: 0 away from zero, 1 to nearest even
            method = int(p.get("rounding_method", 0))
            return [self.unary("round_even" if method == 1 else "round_away", self.f32(ins[0]))]
        if name == "sign":  # (x > 0) - (x < 0), as lax.sign for non-NaN x
            x = self.f32(ins[0])
            zero = self.scalar(0.0)
            return [self.binary("sub", self.binary("gt", x, zero), self.binary("lt", x, zero), out_dtype)]
        if name == "is_finite":  # x - x is 0 for a finite x, NaN for an infinite or NaN one
            x = self.f32(ins[0])
            v = self.binary("eq", self.binary("sub", x, x), self.scalar(0.0))
            return [_V(v.id, v.shape, np.bool_, F32)]
        if name == "clamp":  # lax.clamp(lo, x, hi)
            lo, x, hi = ins
            return [self.binary("min", self.binary("max", x, lo), hi, out_dtype)]
        if name in ("argmax", "argmin"):
            return [self._arg_extreme(name, p, ins[0], out_dtype, out_shape)]
        if name == "select_n":
            return [self._select(name, eqn, ins, out_dtype)]
        if name in ("and", "or", "not"):
            if not all(_is_bool(v.dtype) for v in ins):
                self._unsupported(name, eqn, "bitwise integer ops")
            if name == "not":
                v = self.binary("sub", self.scalar(1.0), ins[0])
            else:
                v = self.binary("mul" if name == "and" else "max", ins[0], ins[1])
            return [_V(v.id, v.shape, np.bool_, F32)]
        if name == "dot_general":
            return [self._dot(p, ins, out_dtype, out_shape)]
        if name == "broadcast_in_dim":
            (x,) = ins
            dims = list(p["broadcast_dimensions"])
            if tuple(out_shape) == x.shape:
                return [x]
            vid = self.emit(G.BROADCAST_IN_DIM, [x], shape=list(out_shape), dims=dims)
            return [_V(vid, out_shape, x.dtype, x.store)]
        if name in ("reshape", "squeeze", "expand_dims"):
            (x,) = ins[:1]
            if name == "reshape" and p.get("dimensions") not in (None, ()):
                self._unsupported(name, eqn, "reshape with a dimensions permutation")
            if tuple(out_shape) == x.shape:
                return [x]
            return [_V(self.emit(G.RESHAPE, [x], shape=list(out_shape)), out_shape, x.dtype, x.store)]
        if name == "concatenate":
            dim = int(p["dimension"])
            if len(ins) == 1:
                return ins
            vals = ins if len({v.store for v in ins}) == 1 else [self.f32(v) for v in ins]
            vid = self.emit(G.CONCATENATE, vals, index=dim)
            return [_V(vid, out_shape, out_dtype, vals[0].store)]
        if name == "gather":
            return [self._gather(name, eqn, p, ins, out_dtype, out_shape)]
        if name == "scatter-add":
            return [self._scatter_add(name, eqn, p, ins, out_dtype)]
        if name == "split":  # lax.split: consecutive slices along `axis`
            (x,) = ins
            axis, outs, start = int(p["axis"]), [], 0
            for size in p["sizes"]:
                starts = [0] * len(x.shape)
                limits = list(x.shape)
                starts[axis], limits[axis] = start, start + size
                shape = tuple(limits[d] - starts[d] for d in range(len(limits)))
                if shape == x.shape:
                    outs.append(x)
                else:
                    outs.append(_V(self.emit(G.SLICE, [x], dims=starts, shape=limits), shape, x.dtype, x.store))
                start += size
            return outs
        if name == "pad":
            return [self._pad(name, eqn, ins[0], ins[1], p["padding_config"], out_dtype)]
        if name == "slice":
            (x,) = ins
            if p.get("strides") not in (None, ()) and any(st != 1 for st in p["strides"]):
                self._unsupported(name, eqn, "strides other than 1")
            if tuple(out_shape) == x.shape:
                return [x]
            vid = self.emit(G.SLICE, [x], dims=list(p["start_indices"]), shape=list(p["limit_indices"]))
            return [_V(vid, out_shape, x.dtype, x.store)]
        if name == "transpose":
            (x,) = ins
            perm = list(p["permutation"])
            if perm == list(range(len(perm))):
                return [x]
            dot = self._dots.get(x.id)
            if perm == [1, 0] and dot is not None:
                # (a . b)^T = b^T . a^T: the GEMM writes the transposed product itself (JAX's
                # weight gradients are dot_generals followed by this transpose).
                lhs, rhs, lc, rc = dot
                vid = self.emit(G.DOT_GENERAL, [rhs, lhs], lhs_contracting=rc, rhs_contracting=lc)
                return [_V(vid, out_shape, x.dtype, x.store)]
            return [_V(self.emit(G.TRANSPOSE, [x], dims=perm), out_shape, x.dtype, x.store)]
        if name in ("reduce_sum", "reduce_max", "reduce_min"):
            x = ins[0]
            axes = list(p["axes"])
            if not axes:
                return [x]
            if x.store not in (F32, BF16):
                x = self.f32(x)
            if name == "reduce_min":
                x = self.unary("neg", x)
            vid = self.emit(G.REDUCE, [x], fn="sum" if name == "reduce_sum" else "max", dims=axes)
            v = _V(vid, out_shape, out_dtype, x.store)
            return [self.unary("neg", v) if name == "reduce_min" else v]
        if name == "convert_element_type":
            return [self._convert(name, eqn, ins[0], np.dtype(p["new_dtype"]))]
        if name == "iota":
            dt = np.dtype(p["dtype"])
            store = I32 if _is_int(dt) else _sharding.dtype_to_proto(dt)
            vid = self.emit(G.IOTA, dtype=store, shape=list(p["shape"]), index=int(p["dimension"]),
                            spec=common_pb2.PartitionSpec())
            return [_V(vid, p["shape"], dt, store)]
        if name in ("sharding_constraint", "reshard"):
            (x,) = ins
            sharding = p.get("sharding") or p.get("dst_sharding")
            spec = getattr(sharding, "spec", sharding)
            entries = _sharding.normalize_spec(spec, self.mesh)
            vid = self.emit(G.CONSTRAINT, [x], spec=_sharding.spec_to_proto(entries))
            return [_V(vid, x.shape, x.dtype, x.store)]
        self._unsupported(name, eqn)

    def _shard_map(self, name, eqn, p, ins):
        """jax.shard_map: operands laid out as in_specs enter the body as this device's blocks; the
        body runs per device with its collectives; results leave laid out as out_specs."""
        body = p["jaxpr"]
        body = getattr(body, "jaxpr", body)
        in_specs, out_specs = p["in_specs"], p["out_specs"]
        blocks = []
        for x, spec, var in zip(ins, in_specs, body.invars):
            entries = _sharding.normalize_spec(spec, self.mesh)
            vid = self.emit(G.SHARD_MAP_ENTER, [x], spec=_sharding.spec_to_proto(entries))
            blocks.append(_V(vid, tuple(var.aval.shape), x.dtype, x.store))
        self._sites.append(self.where(eqn))
        self._manual_depth += 1
        try:
            outs = self.run(body, [], blocks)
        finally:
            self._manual_depth -= 1
            self._sites.pop()
        results = []
        for v, spec, var in zip(outs, out_specs, eqn.outvars):
            entries = _sharding.normalize_spec(spec, self.mesh)
            vid = self.emit(G.SHARD_MAP_EXIT, [v], spec=_sharding.spec_to_proto(entries))
            results.append(_V(vid, tuple(var.aval.shape), v.dtype, v.store))
        return results

    def _manual(self, name, eqn, p, x):
        """A collective in a shard_map body, as ManualCollective (core/spmd/jit.h) runs it."""
        if not self._manual_depth:
            self._unsupported(name, eqn, "a collective outside a shard_map body")
        if p.get("axis_index_groups") is not None:
            self._unsupported(name, eqn, "axis_index_groups")
        axes = p.get("axes", p.get("axis_name"))
        axes = list(axes) if isinstance(axes, (tuple, list)) else [axes]
        fn, dim, dims, tiled = _MANUAL[name], 0, [], bool(p.get("tiled", False))
        if name == "all_gather":
            dim = int(p["all_gather_dimension"])
        elif name == "reduce_scatter":
            dim = int(p["scatter_dimension"])
        elif name == "all_to_all":
            dim, dims = int(p["split_axis"]), [int(p["concat_axis"])]
        elif name == "ppermute":
            dims = [int(i) for pair in p["perm"] for i in pair]
        shape = tuple(v.aval.shape for v in eqn.outvars)[0]
        if x.store not in (F32, BF16):
            self._unsupported(name, eqn, f"a {x.dtype} operand")
        vid = self.emit(G.MANUAL_COLLECTIVE, [x], fn=fn, axes=axes, index=dim, dims=dims, value=1.0 if tiled else 0.0)
        return _V(vid, shape, x.dtype, x.store)

    def _scan(self, eqn, p, ins):
        """lax.scan unrolled: iteration i reads xs[i] (INDEX along the stacked dim 0) and the ys
        are stacked (STACK), as flax.linen.scan's layers are. A partitioned stacked dim is
        all_gathered for INDEX."""
        body, length = p["jaxpr"], int(p["length"])
        nc, ncarry = int(p["num_consts"]), int(p["num_carry"])
        consts, carry, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
        ys = [None] * length
        order = range(length - 1, -1, -1) if p.get("reverse") else range(length)
        self._sites.append(self.where(eqn))
        try:
            for i in order:
                xi = [_V(self.emit(G.INDEX, [x], index=i), x.shape[1:], x.dtype, x.store) for x in xs]
                outs = self.run(body.jaxpr, list(body.consts), list(consts) + list(carry) + xi)
                carry, ys[i] = outs[:ncarry], outs[ncarry:]
        finally:
            self._sites.pop()
        stacked = []
        for k in range(len(eqn.outvars) - ncarry):
            parts = [ys[i][k] for i in range(length)]
            if length == 0:
                self._unsupported("scan", eqn, "length 0")
            vid = self.emit(G.STACK, parts)
            stacked.append(_V(vid, (length,) + parts[0].shape, parts[0].dtype, parts[0].store))
        return list(carry) + stacked

    def _arg_extreme(self, name, p, x, out_dtype, out_shape):
        """argmax / argmin along one axis: the least index holding the extreme, as lax's
        (indices exact below 2**24): min over the axis of where(x == extreme, iota, size)."""
        (axis,) = p["axes"]
        x = self.f32(x)
        if name == "argmin":
            x = self.unary("neg", x)
        kept = [d for d in range(len(x.shape)) if d != axis]
        m = _V(self.emit(G.REDUCE, [x], fn="max", dims=[axis]), out_shape, np.float32, F32)
        mb = _V(self.emit(G.BROADCAST_IN_DIM, [m], shape=list(x.shape), dims=kept), x.shape, np.float32, F32)
        hit = self.binary("eq", x, mb)
        iota = _V(self.emit(G.IOTA, dtype=F32, shape=list(x.shape), index=axis, spec=common_pb2.PartitionSpec()),
                  x.shape, np.float32, F32)
        size = self.scalar(float(x.shape[axis]))
        # where(hit, iota, size) = size + hit * (iota - size): exact for these integers
        cand = self.binary("add", self.binary("mul", hit, self.binary("sub", iota, size)), size)
        neg = self.unary("neg", cand)
        best = _V(self.emit(G.REDUCE, [neg], fn="max", dims=[axis]), out_shape, np.float32, F32)
        v = self.unary("neg", best)
        return _V(v.id, out_shape, out_dtype, F32)

    # Gathers and their transposes along one indexed axis, as one-hot selections (exact; an index
    # out of range selects nothing, where JAX's FILL_OR_DROP mode fills NaN):
    #   take_along_axis  operand [B, C], indices [B, J, 1], batching dim 0 -> [B, J]
    #   jnp.take rows    operand [V, D], indices [N, 1] -> [N, D] (a one-hot matmul)
    #   one index        operand [..], indices [1] -> the operand without the indexed axis

    def _index_form(self, name, eqn, operand_shape, idx, indexed, batch_op, batch_ix, window):
        k = indexed
        r = len(operand_shape)
        if idx.shape[-1:] != (1,):
            self._unsupported(name, eqn, "indices whose last dim is not 1")
        if batch_op == (0,) and batch_ix == (0,) and r == 2 and k == 1 and len(idx.shape) == 3:
            return "along"
        if not batch_op and not batch_ix and r == 2 and k == 0 and len(idx.shape) == 2 and window == (1,):
            return "rows"
        if not batch_op and not batch_ix and idx.shape == (1,):
            return "one"
        self._unsupported(name, eqn, "this gather / scatter form (supported: take_along_axis, jnp.take "
                                     "of rows, a single index)")

    def _iota(self, shape, dim):
        vid = self.emit(G.IOTA, dtype=F32, shape=list(shape), index=dim, spec=common_pb2.PartitionSpec())
        return _V(vid, shape, np.float32, F32)

    def _mask(self, shape, dim, idx, idx_dims):
        """(iota along `dim` of `shape`) == idx broadcast from its dims `idx_dims` (f32 1 / 0)."""
        i = self.f32(idx)
        ib = _V(self.emit(G.BROADCAST_IN_DIM, [i], shape=list(shape), dims=list(idx_dims)), shape, np.float32, F32)
        return self.binary("eq", self._iota(shape, dim), ib)

    def _reshape(self, x, shape):
        shape = tuple(shape)
        if x.shape == shape:
            return x
        return _V(self.emit(G.RESHAPE, [x], shape=list(shape)), shape, x.dtype, x.store)

    def _pick(self, pred, on_false, on_true, dtype):
        return _V(self.emit(G.SELECT, [pred, on_false, on_true]), pred.shape, dtype, F32)

    def _gather(self, name, eqn, p, ins, out_dtype, out_shape):
        op, idx = ins
        dn = p["dimension_numbers"]
        if len(dn.start_index_map) != 1 or tuple(dn.collapsed_slice_dims) != tuple(dn.start_index_map):
            self._unsupported(name, eqn, "more than one indexed axis")
        k = dn.start_index_map[0]
        ones = {k, *dn.operand_batching_dims}
        if any(p["slice_sizes"][d] != (1 if d in ones else op.shape[d]) for d in range(len(op.shape))):
            self._unsupported(name, eqn, "windows smaller than the operand")
        form = self._index_form(name, eqn, op.shape, idx, k, tuple(dn.operand_batching_dims),
                                tuple(dn.start_indices_batching_dims), tuple(dn.offset_dims))
        x = self.f32(op)
        zero = self.scalar(0.0)
        if form == "along":  # out[b, j] = op[b, idx[b, j]]
            (b, c), j = op.shape, idx.shape[1]
            mask = self._mask((b, j, c), 2, self._reshape(idx, (b, j)), (0, 1))
            xb = _V(self.emit(G.BROADCAST_IN_DIM, [x], shape=[b, j, c], dims=[0, 2]), (b, j, c), np.float32, F32)
            picked = self._pick(mask, zero, xb, np.float32)
            v = _V(self.emit(G.REDUCE, [picked], fn="sum", dims=[2]), (b, j), np.float32, F32)
        elif form == "rows":  # out[n, :] = op[idx[n], :]: one_hot(idx) @ op
            (vocab, _), n = op.shape, idx.shape[0]
            onehot = self._mask((n, vocab), 1, self._reshape(idx, (n,)), (0,))
            vid = self.emit(G.DOT_GENERAL, [onehot, x], lhs_contracting=[1], rhs_contracting=[0])
            v = _V(vid, out_shape, np.float32, F32)
        else:  # out = op[..., idx, ...]
            mask = self._mask(op.shape, k, self._reshape(idx, ()), ())
            picked = self._pick(mask, zero, x, np.float32)
            v = _V(self.emit(G.REDUCE, [picked], fn="sum", dims=[k]), tuple(d for i, d in enumerate(op.shape) if i != k),
                   np.float32, F32)
        v = self._reshape(v, out_shape)
        return _V(v.id, out_shape, out_dtype, F32) if op.store == F32 else self._convert("gather", eqn, v, out_dtype)

    def _scatter_add(self, name, eqn, p, ins, out_dtype):
        op, idx, upd = ins
        dn = p["dimension_numbers"]
        if len(dn.scatter_dims_to_operand_dims) != 1 or \
                tuple(dn.inserted_window_dims) != tuple(dn.scatter_dims_to_operand_dims):
            self._unsupported(name, eqn, "more than one indexed axis")
        k = dn.scatter_dims_to_operand_dims[0]
        form = self._index_form(name, eqn, op.shape, idx, k, tuple(dn.operand_batching_dims),
                                tuple(dn.scatter_indices_batching_dims), tuple(dn.update_window_dims))
        u = self.f32(upd)
        zero = self.scalar(0.0)
        if form == "along":  # out[b, c] = op[b, c] + sum_j [idx[b, j] == c] upd[b, j]
            (b, c), j = op.shape, idx.shape[1]
            mask = self._mask((b, j, c), 2, self._reshape(idx, (b, j)), (0, 1))
            ub = _V(self.emit(G.BROADCAST_IN_DIM, [self._reshape(u, (b, j))], shape=[b, j, c], dims=[0, 1]),
                    (b, j, c), np.float32, F32)
            spread = self._pick(mask, zero, ub, np.float32)
            add = _V(self.emit(G.REDUCE, [spread], fn="sum", dims=[1]), (b, c), np.float32, F32)
        elif form == "rows":  # out = op + one_hot(idx)^T @ upd
            (vocab, _), n = op.shape, idx.shape[0]
            onehot = self._mask((n, vocab), 1, self._reshape(idx, (n,)), (0,))
            vid = self.emit(G.DOT_GENERAL, [onehot, u], lhs_contracting=[0], rhs_contracting=[0])
            add = _V(vid, op.shape, np.float32, F32)
        else:
            mask = self._mask(op.shape, k, self._reshape(idx, ()), ())
            others = [d for d in range(len(op.shape)) if d != k]
            ub = _V(self.emit(G.BROADCAST_IN_DIM, [u], shape=list(op.shape), dims=others), op.shape, np.float32, F32)
            add = self._pick(mask, zero, ub, np.float32)
        v = self.binary("add", self.f32(op), add)
        return _V(v.id, op.shape, out_dtype, F32)

    def _pad(self, name, eqn, x, value, config, out_dtype):
        """lax.pad without interior padding: per dim, a slice for negative edges and a
        concatenation with blocks of the padding value for positive ones."""
        if any(interior != 0 for _, _, interior in config):
            self._unsupported(name, eqn, "interior padding")
        if value.shape:
            self._unsupported(name, eqn, "a padding value that is not a scalar")
        for d, (lo, hi, _) in enumerate(config):
            if lo < 0 or hi < 0:
                starts = [0] * len(x.shape)
                limits = list(x.shape)
                starts[d] = max(0, -lo)
                limits[d] = x.shape[d] - max(0, -hi)
                vid = self.emit(G.SLICE, [x], dims=starts, shape=limits)
                shape = list(x.shape)
                shape[d] = limits[d] - starts[d]
                x = _V(vid, shape, x.dtype, x.store)
            parts = []
            for size in (max(0, lo), None, max(0, hi)):
                if size is None:
                    parts.append(x)
                elif size > 0:
                    shape = list(x.shape)
                    shape[d] = size
                    fill = self.broadcast(self.f32(value) if x.store == F32 else value, ())
                    vid = self.emit(G.BROADCAST_IN_DIM, [fill], shape=shape, dims=[])
                    parts.append(_V(vid, shape, x.dtype, F32))
            if len(parts) > 1:
                if any(q.store != x.store for q in parts):
                    parts = [self.f32(q) for q in parts]
                shape = list(x.shape)
                shape[d] = sum(q.shape[d] for q in parts)
                vid = self.emit(G.CONCATENATE, parts, index=d)
                x = _V(vid, shape, x.dtype, parts[0].store)
        return _V(x.id, x.shape, out_dtype, x.store)

    def _integer_pow(self, x, y):
        if x.store not in (F32, BF16):
            x = self.f32(x)
        if y == 0:
            return self.binary("add", self.binary("mul", x, self.scalar(0.0)), self.scalar(1.0))
        n = abs(y)
        if n == 2:
            acc = self.unary("square", x)
        else:  # square-and-multiply, as XLA expands integer_pow
            acc, base = None, x
            while n:
                if n & 1:
                    acc = base if acc is None else self.binary("mul", acc, base)
                n >>= 1
                if n:
                    base = self.binary("mul", base, base)
        return self.binary("div", self.scalar(1.0), acc) if y < 0 else acc

    def _select(self, name, eqn, ins, out_dtype):
        pred, cases = ins[0], ins[1:]
        if len(cases) != 2:
            self._unsupported(name, eqn, f"{len(cases)} cases (2 supported)")
        a, b = cases
        if a.store != b.store or a.store not in (F32, BF16):
            a, b = self.f32(a), self.f32(b)
        p = self.f32(pred)  # a bool (f32 1 / 0) or an int32 case index 0 / 1
        shape = a.shape or b.shape or pred.shape
        vid = self.emit(G.SELECT, [p, a, b])
        return _V(vid, shape, out_dtype, a.store)

    def _dot(self, p, ins, out_dtype, out_shape):
        lhs, rhs = ins
        (lc, rc), (lb, rb) = p["dimension_numbers"]
        if lhs.store not in (F32, BF16) or rhs.store not in (F32, BF16) or lhs.store != rhs.store:
            lhs, rhs = self.f32(lhs), self.f32(rhs)
        vid = self.emit(G.DOT_GENERAL, [lhs, rhs], lhs_contracting=list(lc), rhs_contracting=list(rc),
                        lhs_batch=list(lb), rhs_batch=list(rb))
        v = _V(vid, out_shape, lhs.dtype, lhs.store)
        if not lb and len(lhs.shape) == 2 and len(rhs.shape) == 2:
            self._dots[vid] = (lhs, rhs, list(lc), list(rc))
        want = _sharding.dtype_to_proto(out_dtype) if out_dtype in (np.float32,) or str(out_dtype) == "bfloat16" else v.store
        if want != v.store:
            v = _V(self.emit(G.CONVERT, [v], dtype=want), out_shape, out_dtype, want)
        return v

    def _convert(self, name, eqn, x, to):
        if to == x.dtype:
            return x
        if _is_bool(to):
            v = self.binary("ne", x, self.scalar(0.0))
            return _V(v.id, v.shape, np.bool_, F32)
        if _is_int(to):
            if to not in (np.int32, np.uint32):
                self._unsupported(name, eqn, f"conversion to {to}")
            if _is_int(x.dtype) or _is_bool(x.dtype):
                return _V(x.id, x.shape, to, x.store)  # integers stay exact in f32 below 2**24
            v = self.f32(x)
            return _V(self.emit(G.CONVERT, [v], dtype=_sharding.dtype_to_proto(to)), x.shape, to,
                      _sharding.dtype_to_proto(to))
        want = _sharding.dtype_to_proto(to)  # f32 or bf16
        v = x if x.store in (F32, BF16) else self.f32(x)
        if v.store != want:
            v = _V(self.emit(G.CONVERT, [v], dtype=want), x.shape, to, want)
        return _V(v.id, x.shape, to, v.store)
