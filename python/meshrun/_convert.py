"""jaxpr -> meshrun GlobalProgram (proto/meshrun/v1/program.proto).

Each supported primitive maps to GlobalOps as meshrun._convert_table says (`SUPPORTED`, also
`meshrun.SUPPORTED_PRIMITIVES`). A primitive outside it is rejected before anything runs, naming
it and the user's file:line. Values are numbered as JitBuilder numbers them (core/spmd/jit.h):
each op below makes exactly one value, OUTPUT none.

Dtypes: f32 and bf16 compute as themselves, each bf16 op's result rounded to bf16 as XLA's (an
operand held as f32, a literal, converted first); bool values are f32 0/1 on the cluster (as the
comparisons give them); int32 / uint32 arithmetic, comparisons, selects and reductions run in
their own (wrapping) integers, as XLA's; uint8 / uint16 values (bf16 draws' 8-bit random bits)
are u32 wrapped to their width, through the primitives _NARROW_OK names; the bit operations (and,
or, xor, not, shifts, bitcast_convert_type) and JAX's PRNG keys and bits stay integers
(meshrun._convert_random).

The primitives live in mixins by kind: _convert_elementwise, _convert_layout, _convert_indexing,
_convert_windows (convolutions, pooling), _convert_regions (calls, scan, while, cond, shard_map),
_convert_random, _convert_special (special functions traced from Python implementations),
_convert_linalg (qr) and _convert_callbacks (jax.debug.print, jax.debug.callback);
meshrun._convert_table holds the table; this module the emitting and the jaxpr walk.
"""
import numpy as np

from meshrun import _sharding, errors
from meshrun._convert_callbacks import DEBUG_CALLBACKS, _Callbacks
from meshrun._convert_indexing import _Indexing
from meshrun._convert_elementwise import _COMPARE, _INTEGER_ARITHMETIC, _Elementwise, _integer_store
from meshrun._convert_layout import _Layout
from meshrun._convert_linalg import _Linalg
from meshrun._convert_random import _Random, aval_of, backward_hints, is_key_dtype
from meshrun._convert_special import _Special
from meshrun._convert_regions import _CALLS, _Regions
from meshrun._convert_table import SUPPORTED
from meshrun._convert_windows import _Windows
from meshrun._ir import BF16, EMPTY, F32, G, I32, U32, _V, _is_bf16, _is_bool, _summary
from meshrun.v1 import program_pb2


# Primitives with nested bodies, which convert zero-size values equation by equation inside.
_REGIONS = {"scan", "cond", "while", "shard_map"}
# The value of a reduction (or a contraction) over a zero-size dim.
_EMPTY_IDENTITY = {"reduce_sum": 0.0, "reduce_max": float("-inf"), "reduce_min": float("inf"), "reduce_prod": 1.0,
                   "dot_general": 0.0, "argmax": 0.0, "argmin": 0.0}

# Primitives that take or make uint8 / uint16 values (u32-held, their results wrapped to their
# width where they could leave it: Converter.wrap): what JAX's bf16 samplers do with their 8-bit
# random bits, and layout around them.
_NARROW_OK = {"random_bits", "convert_element_type", "bitcast_convert_type", "and", "or", "xor", "not", "clz",
              "population_count",
              "shift_left", "shift_right_logical", "add", "add_any", "sub", "mul", "div", "rem", "max", "min",
              "clamp", "eq", "ne", "lt", "le", "gt", "ge", "select_n", "broadcast_in_dim", "reshape", "squeeze",
              "expand_dims", "transpose", "slice", "dynamic_slice", "rev", "concatenate", "copy", "copy_p",
              "stop_gradient", "optimization_barrier", "sharding_constraint", "reshard", "pvary"}

# The iterations a while loop whose trip count depends on traced values is unrolled to, each
# guarded by its predicate (cluster.jit's while_trips).
DEFAULT_WHILE_TRIPS = 16

# Primitives whose results on constants are computed while converting (Converter._fold).
_FOLDABLE = {"add", "sub", "mul", "div", "rem", "max", "min", "neg", "abs", "sign", "floor", "ceil", "round",
             "convert_element_type", "lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not", "xor", "select_n",
             "integer_pow", "pow", "sqrt", "exp", "log", "clamp", "broadcast_in_dim", "reshape", "squeeze",
             "shift_left", "shift_right_logical", "shift_right_arithmetic"}



class Converter(_Regions, _Layout, _Indexing, _Random, _Special, _Windows, _Elementwise, _Callbacks, _Linalg):
    """Converts one closed jaxpr. Not thread-safe; one per program."""

    def __init__(self, mesh, while_trips=DEFAULT_WHILE_TRIPS):
        self.mesh = mesh
        self.while_trips = while_trips  # a while loop with a traced trip count: the iterations unrolled
        self.program = program_pb2.GlobalProgram()
        self.next_id = 0
        self.consts = []  # (array, spec entries) uploaded as extra inputs, after the arguments
        self._scalars = {}
        self._sites = []  # the user's call sites of the nested calls being inlined
        self._dots = {}  # value id -> (lhs, rhs, lhs_contracting, rhs_contracting) of 2-D dots
        self._manual_depth = 0  # > 0 inside a shard_map body
        self._int_scalars = {}  # (value, dtype) -> integer constant (meshrun._convert_random)
        self._counts = {}  # draw shape -> its threefry counters, uploaded (meshrun._convert_random)
        self._hints = []  # per jaxpr being run: {var: spec entries} wanted (backward_hints)
        self._layouts = {}  # value id -> spec entries it is known to be laid out as
        self._known_index = {}  # value id -> the constant branch index it holds (platform_index)
        self._concrete = {}  # value id -> the constant (numpy) it holds, for while loops' trip counts
        self.out_entries = []  # the results' layouts, after convert()
        self.init_callbacks()  # callbacks, checks, extra_results (meshrun._convert_callbacks)

    def where(self, eqn):
        """The user's file:line of an equation; inside a library's nested jit (jnp.cumsum's), the
        user's line that called it."""
        here = _summary(eqn)
        if here and "/site-packages/" not in here and "/jax/" not in here:
            return here
        return self._sites[-1] if self._sites else (here or "unknown location")

    # -- emitting -------------------------------------------------------------------------------

    def emit(self, kind, operands=(), **fields):
        if any(v.id == EMPTY for v in operands):
            raise errors.InvalidArgumentError(
                f"a zero-size array {next(v.shape for v in operands if v.id == EMPTY)} reaches an op of kind "
                f"{program_pb2.GlobalOp.Kind.Name(kind)}: meshrun holds no zero-size arrays")
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

    def integer(self, v, store, dtype):
        """v stored as the integer `store` (I32 or U32): the other integer store's bits as they
        are (two's complement), an f32-held integer (a literal, a bool, an argmax) converted."""
        if v.store == store:
            return v
        kind = G.BITCAST_CONVERT if v.store in (I32, U32) else G.CONVERT
        return _V(self.emit(kind, [v], dtype=store), v.shape, dtype, store)

    def unary(self, fn, v):
        return _V(self.emit(G.UNARY, [v], fn=fn), v.shape, v.dtype, v.store)

    def binary(self, fn, a, b, dtype=None):
        if a.shape != b.shape and a.shape and b.shape:
            # lax's rank-preserving broadcasting: dims of size 1 grow to the other operand's.
            if len(a.shape) != len(b.shape):
                raise errors.InvalidArgumentError(f"{fn}: operand shapes {a.shape} and {b.shape} differ in rank")
            shape = tuple(max(x, y) for x, y in zip(a.shape, b.shape))
            a, b = self.broadcast(a, shape), self.broadcast(b, shape)
        out = dtype or a.dtype
        store = _integer_store(out) if fn in _INTEGER_ARITHMETIC else None
        if fn in _COMPARE and _integer_store(a.dtype) is not None and np.dtype(a.dtype) == np.dtype(b.dtype):
            # Integers compared as themselves (f32 would make 2**24 + 1 equal 2**24); the result
            # is a bool held as f32 1 / 0, as every comparison's.
            store = _integer_store(a.dtype)
            a, b = self.integer(a, store, a.dtype), self.integer(b, store, b.dtype)
            v = self.f32(_V(self.emit(G.BINARY, [a, b], fn=fn), a.shape or b.shape, a.dtype, store))
            return _V(v.id, v.shape, np.bool_, F32)
        if store is not None:
            a, b = self.integer(a, store, out), self.integer(b, store, out)
            v = _V(self.emit(G.BINARY, [a, b], fn=fn), a.shape or b.shape, np.dtype(out), store)
            return self.wrap(v) if fn in ("add", "sub", "mul") else v
        if fn == "rem" and (a.store == BF16 or b.store == BF16):
            a, b = self.f32(a), self.f32(b)  # fmod is an f32 loop on the workers
        elif _is_bf16(out) and {a.store, b.store} == {F32, BF16}:
            a, b = self.bf16(a), self.bf16(b)  # a bf16 literal (held as f32) is exact in bf16
        if a.store != b.store or a.store not in (F32, BF16):
            a, b = self.f32(a), self.f32(b)
        shape = a.shape or b.shape
        return self.rounded(_V(self.emit(G.BINARY, [a, b], fn=fn), shape, out, a.store))

    def bf16(self, v):
        """v as bf16 on the cluster (rounded to nearest even; integers through f32)."""
        if v.store == BF16:
            return v
        v = self.f32(v)
        return _V(self.emit(G.CONVERT, [v], dtype=BF16), v.shape, v.dtype, BF16)

    def rounded(self, v):
        """v, a bf16 value computed in f32, rounded to bf16 as XLA rounds every bf16 op's
        result (its CPU computes them in f32); any other v as it is."""
        if _is_bf16(v.dtype) and v.store == F32:
            return _V(self.bf16(v).id, v.shape, v.dtype, BF16)
        return v

    def broadcast(self, v, shape, dims=None):
        """v broadcast to `shape`, laid out as v is: its dims landing on `dims` (default: the same
        rank, v's dims equal or 1)."""
        if v.shape == tuple(shape):
            return v
        dims = list(range(len(shape))) if dims is None else list(dims)
        return _V(self.emit(G.BROADCAST_IN_DIM, [v], shape=list(shape), dims=dims), tuple(shape), v.dtype, v.store)

    # -- the program ----------------------------------------------------------------------------

    def convert(self, closed, args, out_entries):
        """The GlobalProgram for `closed` (a ClosedJaxpr) with arguments [(shape, dtype, spec
        entries)] (each laid out as its array on the cluster), results laid out as out_entries.
        Returns (program, consts): [(array, spec entries)] the program captured, to be put on the
        cluster laid out so (replicated, but for a zero-size result's) and passed after the
        arguments, in order."""
        ins = []
        for shape, dtype, entries in args:
            store = F32 if _is_bool(dtype) else _sharding.dtype_to_proto(dtype)
            vid = self.emit(G.INPUT, dtype=store, shape=list(shape), spec=_sharding.spec_to_proto(entries))
            self._layouts[vid] = tuple(entries)
            ins.append(_V(vid, shape, dtype, store))
        outs = self.run(closed.jaxpr, list(closed.consts), ins, list(out_entries))
        # An unspecified out_sharding: the layout the value is known to have (an argument's, a
        # shard_map's out_specs, a sharding constraint's), as jax.jit keeps it; else the layout
        # the coordinator's sharding propagation gives it, as XLA's lays out jax.jit's results
        # (None here: the call's response says which).
        out_entries = [self._layouts.get(v.id) if e is None else e for v, e in zip(outs, out_entries)]
        self.out_entries = out_entries
        for i, (v, entries) in enumerate(zip(outs, out_entries)):
            if v.id == EMPTY:
                # A zero-size result (jnp.zeros((0, 3)), an empty slice), which no op computes: a
                # zero-size constant laid out as the result, returned as jax.jit returns it.
                entries = tuple(entries) if entries is not None else ((),) * len(v.shape)
                self.out_entries[i] = entries
                v = self.upload(np.zeros(v.shape, v.dtype), entries)
                self.emit(G.OUTPUT, [v], spec=_sharding.spec_to_proto(entries))
                continue
            if v.dtype == np.uint16:
                raise errors.InvalidArgumentError(
                    f"a result of dtype uint16 {list(v.shape)}: meshrun holds no uint16 arrays; convert it "
                    "(to uint32, int32 or a float) inside the function")
            want = _sharding.dtype_to_proto(v.dtype) if not _is_bool(v.dtype) else F32
            if v.store != want:
                v = _V(self.emit(G.CONVERT, [v], dtype=want), v.shape, v.dtype, want)
            if entries is None:
                self.emit(G.OUTPUT, [v], propagated=True)
            else:
                self.emit(G.OUTPUT, [v], spec=_sharding.spec_to_proto(entries))
        self.emit_extra_results()
        return self.program, self.consts

    def const(self, value):
        if is_key_dtype(getattr(value, "dtype", None)):
            # A typed PRNG key the function closes over (jax.random.key(0) outside it): its u32
            # words, as the cluster holds a key argument.
            import jax

            value = np.asarray(jax.random.key_data(value))
        v = self._const(value)
        self._concrete.setdefault(v.id, np.asarray(value))
        return v

    def _const(self, value):
        x = np.asarray(value)
        if x.ndim == 0 and _integer_store(x.dtype) is not None and abs(int(x)) > 2**24:
            return self.int_scalar(int(x), x.dtype)  # as itself: f32 would round it
        if x.ndim == 0:
            v = self.scalar(x)
            return _V(v.id, (), x.dtype if x.dtype != np.float64 else np.float32, F32)
        if x.dtype == np.float64:
            x = x.astype(np.float32)
        if x.dtype == np.bool_:
            x = x.astype(np.float32)
        v = self.upload(x)
        return _V(v.id, v.shape, value.dtype if hasattr(value, "dtype") else x.dtype, v.store)

    def upload(self, x, entries=None):
        """The numpy array x as a program input, put on the cluster (self.consts) laid out as
        `entries` (spec entries; None: replicated)."""
        x = x.astype(_sharding.carrier_dtype(x.dtype)) if x.dtype == np.uint16 else x
        store = F32 if _is_bool(x.dtype) else _sharding.dtype_to_proto(x.dtype)
        entries = tuple(entries) if entries is not None else ()
        self.consts.append((x, entries))
        vid = self.emit(G.INPUT, dtype=store, shape=list(x.shape), spec=_sharding.spec_to_proto(entries))
        return _V(vid, x.shape, x.dtype, store)

    def run(self, jaxpr, consts, ins, out_hints=None):
        """Converts `jaxpr`'s equations; out_hints: the layouts wanted for its results (or None),
        which random draws follow (meshrun._convert_random.backward_hints)."""
        self._hints.append(backward_hints(jaxpr, out_hints, self.mesh) if self._manual_depth == 0 else {})
        try:
            return self._run(jaxpr, consts, ins)
        finally:
            self._hints.pop()

    def out_hints(self, eqn):
        """The layouts wanted for eqn's results, to pass into the body it calls."""
        return [self._hints[-1].get(v) if self._hints and type(v).__name__ == "Var" else None for v in eqn.outvars]

    def _run(self, jaxpr, consts, ins):
        env = {}
        for var, c in zip(jaxpr.constvars, consts):
            env[var] = self.const(c)
        for var, v in zip(jaxpr.invars, ins):
            env[var] = v

        def read(var):
            if type(var).__name__ == "Literal":
                # Typed as the jaxpr types it (a Python 0 is a weak i32, not numpy's i64).
                dtype = getattr(var.aval, "dtype", None)
                return self.const(np.asarray(var.val, dtype=dtype) if dtype is not None else var.val)
            return env[var]

        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            outs = self.equation(eqn, ins)
            for var, v in zip(eqn.outvars, outs):
                if type(var).__name__ != "DropVar":
                    env[var] = v
            self._fold(eqn, ins, outs)
        return [read(v) for v in jaxpr.outvars]

    def _fold(self, eqn, ins, outs):
        """Records the constant results of small scalar arithmetic on constants (a loop bound
        `2 * n`), for a while loop's trip count; the ops still run on the cluster."""
        if eqn.primitive.name not in _FOLDABLE or any(v.id not in self._concrete for v in ins):
            return
        if any(int(np.prod(getattr(o.aval, "shape", ()))) > 16 for o in eqn.outvars):
            return
        vals = [np.asarray(self._concrete[v.id], dtype=a.aval.dtype) for v, a in zip(ins, eqn.invars)]
        try:
            res = eqn.primitive.bind(*vals, **eqn.params)
        except Exception:  # noqa: BLE001 -- not foldable here: the value stays unknown
            return
        res = res if eqn.primitive.multiple_results else [res]
        for o, r in zip(outs, res):
            self._concrete.setdefault(o.id, np.asarray(r))

    def equation(self, eqn, ins):
        name = eqn.primitive.name
        p = eqn.params
        out_shape, out_dtype = aval_of(eqn.outvars[0].aval) if eqn.outvars else ((), None)
        try:
            outs = self._empty_equation(name, p, ins, out_dtype, out_shape, eqn)
            if outs is not None:
                return outs
            if not name.startswith("random_") and name not in _CALLS:
                p, ins = self.key_words(name, p, ins, eqn)
            self._check_narrow(name, eqn, ins)
            return self._equation(name, p, ins, out_dtype, out_shape, eqn)
        except errors.MeshrunError as e:
            if isinstance(e, errors.UnsupportedPrimitiveError) or "(at " in str(e):
                raise
            raise type(e)(f"{e} (primitive '{name}' at {self.where(eqn)})") from None

    def _empty_equation(self, name, p, ins, out_dtype, out_shape, eqn):
        """Zero-size values (the JVPs of cumprod and cummax slice down to them): results of zero
        size are EMPTY values that no op computes; a concatenation drops them, a pad of one is a
        block of its padding value, a reduction or a product over a zero-size dim is its
        identity. None where no zero-size value is involved (or a nested body handles it)."""
        sizes = [int(np.prod(getattr(v.aval, "shape", ()))) for v in eqn.outvars]
        empty_in = [v.id == EMPTY for v in ins]
        if not any(empty_in) and all(sizes) or name in _CALLS or name in _REGIONS or name in DEBUG_CALLBACKS:
            return None
        if not any(sizes):
            return [_V(EMPTY, aval_of(v.aval)[0], aval_of(v.aval)[1], F32 if _integer_store(aval_of(v.aval)[1]) is None
                       else _integer_store(aval_of(v.aval)[1])) for v in eqn.outvars]
        if name == "concatenate":
            kept = [v for v in ins if v.id != EMPTY]
            return kept if len(kept) == 1 else self._layout_equation(name, p, kept, out_dtype, out_shape, eqn)
        if name == "pad" and empty_in[0]:
            return [_V(self._filled(ins[1], ins[0], out_shape).id, out_shape, out_dtype, ins[1].store)]
        if name in _EMPTY_IDENTITY and any(empty_in):  # a reduction over nothing, a dot over nothing
            value = self.scalar(_EMPTY_IDENTITY[name])
            vid = self.emit(G.BROADCAST_IN_DIM, [value], shape=list(out_shape), dims=[])
            return [self._convert(name, eqn, _V(vid, out_shape, np.float32, F32), np.dtype(out_dtype))]
        if any(empty_in) or name not in ("split", "unstack"):
            self._unsupported(name, eqn, "a zero-size operand" if any(empty_in) else "a zero-size result")
        return None

    def _check_narrow(self, name, eqn, ins):
        """Refuses, by name, a primitive over uint8 / uint16 values held in u32 (_sharding.
        NARROW_UNSIGNED: drawn bits and what is computed from them; a uint8 argument stays u8, as
        before) that would not wrap them to their width as XLA does."""
        if name in _NARROW_OK or name in _CALLS or name in _REGIONS:
            return
        carried = [v.dtype for v in ins if v.dtype in _sharding.NARROW_UNSIGNED and v.store == U32]
        outs = [aval_of(v.aval)[1] for v in eqn.outvars]
        carried += [d for d in outs if d is not None and np.dtype(d) == np.uint16]
        if carried:
            self._unsupported(name, eqn, f"over {carried[0]} values (uint8 / uint16 run through "
                              f"{', '.join(sorted(_NARROW_OK))}; convert to uint32 first)")

    def _unsupported(self, name, eqn, why=""):
        raise errors.UnsupportedPrimitiveError(
            f"primitive '{name}' at {self.where(eqn)} is not supported by meshrun{': ' + why if why else ''} "
            f"(supported: {', '.join(sorted(SUPPORTED))})")

    def _equation(self, name, p, ins, out_dtype, out_shape, eqn):
        outs = self._region_equation(name, p, ins, eqn)
        if outs is None and name in DEBUG_CALLBACKS:
            outs = self._debug_callback(name, eqn, p, ins)
        if outs is None:
            outs = self._random_equation(name, p, ins, out_dtype, out_shape, eqn)
        if outs is None:
            outs = self._special_equation(name, p, ins, eqn)
        if outs is None:
            outs = self._elementwise_equation(name, p, ins, out_dtype, out_shape, eqn)
        if outs is None:
            outs = self._layout_equation(name, p, ins, out_dtype, out_shape, eqn)
        if outs is None:
            outs = self._indexing_equation(name, p, ins, out_dtype, out_shape, eqn)
        if outs is None:
            outs = self._window_equation(name, p, ins, out_dtype, out_shape, eqn)
        if outs is None:
            outs = self._linalg_equation(name, p, ins, eqn)
        if outs is None:
            self._unsupported(name, eqn)
        return outs
