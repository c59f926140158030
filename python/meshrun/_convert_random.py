"""JAX's PRNG and the integer bit operations its samplers use, in meshrun._convert.

A key (``key<fry>[...]``) is its raw words on the cluster: a u32 array of the key array's shape
plus a trailing 2, as ``jax.random.key_data`` gives. ``random_bits`` draws with JAX's threefry in
the mode ``jax.config.jax_threefry_partitionable`` names (JAX's default since 0.5:
partitionable), and each worker draws only its block of the result: the block of the layout the
bits are later constrained to (``backward_hints``; flax's ``with_partitioning`` initialisers),
else the whole array (replicated).
"""
import numpy as np

from meshrun import _sharding
from meshrun._convert_regions import _CALLS
from meshrun._ir import F32, G, I32, U32, _V, _is_bf16, _is_int

# Integer (i32, u32) element-wise primitives -> the worker's integer binary fns.
_INT_BINARY = {"and": "and", "or": "or", "xor": "xor", "shift_left": "shift_left",
               "shift_right_logical": "shift_right_logical",
               "shift_right_arithmetic": "shift_right_arithmetic"}
_KEY_IDENTITY = {"random_wrap", "random_unwrap", "random_clone"}

# Primitives through which a layout wanted for a result is wanted for its same-shaped operands
# (backward_hints): element-wise ones.
_ELEMENTWISE = {
    "neg", "exp", "log", "tanh", "logistic", "sqrt", "rsqrt", "abs", "square", "erf", "erfc", "erf_inv",
    "sin", "cos", "log1p", "expm1", "floor", "ceil", "round", "sign", "add", "add_any", "sub", "mul", "div",
    "max", "min", "pow", "integer_pow", "nextafter", "convert_element_type", "bitcast_convert_type",
    "select_n", "clamp", "stop_gradient", "eq", "ne", "lt", "le", "gt", "ge", "reduce_precision",
} | set(_INT_BINARY) | {"not", "clz", "population_count"}

SUPPORTED_RANDOM = {
    "random_seed": "[0, u32(seed)] (CONCATENATE)", "random_wrap": "none (the key's u32 words)",
    "random_unwrap": "none", "random_clone": "none",
    "random_bits": "RANDOM_BITS (32 bits: partitionable or legacy threefry; 8 and 16 bits, bf16's draws: "
                   "partitionable, the 32-bit draw's low bits; each device its block)",
    "random_split": "RANDOM_BITS split", "random_fold_in": "FOLD_IN",
    "threefry2x32": "THREEFRY2X32 (one op per output word)",
    "bitcast_convert_type": "BITCAST_CONVERT (f32, i32, u32); bf16 <-> uint16 through the f32 whose high half it is",
    "shift_left": "BINARY (integers)", "shift_right_logical": "BINARY (integers)",
    "shift_right_arithmetic": "BINARY (integers)", "xor": "ne (bool); BINARY xor (integers)",
    "nextafter": "BINARY nextafter",
    "clz": "integer BINARY ops (a binary search over halves)",
    "population_count": "integer BINARY ops (SWAR bit-field sums)", "erf_inv": "UNARY erf_inv (XLA's polynomial)",
}


def is_key_dtype(dtype):
    try:
        import jax

        return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    except (ImportError, TypeError):  # pragma: no cover
        return False


def aval_of(aval):
    """(shape, numpy dtype) of an abstract value as the cluster holds it: keys as their words."""
    shape = tuple(getattr(aval, "shape", ()))
    dtype = getattr(aval, "dtype", None)
    if dtype is not None and is_key_dtype(dtype):
        return shape + (2,), np.dtype(np.uint32)
    return shape, (np.dtype(dtype) if dtype is not None else None)


def _spec_entries(p, mesh):
    sharding = p.get("sharding") or p.get("dst_sharding")
    try:
        return _sharding.normalize_spec(getattr(sharding, "spec", sharding), mesh)
    except Exception:  # an invalid spec is reported where the constraint is converted
        return None


def backward_hints(jaxpr, out_hints, mesh):
    """{var: spec entries} the layouts wanted for the vars of `jaxpr`, propagated backwards (as
    GSPMD's propagation does) from `out_hints` (one per outvar, or None) and from sharding
    constraints, through element-wise equations to their operands of the result's shape."""
    hints = {}
    for var, h in zip(jaxpr.outvars, out_hints or ()):
        if h is not None and type(var).__name__ != "Literal":
            hints.setdefault(var, h)
    for eqn in reversed(jaxpr.eqns):
        name = eqn.primitive.name
        if name in ("sharding_constraint", "reshard"):
            entries = _spec_entries(eqn.params, mesh)
            if entries is not None and type(eqn.invars[0]).__name__ != "Literal":
                hints.setdefault(eqn.invars[0], entries)
            continue
        if name in _CALLS and any(v in hints for v in eqn.outvars):
            # Through a call (jnp.clip's, jax.random's nested jits) to its operands.
            sub = next((eqn.params[k] for k in ("jaxpr", "call_jaxpr", "fun_jaxpr")
                        if eqn.params.get(k) is not None), None)
            body = getattr(sub, "jaxpr", sub)
            if body is not None and len(body.invars) <= len(eqn.invars):
                inner = backward_hints(body, [hints.get(v) for v in eqn.outvars], mesh)
                for var, inner_var in zip(eqn.invars[len(eqn.invars) - len(body.invars):], body.invars):
                    if type(var).__name__ != "Literal" and inner_var in inner:
                        hints.setdefault(var, inner[inner_var])
            continue
        if name not in _ELEMENTWISE or not eqn.outvars or eqn.outvars[0] not in hints:
            continue
        want, shape = hints[eqn.outvars[0]], tuple(getattr(eqn.outvars[0].aval, "shape", ()))
        for var in eqn.invars:
            if type(var).__name__ != "Literal" and tuple(getattr(var.aval, "shape", ())) == shape:
                hints.setdefault(var, want)
    return hints


def _divides(mesh, entries, shape):
    if len(entries) > len(shape):
        return False
    return all(shape[d] % int(np.prod([mesh.shape[a] for a in e] or [1])) == 0 for d, e in enumerate(entries))


class _Random:
    """Converter's PRNG and integer bit primitives (a mixin: uses emit, upload, _hints)."""

    def int_scalar(self, value, dtype):
        """A replicated 0-d integer constant stored as itself (not as f32), cached."""
        key = (int(value), np.dtype(dtype).str)
        if key not in self._int_scalars:
            v = self.upload(np.asarray(value, dtype=_sharding.carrier_dtype(dtype)))
            self._int_scalars[key] = _V(v.id, (), dtype, v.store)
        return self._int_scalars[key]

    def as_int(self, v, var, dtype):
        """v stored as the integer `dtype` (u32 or i32): a literal as an integer constant, an
        f32-held integer converted."""
        store = _sharding.dtype_to_proto(_sharding.carrier_dtype(dtype))
        if v.store != store and type(var).__name__ == "Literal":
            return self.int_scalar(var.val, dtype)
        return self.integer(v, store, dtype)

    def bitwise_not(self, v):
        """~v for an int32 / uint32 v held as itself: v ^ all-ones. Order-reversing without
        overflow (unlike -v at INT_MIN), so min(x) = ~max(~x)."""
        ones = self.int_scalar(np.iinfo(v.dtype).max if np.dtype(v.dtype).kind == "u" else -1, v.dtype)
        return _V(self.emit(G.BINARY, [v, ones], fn="xor"), v.shape, v.dtype, v.store)

    def wrap(self, v):
        """v (u32-held) reduced modulo 2**bits where its dtype is a narrow unsigned integer
        (_sharding.NARROW_UNSIGNED): what XLA's uint8 / uint16 arithmetic leaves; else v."""
        bits = _sharding.NARROW_UNSIGNED.get(np.dtype(v.dtype))
        if bits is None:
            return v
        mask = self.int_scalar((1 << bits) - 1, np.uint32)
        return _V(self.emit(G.BINARY, [v, mask], fn="and"), v.shape, v.dtype, U32)

    def _bitcast_bf16(self, x, out_dtype):
        """bitcast_convert_type between bf16 and uint16 (held in u32): through the f32 whose high
        half the 16 bits are. bf16 -> f32 is exact, and so is f32 -> bf16 of an f32 whose low half
        is 0 (a NaN's payload aside, which the conversion may make quiet)."""
        sixteen = self.int_scalar(16, np.uint32)
        if _is_bf16(out_dtype):  # uint16 -> bf16
            bits = self.integer(x, U32, x.dtype)
            high = _V(self.emit(G.BINARY, [bits, sixteen], fn="shift_left"), x.shape, np.uint32, U32)
            f = _V(self.emit(G.BITCAST_CONVERT, [high], dtype=F32), x.shape, out_dtype, F32)
            return self.bf16(f)
        f = self.f32(self.bf16(x))  # a bf16 value held as f32: rounded to bf16 first
        bits = _V(self.emit(G.BITCAST_CONVERT, [f], dtype=U32), x.shape, np.uint32, U32)
        return _V(self.emit(G.BINARY, [bits, sixteen], fn="shift_right_logical"), x.shape, out_dtype, U32)

    def key_words(self, name, p, ins, eqn):
        """(params, ins) of a layout primitive over typed keys (a split key unpacked, a key array
        reshaped or broadcast) made to act on the keys' words, whose trailing 2 the key's shape
        lacks: the indices and sizes gain that dim, whole. Other primitives are left as they are
        (element-wise ones and gathers over keys are not supported)."""
        if not any(is_key_dtype(getattr(v.aval, "dtype", None)) for v in list(eqn.invars) + list(eqn.outvars)):
            return p, ins
        if name == "slice":
            strides = p.get("strides")
            p = dict(p, start_indices=tuple(p["start_indices"]) + (0,),
                     limit_indices=tuple(p["limit_indices"]) + (2,),
                     strides=None if strides is None else tuple(strides) + (1,))
        elif name == "broadcast_in_dim":
            dims = tuple(p["broadcast_dimensions"])
            p = dict(p, broadcast_dimensions=dims + (len(p["shape"]),), shape=tuple(p["shape"]) + (2,))
        elif name == "transpose":
            perm = tuple(p["permutation"])
            p = dict(p, permutation=perm + (len(perm),))
        elif name == "dynamic_slice":
            p = dict(p, slice_sizes=tuple(p["slice_sizes"]) + (2,))
            ins = list(ins) + [self.int_scalar(0, np.int32)]
        elif name == "dynamic_update_slice":
            ins = list(ins) + [self.int_scalar(0, np.int32)]
        elif name in ("gather", "scatter-add", "select_n") or name in _ELEMENTWISE:
            self._unsupported(name, eqn, "over typed PRNG keys (pass their jax.random.key_data words)")
        return p, ins

    def _bit_count(self, name, eqn, x, out_dtype):
        """lax.clz (leading zero bits: a binary search over halves, 32 for 0) and
        lax.population_count (set bits: the SWAR sum of bit fields) of an int32 / uint32 (or a
        uint8 / uint16 held in a u32: clz less the carrier's extra high bits), in x's dtype, as
        XLA's."""
        if not _is_int(out_dtype) or out_dtype.itemsize not in (1, 2, 4) or (
                out_dtype.kind == "i" and out_dtype.itemsize != 4):
            self._unsupported(name, eqn, f"a {out_dtype} operand (int32, uint32, uint8 and uint16 are)")
        u = self.as_int(x, eqn.invars[0], out_dtype)
        if u.store != U32:
            u = _V(self.emit(G.BITCAST_CONVERT, [u], dtype=U32), u.shape, np.dtype(np.uint32), U32)

        def op(fn, a, b):
            if not isinstance(b, _V):
                b = self.int_scalar(b, np.uint32)
            return _V(self.emit(G.BINARY, [a, b], fn=fn), u.shape, np.dtype(np.uint32), U32)

        if name == "population_count":
            v = op("sub", u, op("and", op("shift_right_logical", u, 1), 0x55555555))
            v = op("add", op("and", v, 0x33333333), op("and", op("shift_right_logical", v, 2), 0x33333333))
            v = op("and", op("add", v, op("shift_right_logical", v, 4)), 0x0F0F0F0F)
            v = op("shift_right_logical", op("mul", v, 0x01010101), 24)
        else:
            v, rest = None, u
            for width in (16, 8, 4, 2, 1):  # the top `width` bits zero: count them, shift them out
                top_set = op("min", op("shift_right_logical", rest, 32 - width), 1)
                zeros = op("mul", op("sub", self.int_scalar(1, np.uint32), top_set), width)
                v = zeros if v is None else op("add", v, zeros)
                rest = op("shift_left", rest, zeros)
            v = op("add", v, op("sub", self.int_scalar(1, np.uint32), op("min", op("shift_right_logical", rest, 31), 1)))
            if out_dtype.itemsize < 4:
                v = op("sub", v, 32 - 8 * out_dtype.itemsize)
        if out_dtype.kind == "i":
            return _V(self.emit(G.BITCAST_CONVERT, [v], dtype=I32), v.shape, out_dtype, I32)
        return _V(v.id, v.shape, out_dtype, U32)

    def _random_equation(self, name, p, ins, out_dtype, out_shape, eqn):
        """The outputs of a PRNG or integer-bit primitive; None for another primitive."""
        if name in _KEY_IDENTITY:
            return ins
        if name in _INT_BINARY or (name == "not" and _is_int(out_dtype)):
            if not _is_int(out_dtype):
                return None  # bool and/or/not: meshrun._convert's
            a = self.as_int(ins[0], eqn.invars[0], out_dtype)
            if name == "not":  # ~x = x ^ all-ones
                b = self.int_scalar(np.iinfo(out_dtype).max if out_dtype.kind == "u" else -1, out_dtype)
                fn = "xor"
            else:
                b, fn = self.as_int(ins[1], eqn.invars[1], out_dtype), _INT_BINARY[name]
            if a.shape != b.shape and a.shape and b.shape:
                self._unsupported(name, eqn, f"operand shapes {a.shape} and {b.shape}")
            v = _V(self.emit(G.BINARY, [a, b], fn=fn), a.shape or b.shape, out_dtype, a.store)
            return [self.wrap(v) if name == "shift_left" else v]
        if name == "bitcast_convert_type":
            (x,) = ins
            if {str(x.dtype), str(out_dtype)} == {"uint16", "bfloat16"}:
                return [self._bitcast_bf16(x, out_dtype)]
            if out_dtype.itemsize != 4 or x.dtype.itemsize != 4:
                self._unsupported(name, eqn, f"{x.dtype} -> {out_dtype} (only 32-bit f32/i32/u32)")
            store = _sharding.dtype_to_proto(out_dtype)
            if x.store not in (F32, I32, U32):
                x = _V(self.emit(G.CONVERT, [x], dtype=F32), x.shape, np.float32, F32)
            if x.store == F32 and _is_int(x.dtype):  # an integer held as f32: its integer bits
                x = self.as_int(x, eqn.invars[0], x.dtype)
            return [_V(self.emit(G.BITCAST_CONVERT, [x], dtype=store), x.shape, out_dtype, store)]
        if name in ("clz", "population_count"):
            return [self._bit_count(name, eqn, ins[0], out_dtype)]
        if name == "nextafter":
            return [self.binary("nextafter", ins[0], ins[1], out_dtype)]
        if name == "erf_inv":  # in f32; a bf16 result rounded to bf16, as XLA's CPU computes it
            x = ins[0] if ins[0].store == F32 else self.f32(ins[0])
            return [self.rounded(_V(self.emit(G.UNARY, [x], fn="erf_inv"), x.shape, out_dtype, F32))]
        if name == "threefry2x32":
            args = [self.as_int(v, var, np.dtype(np.uint32)) for v, var in zip(ins, eqn.invars)]
            shape = tuple(out_shape)
            if any(a.shape not in ((), shape) for a in args):
                self._unsupported(name, eqn, f"operand shapes {[a.shape for a in args]}")
            return [_V(self.emit(G.THREEFRY2X32, args, index=w), shape, np.uint32, U32) for w in (0, 1)]
        if name == "random_seed":
            return [self._random_seed(ins[0], eqn)]
        if name in ("random_bits", "random_split"):
            return [self._random_bits(name, p, ins[0], eqn)]
        if name == "random_fold_in":
            key, data = ins
            if key.shape != (2,) or data.shape:
                self._unsupported(name, eqn, f"a batch of keys ({key.shape[:-1]})")
            # Exact words: flax folds in 32-bit hashes of names, which f32 would round.
            data = self.as_int(data, eqn.invars[1], np.dtype(np.uint32) if data.dtype.kind != "i" else np.dtype(np.int32))
            return [_V(self.emit(G.FOLD_IN, [key, data]), (2,), np.uint32, U32)]
        return None

    def _random_seed(self, seed, eqn):
        """jax.random.key(seed) for a 32-bit integer seed: [0, seed's bits] (threefry_seed)."""
        if seed.shape or seed.dtype.itemsize > 4:
            self._unsupported("random_seed", eqn, f"a {seed.dtype}{list(seed.shape)} seed")
        word = self.as_int(seed, eqn.invars[0], np.dtype(np.int32) if seed.dtype.kind == "i" else np.dtype(np.uint32))
        if word.store != U32:
            word = _V(self.emit(G.BITCAST_CONVERT, [word], dtype=U32), (), np.uint32, U32)
        word = _V(self.emit(G.RESHAPE, [word], shape=[1]), (1,), np.uint32, U32)
        zero = self.upload(np.zeros(1, np.uint32))
        return _V(self.emit(G.CONCATENATE, [zero, word], index=0), (2,), np.uint32, U32)

    def _random_bits(self, name, p, key, eqn):
        import jax

        if key.shape != (2,):
            return self._batched_random_bits(name, p, key, eqn)
        partitionable = bool(jax.config.jax_threefry_partitionable)
        if name == "random_split":
            shape = tuple(p["shape"]) + (2,)
            fn = "split" if partitionable else "legacy"
        else:
            self._check_bit_width(p, partitionable, eqn)
            shape = tuple(p["shape"])
            fn = "partitionable" if partitionable else "legacy"
        entries = self._hints[-1].get(eqn.outvars[0]) if self._hints else None
        if entries is None or not _divides(self.mesh, entries, shape):
            entries = ()
        vid = self.emit(G.RANDOM_BITS, [key], fn=fn, shape=list(shape), spec=_sharding.spec_to_proto(entries))
        bits = _V(vid, shape, np.uint32, U32)
        return bits if name == "random_split" else self._narrowed(bits, p)

    def _check_bit_width(self, p, partitionable, eqn):
        """random_bits' widths: 32 bits (f32 draws), and 8 or 16 (bf16 draws) with partitionable
        threefry, which takes them from the 32-bit draw; legacy threefry packs them 4 or 2 to a
        word, which is not supported."""
        width = int(p["bit_width"])
        if width == 32 or (width in (8, 16) and partitionable):
            return
        why = ("with legacy threefry (jax_threefry_partitionable=False; partitionable, JAX's default, "
               "is supported)" if width in (8, 16) else "(8, 16 or 32 bits: f32 and bf16 draws)")
        self._unsupported("random_bits", eqn, f"bit_width {width} {why}")

    def _narrowed(self, bits, p):
        """Partitionable threefry's `bit_width`-bit draw from its 32 bits (bits1 ^ bits2): their
        low bits, as lax.convert_element_type to uint8 / uint16 keeps them."""
        width = int(p["bit_width"])
        if width == 32:
            return bits
        return self.wrap(_V(bits.id, bits.shape, np.dtype(f"uint{width}"), U32))

    def _batched_random_bits(self, name, p, key, eqn):
        """random_bits / random_split of a batch of keys [K..., 2] (jax.vmap over keys). With
        partitionable threefry (JAX's default), as JAX computes it: THREEFRY2X32 of each key's
        words against the draw's row-major counters, all keys at once. Legacy threefry: each key
        draws its own block as a single key does, stacked to [K..., shape...] (at most
        _MAX_KEY_BATCH keys: each is an op)."""
        import jax

        if bool(jax.config.jax_threefry_partitionable):
            return self._threefry_keys(name, p, key, eqn)
        batch = tuple(key.shape[:-1])
        count = int(np.prod(batch))
        if count > _MAX_KEY_BATCH:
            self._unsupported(name, eqn, f"a batch of {count} keys {batch} (vmap over keys; at most {_MAX_KEY_BATCH})")
        flat = self._reshape(key, (count, 2))
        draws = []
        for i in range(count):
            one = _V(self.emit(G.INDEX, [flat], index=i), (2,), key.dtype, key.store)
            d = self._random_bits(name, p, one, eqn)
            draws.append(self._reshape(d, (1,) + tuple(d.shape)))
        out = draws[0] if count == 1 else self._joined(draws, 0)
        return self._reshape(out, batch + tuple(out.shape[1:]))


    def _threefry_keys(self, name, p, key, eqn):
        """jax._src.random.threefry2x32's partitionable random_bits (32 bits: the two words
        xor-ed) and split (the two words stacked), for a batch of keys [K..., 2] at once."""
        if name != "random_split":
            self._check_bit_width(p, True, eqn)
        batch, shape = tuple(key.shape[:-1]), tuple(p["shape"])
        full, size = batch + shape, int(np.prod(shape))
        if size >= 2**32:
            self._unsupported(name, eqn, f"a draw of {size} values per key (below 2**32)")

        words = []
        for w in (0, 1):
            starts, limits = [0] * len(key.shape), list(key.shape)
            starts[-1], limits[-1] = w, w + 1
            word = _V(self.emit(G.SLICE, [key], dims=starts, shape=limits), tuple(limits), np.uint32, U32)
            words.append(self.broadcast(self._reshape(word, batch), full, range(len(batch))))
        if shape not in self._counts:  # iota_2x32_shape's low words (its high ones are 0)
            self._counts[shape] = self.upload(np.arange(size, dtype=np.uint32).reshape(shape))
        counts = self._counts[shape]
        args = words + [self.int_scalar(0, np.uint32), self.broadcast(counts, full, range(len(batch), len(full)))]
        bits = [_V(self.emit(G.THREEFRY2X32, args, index=w), full, np.uint32, U32) for w in (0, 1)]
        if name != "random_split":
            return self._narrowed(_V(self.emit(G.BINARY, bits, fn="xor"), full, np.uint32, U32), p)
        return self._joined([self._reshape(b, full + (1,)) for b in bits], len(full))


# The most keys a batched draw (vmap over keys) unrolls into single draws.
_MAX_KEY_BATCH = 256
