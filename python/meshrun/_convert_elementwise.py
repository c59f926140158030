"""Element-wise primitives in meshrun._convert: arithmetic (in an int32 / uint32 result's own
integers where lax computes in them), comparisons (lax's total order included), selects,
integer powers, cbrt, dot_general and dtype conversions, and the tables that map lax's
element-wise primitives to meshrun's UNARY / BINARY fns."""
import jax.numpy as jnp
import numpy as np

from meshrun import _sharding
from meshrun._ir import BF16, F32, G, I32, U32, _V, _is_bf16, _is_bool, _is_int


_UNARY = {"neg": "neg", "exp": "exp", "log": "log", "tanh": "tanh", "logistic": "logistic",
          "sqrt": "sqrt", "rsqrt": "rsqrt", "abs": "abs", "square": "square", "erf": "erf", "erfc": "erfc",
          "sin": "sin", "cos": "cos", "tan": "tan", "atan": "atan", "asin": "asin", "acos": "acos",
          "sinh": "sinh", "cosh": "cosh", "atanh": "atanh", "asinh": "asinh", "acosh": "acosh",
          "lgamma": "lgamma", "digamma": "digamma", "log1p": "log1p", "expm1": "expm1",
          "exp2": "exp2", "floor": "floor", "ceil": "ceil"}
_BINARY = {"add": "add", "add_any": "add", "sub": "sub", "mul": "mul", "div": "div", "max": "max",
           "min": "min", "pow": "pow", "rem": "rem", "atan2": "atan2"}
# Arithmetic that an int32 / uint32 result computes in its own integers (lax's wrapping, truncated
# div and rem), never through f32, which is exact only below 2**24 and does not truncate.
_INTEGER_ARITHMETIC = {"add", "sub", "mul", "div", "rem", "max", "min"}


def _integer_store(dtype):
    """I32 / U32 for an int32 / uint32 dtype, whose arithmetic and selects run in its integers,
    and U32 for uint8 / uint16 (their carrier, _sharding.carrier_dtype); None for any other dtype
    (computed in f32 or bf16)."""
    if dtype is None:
        return None
    dt = _sharding.carrier_dtype(dtype)
    if dt not in (np.dtype(np.int32), np.dtype(np.uint32)):
        return None
    return _sharding.dtype_to_proto(dt)


# Unary primitives that JAX lowers as a chain of ops, each of which XLA rounds to bf16 for a bf16
# operand (_Elementwise._bf16_steps).
_BF16_STEPS = {"logistic", "exp2"}
_COMPARE = {"eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge"}
_IDENTITY = {"stop_gradient", "copy", "copy_p", "optimization_barrier", "pvary"}


class _Elementwise:
    """Converter's element-wise primitives (a mixin: uses its emit, f32, unary, binary, integer,
    int_scalar, scalar and _unsupported)."""

    def _elementwise_equation(self, name, p, ins, out_dtype, out_shape, eqn):
        """Arithmetic, comparisons, selects, dots and converts; None for another primitive."""
        if name in _IDENTITY:
            return ins
        if name in ("neg", "abs") and _integer_store(out_dtype) is not None:  # wrapping, as XLA's
            (x,) = ins
            neg = self.binary("sub", self.int_scalar(0, out_dtype), x, out_dtype)
            return [neg if name == "neg" else self.binary("max", x, neg, out_dtype)]
        if name in _BF16_STEPS and _is_bf16(out_dtype):
            return [self._bf16_steps(name, ins[0])]
        if name in _UNARY:
            (x,) = ins
            if x.store not in (F32, BF16):
                x = self.f32(x)
            return [self.rounded(_V(self.unary(_UNARY[name], x).id, x.shape, out_dtype, x.store))]
        if name in _BINARY:
            return [self.binary(_BINARY[name], ins[0], ins[1], out_dtype)]
        if name in _COMPARE:
            v = self.binary(_COMPARE[name], ins[0], ins[1])
            return [_V(v.id, v.shape, np.bool_, F32)]
        if name in ("lt_to", "le_to", "eq_to"):  # lax's total order: -NaN < -inf < -0 < +0 < inf < NaN
            a, b = ins
            if not (_is_int(a.dtype) or _is_bool(a.dtype)):
                a, b = self._total_order_key(a), self._total_order_key(b)
            v = self.binary(name[:2], a, b)
            return [_V(v.id, v.shape, np.bool_, F32)]
        if name == "cbrt":
            return [_V(self._cbrt(name, eqn, ins[0]).id, ins[0].shape, out_dtype, F32)]
        if name == "integer_pow":
            return [self._integer_pow(ins[0], int(p["y"]), eqn)]
        if name == "round":  # lax.RoundingMethod: 0 away from zero, 1 to nearest even
            method = int(p.get("rounding_method", 0))
            return [self.unary("round_even" if method == 1 else "round_away", self.f32(ins[0]))]
        if name == "sign":  # (x > 0) - (x < 0); a float +-0 or NaN itself, as lax.sign (XLA's)
            x = self.f32(ins[0])
            zero = self.scalar(0.0)
            s = self.binary("sub", self.binary("gt", x, zero), self.binary("lt", x, zero), out_dtype)
            if _integer_store(out_dtype) is not None:
                return [s]
            neither = self.binary("eq", s, zero)  # +-0 or NaN
            return [self._select(name, eqn, [_V(neither.id, neither.shape, np.bool_, F32), s, x], out_dtype)]
        if name == "is_finite":  # x - x is 0 for a finite x, NaN for an infinite or NaN one
            x = self.f32(ins[0])
            v = self.binary("eq", self.binary("sub", x, x), self.scalar(0.0))
            return [_V(v.id, v.shape, np.bool_, F32)]
        if name == "clamp":  # lax.clamp(lo, x, hi)
            lo, x, hi = ins
            return [self.binary("min", self.binary("max", x, lo), hi, out_dtype)]
        if name == "select_n":
            return [self._select(name, eqn, ins, out_dtype)]
        if name in ("and", "or", "xor", "not"):  # bools held as f32 1 / 0
            if not all(_is_bool(v.dtype) for v in ins):
                self._unsupported(name, eqn, "bitwise integer ops")
            if name == "not":
                v = self.binary("sub", self.scalar(1.0), ins[0])
            else:
                v = self.binary({"and": "mul", "or": "max", "xor": "ne"}[name], ins[0], ins[1])
            return [_V(v.id, v.shape, np.bool_, F32)]
        if name == "dot_general":
            return [self._dot(p, ins, out_dtype, out_shape, eqn)]
        if name == "convert_element_type":
            return [self._convert(name, eqn, ins[0], np.dtype(p["new_dtype"]))]
        if name == "reduce_precision":
            return [self._reduce_precision(name, eqn, ins[0], int(p["exponent_bits"]), int(p["mantissa_bits"]))]
        return None

    def _bf16_steps(self, name, x):
        """A bf16 logistic or exp2 as JAX lowers it, each op rounded to bf16 as XLA's: the sigmoid
        is 1 / (1 + exp(-x)), exp2 is exp(x * log 2) with log 2 in bf16."""
        x, one = self.bf16(x), self.scalar(1.0)
        if name == "logistic":
            denominator = self.binary("add", self.unary("exp", self.unary("neg", x)), one, x.dtype)
            return self.binary("div", one, denominator, x.dtype)
        return self.unary("exp", self.binary("mul", x, self.scalar(float(np.log(2.0))), x.dtype))

    def _reduce_precision(self, name, eqn, x, exponent_bits, mantissa_bits):
        """lax.reduce_precision: to bf16's 8 exponent and 7 mantissa bits by a round trip through
        bf16 (round to nearest even, as XLA's); as many bits as x's type holds or more: x itself."""
        have = (8, 7) if str(x.dtype) == "bfloat16" else (8, 23)
        if exponent_bits >= have[0] and mantissa_bits >= have[1]:
            return x
        if (exponent_bits, mantissa_bits) != (8, 7):
            self._unsupported(name, eqn, f"exponent_bits={exponent_bits}, mantissa_bits={mantissa_bits} "
                              "(only bf16's 8 and 7, or at least the operand's own)")
        return self._convert(name, eqn, self._convert(name, eqn, x, np.dtype(jnp.bfloat16)), x.dtype)

    def _cbrt(self, name, eqn, x):
        """lax.cbrt within an ulp: |x| ** (1/3), refined by one Newton step y - (y^3 - |x|) / 3y^2,
        given x's sign; 0, inf and NaN as themselves."""
        x = self.f32(x)
        ax = self.unary("abs", x)
        y = self.binary("pow", ax, self.scalar(1.0 / 3.0))
        yy = self.binary("mul", y, y)
        step = self.binary("div", self.binary("sub", self.binary("mul", yy, y), ax), self.binary("mul", self.scalar(3.0), yy))
        refined = self.binary("sub", y, step)
        finite = self.binary("eq", self.binary("sub", refined, refined), self.scalar(0.0))  # not inf / NaN
        y = self._select(name, eqn, [_V(finite.id, finite.shape, np.bool_, F32), y, refined], np.float32)
        y = self._select(name, eqn, [self._bool(self.binary("lt", x, self.scalar(0.0))), y, self.unary("neg", y)],
                         np.float32)
        keep = self.binary("max", self.binary("eq", x, self.scalar(0.0)), self.binary("ne", x, x))  # 0, -0, NaN
        keep = self.binary("max", keep, self.binary("eq", ax, self.scalar(float("inf"))))
        return self._select(name, eqn, [self._bool(keep), y, x], np.float32)

    def _bool(self, v):
        return _V(v.id, v.shape, np.bool_, F32)

    def _total_order_key(self, x):
        """An int32 that orders as x (f32) does in lax's total order: x's bits, with the 31 low
        ones flipped where the sign is set (a more negative float has larger magnitude bits)."""
        x = self.f32(x)
        k = _V(self.emit(G.BITCAST_CONVERT, [x], dtype=I32), x.shape, np.dtype(np.int32), I32)

        def op(fn, a, b):
            return _V(self.emit(G.BINARY, [a, b], fn=fn), a.shape, a.dtype, I32)

        sign = op("shift_right_arithmetic", k, self.int_scalar(31, np.int32))
        return op("xor", k, op("and", sign, self.int_scalar(0x7FFFFFFF, np.int32)))

    def _integer_pow(self, x, y, eqn):
        """x ** y by square-and-multiply; an int32 / uint32 x in its own wrapping integers."""
        integral = _integer_store(x.dtype) is not None
        if integral and y < 0:
            self._unsupported("integer_pow", eqn, f"an integer raised to the negative power {y}")
        if not integral and x.store not in (F32, BF16):
            x = self.f32(x)
        if y == 0:
            zero, one = ((self.int_scalar(0, x.dtype), self.int_scalar(1, x.dtype)) if integral
                         else (self.scalar(0.0), self.scalar(1.0)))
            return self.binary("add", self.binary("mul", x, zero), one)
        n = abs(y)
        if n == 2 and not integral:
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
        if len(cases) > 2:
            return self._select_tree(name, eqn, pred, list(cases), 0, out_dtype)
        if len(cases) != 2:
            self._unsupported(name, eqn, f"{len(cases)} case (2 or more supported)")
        a, b = cases
        store = _integer_store(out_dtype)
        if store is not None:
            # In the cases' integers, bit for bit (f32 would round above 2**24): with the mask m
            # all ones where pred holds, a ^ ((a ^ b) & m).
            def op(fn, x, y):
                return _V(self.emit(G.BINARY, [x, y], fn=fn), x.shape or y.shape, out_dtype, store)

            a, b = self.integer(a, store, out_dtype), self.integer(b, store, out_dtype)
            mask = op("sub", self.int_scalar(0, out_dtype), self.integer(pred, store, out_dtype))
            return op("xor", a, op("and", op("xor", a, b), mask))
        if a.store != b.store or a.store not in (F32, BF16):
            a, b = self.f32(a), self.f32(b)
        p = self.f32(pred)  # a bool (f32 1 / 0) or an int32 case index 0 / 1
        shape = a.shape or b.shape or pred.shape
        vid = self.emit(G.SELECT, [p, a, b])
        return _V(vid, shape, out_dtype, a.store)

    def _select_tree(self, name, eqn, which, cases, offset, out_dtype):
        """lax.select_n over more than two cases (jnp.select, jnp.piecewise, a vmapped switch), as
        JAX lowers it: halves picked by which >= offset + mid, so an index past the last case
        takes the last and one below 0 the first."""
        if len(cases) == 1:
            return cases[0]
        mid = len(cases) // 2
        low = self._select_tree(name, eqn, which, cases[:mid], offset, out_dtype)
        high = self._select_tree(name, eqn, which, cases[mid:], offset + mid, out_dtype)
        upper = self.binary("ge", which, self.int_scalar(offset + mid, which.dtype))  # a bool
        return self._select(name, eqn, [upper, low, high], out_dtype)

    def _dot(self, p, ins, out_dtype, out_shape, eqn):
        lhs, rhs = ins
        if _integer_store(out_dtype) is not None:  # f32 GEMMs would round sums above 2**24
            self._unsupported("dot_general", eqn, f"an integer ({np.dtype(out_dtype)}) product; meshrun's "
                              "matmuls are f32 / bf16 (oneDNN): convert the operands to float32 first")
        (lc, rc), (lb, rb) = p["dimension_numbers"]
        if _is_bf16(lhs.dtype) and _is_bf16(rhs.dtype) and lhs.store != rhs.store:
            # A bf16 operand held as f32 (a select's result, a literal) is bf16 to XLA: the GEMM
            # stays bf16 (AMX / AVX512-BF16) rather than widening the other, a weight, every step.
            lhs, rhs = self.bf16(lhs), self.bf16(rhs)
        if lhs.store not in (F32, BF16) or rhs.store not in (F32, BF16) or lhs.store != rhs.store:
            lhs, rhs = self.f32(lhs), self.f32(rhs)
        vid = self.emit(G.DOT_GENERAL, [lhs, rhs], lhs_contracting=list(lc), rhs_contracting=list(rc),
                        lhs_batch=list(lb), rhs_batch=list(rb))
        v = _V(vid, out_shape, lhs.dtype, lhs.store)
        if not lb and len(lhs.shape) == 2 and len(rhs.shape) == 2:
            self._dots[vid] = (lhs, rhs, list(lc), list(rc))
        return self._gemm_result(v, out_dtype, out_shape)

    def _gemm_result(self, v, out_dtype, out_shape):
        """A GEMM's result v (dot_general's, a convolution's) as out_dtype: CONVERTed when out_dtype
        is f32 or bf16 and v is stored as the other (preferred_element_type); any other dtype keeps
        v's store."""
        want = F32 if np.dtype(out_dtype) == np.float32 else (BF16 if str(out_dtype) == "bfloat16" else v.store)
        if want != v.store:
            v = _V(self.emit(G.CONVERT, [v], dtype=want), tuple(out_shape), out_dtype, want)
        return _V(v.id, tuple(out_shape), out_dtype, v.store)

    def _convert(self, name, eqn, x, to):
        if to == x.dtype:
            return x
        if _is_bool(to):
            v = self.binary("ne", x, self.scalar(0.0))
            return _V(v.id, v.shape, np.bool_, F32)
        if _is_int(to):
            narrow = _sharding.NARROW_UNSIGNED.get(np.dtype(to))
            if to not in (np.int32, np.uint32) and narrow is None:
                self._unsupported(name, eqn, f"conversion to {to}")
            if narrow is not None and not _is_bool(x.dtype):
                if not _is_int(x.dtype):
                    self._unsupported(name, eqn, f"conversion from {x.dtype} to {to} (from integers only)")
                if _sharding.NARROW_UNSIGNED.get(np.dtype(x.dtype), 32) > narrow:  # the low bits, as XLA's
                    bits = self.integer(self.integer(x, _integer_store(x.dtype), x.dtype), U32, np.uint32)
                    return self.wrap(_V(bits.id, x.shape, to, U32))
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
