"""Layout primitives in meshrun._convert: broadcasts, reshapes, slices, pads, tiles, reversals,
concatenations, transposes, reductions, iota, sharding constraints and argmax (gathers and
scatters: meshrun._convert_indexing)."""
import numpy as np

from meshrun import _sharding
from meshrun._ir import BF16, EMPTY, F32, G, I32, U32, _V, _is_int
from meshrun.v1 import common_pb2


class _Layout:
    """Converter's layout primitives (a mixin: uses its emit, f32, unary, binary, _convert)."""

    def _layout_equation(self, name, p, ins, out_dtype, out_shape, eqn):
        """The outputs of a layout or indexing primitive; None for another primitive."""
        if name in ("argmax", "argmin"):
            return [self._arg_extreme(name, p, ins[0], out_dtype, out_shape)]
        if name == "broadcast_in_dim":
            (x,) = ins
            dims = list(p["broadcast_dimensions"])
            if tuple(out_shape) == x.shape:
                return [x]
            vid = self.emit(G.BROADCAST_IN_DIM, [x], shape=list(out_shape), dims=dims)
            return [_V(vid, out_shape, x.dtype, x.store)]
        if name in ("reshape", "squeeze", "expand_dims"):
            (x,) = ins[:1]
            if name == "reshape" and p.get("dimensions") not in (None, ()):  # lax.reshape(x, s, perm)
                perm = [int(d) for d in p["dimensions"]]
                if perm != list(range(len(perm))):
                    shape = tuple(x.shape[d] for d in perm)
                    x = _V(self.emit(G.TRANSPOSE, [x], dims=perm), shape, x.dtype, x.store)
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
        if name == "stack":  # jnp.stack: each operand with a unit dim at `axis`, concatenated
            axis = int(p["axis"])
            parts = [self._reshape(v, v.shape[:axis] + (1,) + v.shape[axis:]) for v in ins]
            v = parts[0] if len(parts) == 1 else self._joined(parts, axis)
            return [_V(v.id, out_shape, out_dtype, v.store)]
        if name == "unstack":  # jnp.unstack (and the transpose of stack): unit parts, RESHAPEd
            (x,) = ins
            axis = int(p["axis"])
            shape = x.shape[:axis] + x.shape[axis + 1:]
            return [self._reshape(v, shape) for v in self._split(x, axis, [1] * x.shape[axis])]
        if name == "tile":  # [n0, n1] broadcast to [r0, n0, r1, n1], then merged to [r0 n0, r1 n1]
            (x,) = ins
            reps = tuple(int(r) for r in p["reps"])
            if len(reps) != len(x.shape):
                self._unsupported(name, eqn, f"reps {reps} for a rank-{len(x.shape)} operand")
            big = [v for pair in zip(reps, x.shape) for v in pair]
            vid = self.emit(G.BROADCAST_IN_DIM, [x], shape=big, dims=[2 * i + 1 for i in range(len(reps))])
            return [self._reshape(_V(vid, tuple(big), x.dtype, x.store), out_shape)]
        if name == "split":
            return self._split(ins[0], int(p["axis"]), p["sizes"])
        if name == "pad":
            return [self._pad(name, eqn, ins[0], ins[1], p["padding_config"], out_dtype)]
        if name == "slice":
            (x,) = ins
            if tuple(out_shape) == x.shape:
                return [x]
            strides = list(p.get("strides") or [1] * len(x.shape))
            v = self._slice_strided(x, p["start_indices"], p["limit_indices"], strides)
            return [_V(v.id, tuple(out_shape), out_dtype, v.store)]
        if name == "sort":
            keys = int(p["num_keys"])
            if any(v.store not in (F32, I32, U32) for v in ins):
                self._unsupported(name, eqn, "operands other than f32, i32, u32")
            return [_V(self.emit(G.SORT, ins, index=int(p["dimension"]), dims=[keys, k]), v.shape, v.dtype, v.store)
                    for k, v in enumerate(ins)]
        if name == "top_k":
            # XLA's top_k ranks by its total order (-NaN < -inf < -0 < +0 < inf < NaN), ties by
            # index: a stable ascending sort by the complement of that order's int32 key (of an
            # integer, of itself), which SORT compares as plain integers (its float keys equate -0
            # with +0, as lax.sort does).
            (x,) = ins
            k = int(p["k"])
            dim = int(p.get("axis", -1)) % max(len(x.shape), 1)  # (lax.top_k's axis; the last by default)
            if _is_int(x.dtype):  # as itself (through f32, an int past 2**24 would round)
                xf = self.as_int(x, eqn.invars[0], x.dtype)
                descending = self.bitwise_not(xf)
            else:
                xf = self.f32(x)
                descending = self.bitwise_not(self._total_order_key(xf))
            iota = _V(self.emit(G.IOTA, dtype=I32, shape=list(x.shape), index=dim), x.shape, np.int32, I32)
            starts, limits = [0] * len(x.shape), list(x.shape)
            limits[dim] = k
            outs = []
            for r, (v, dtype) in ((1, (xf, out_dtype)), (2, (iota, np.dtype(np.int32)))):
                sorted_ = _V(self.emit(G.SORT, [descending, xf, iota], index=dim, dims=[1, r]), x.shape, v.dtype,
                             v.store)
                outs.append(_V(self.emit(G.SLICE, [sorted_], dims=starts, shape=limits), tuple(limits), dtype,
                               v.store))
            return outs
        if name == "rev":
            (x,) = ins
            if not p["dimensions"]:
                return [x]
            vid = self.emit(G.REVERSE, [x], dims=[int(d) for d in p["dimensions"]])
            return [_V(vid, x.shape, x.dtype, x.store)]
        if name in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"):
            (x,) = ins
            if x.store not in (F32, BF16) and not (x.store in (I32, U32) and x.dtype in (np.int32, np.uint32)):
                x = self.f32(x)  # (int32 / uint32 scan in their integers)
            vid = self.emit(G.CUMULATIVE, [x], fn=name[3:], index=int(p["axis"]), value=1.0 if p.get("reverse") else 0.0)
            return [_V(vid, x.shape, out_dtype, x.store)]
        if name == "dynamic_slice":
            x, starts = ins[0], ins[1:]
            if tuple(out_shape) == x.shape:
                return [x]
            vid = self.emit(G.DYNAMIC_SLICE, [x] + list(starts), shape=list(p["slice_sizes"]))
            return [_V(vid, out_shape, x.dtype, x.store)]
        if name == "dynamic_update_slice":
            x, update, starts = ins[0], ins[1], ins[2:]
            if update.store != x.store:
                update = _V(self.emit(G.CONVERT, [update], dtype=x.store), update.shape, x.dtype, x.store)
            vid = self.emit(G.DYNAMIC_UPDATE_SLICE, [x, update] + list(starts))
            return [_V(vid, x.shape, x.dtype, x.store)]
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
        if name in ("reduce_and", "reduce_or"):  # jnp.all / jnp.any over bools held as f32 1 / 0
            name = "reduce_min" if name == "reduce_and" else "reduce_max"
        if name in ("reduce_sum", "reduce_max", "reduce_min"):
            x = ins[0]
            axes = list(p["axes"])
            if not axes:
                return [x]
            if x.store in (I32, U32) and x.dtype in (np.int32, np.uint32):
                # In the integers (a sum wraps; f32 would round above 2**24); min(x) = ~max(~x).
                def flip(v):
                    return self.bitwise_not(v) if name == "reduce_min" else v

                vid = self.emit(G.REDUCE, [flip(x)], fn="sum" if name == "reduce_sum" else "max", dims=axes)
                return [flip(_V(vid, out_shape, x.dtype, x.store))]
            if x.store not in (F32, BF16):
                x = self.f32(x)
            if name == "reduce_min":
                x = self.unary("neg", x)
            vid = self.emit(G.REDUCE, [x], fn="sum" if name == "reduce_sum" else "max", dims=axes)
            v = _V(vid, out_shape, out_dtype, x.store)
            return [self.unary("neg", v) if name == "reduce_min" else v]
        if name == "reduce_prod":
            return [self._reduce_prod(ins[0], [int(a) for a in p["axes"]], out_dtype, out_shape)]
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
            self._layouts[vid] = entries
            return [_V(vid, x.shape, x.dtype, x.store)]
        return None

    def _reduce_prod(self, x, axes, out_dtype, out_shape):
        """jnp.prod: per axis, a pairwise tree of element-wise products of the halves (an odd
        element carried to the next level), as JAX's own differentiable product tree; int32 /
        uint32 multiply in their own wrapping integers."""
        integral = x.store in (I32, U32) and x.dtype in (np.int32, np.uint32)
        if not integral and x.store not in (F32, BF16):
            x = self.f32(x)
        for a in axes:
            while x.shape[a] > 1:
                shape, ones = tuple(x.shape), [1] * len(x.shape)
                n, h = shape[a], shape[a] // 2
                starts = [0] * len(shape)
                lo = self._slice_strided(x, starts, shape[:a] + (h,) + shape[a + 1:], ones)
                starts[a] = h
                hi = self._slice_strided(x, starts, shape[:a] + (2 * h,) + shape[a + 1:], ones)
                v = self.binary("mul", lo, hi, x.dtype)
                if n % 2:
                    starts[a] = n - 1
                    v = self._joined([v, self._slice_strided(x, starts, shape, ones)], a)
                x = v
        return _V(self._reshape(x, out_shape).id, tuple(out_shape), out_dtype, x.store)

    def _arg_extreme(self, name, p, x, out_dtype, out_shape):
        """argmax / argmin along one axis: the least index holding the extreme, as lax's
        (indices exact below 2**24): min over the axis of where(x == extreme, iota, size). A NaN
        is the extreme, as in lax (the max is NaN exactly where the slice holds one). int32 /
        uint32 compare in their integers (argmin as argmax of ~x), exact at any magnitude."""
        (axis,) = p["axes"]
        if x.store in (I32, U32) and x.dtype in (np.int32, np.uint32):
            if name == "argmin":
                x = self.bitwise_not(x)
        else:
            x = self.f32(x)
            if name == "argmin":
                x = self.unary("neg", x)
        kept = [d for d in range(len(x.shape)) if d != axis]
        m = _V(self.emit(G.REDUCE, [x], fn="max", dims=[axis]), out_shape, x.dtype, x.store)
        mb = _V(self.emit(G.BROADCAST_IN_DIM, [m], shape=list(x.shape), dims=kept), x.shape, x.dtype, x.store)
        hit = self.binary("eq", x, mb)
        if x.store == F32:  # a NaN is the extreme
            hit = self.binary("add", hit, self.binary("ne", x, x))
        iota = _V(self.emit(G.IOTA, dtype=F32, shape=list(x.shape), index=axis, spec=common_pb2.PartitionSpec()),
                  x.shape, np.float32, F32)
        size = self.scalar(float(x.shape[axis]))
        # where(hit, iota, size) = size + hit * (iota - size): exact for these integers
        cand = self.binary("add", self.binary("mul", hit, self.binary("sub", iota, size)), size)
        neg = self.unary("neg", cand)
        best = _V(self.emit(G.REDUCE, [neg], fn="max", dims=[axis]), out_shape, np.float32, F32)
        v = self.unary("neg", best)
        return _V(v.id, out_shape, out_dtype, F32)

    def _split(self, x, axis, sizes):
        """lax.split: consecutive SLICEs of `sizes` along `axis`."""
        outs, start = [], 0
        for size in sizes:
            starts = [0] * len(x.shape)
            limits = list(x.shape)
            starts[axis], limits[axis] = start, start + size
            shape = tuple(limits[d] - starts[d] for d in range(len(limits)))
            if shape == x.shape:
                outs.append(x)
            elif size == 0:  # (a zero-size part: no op, meshrun._convert's empty value)
                outs.append(_V(EMPTY, shape, x.dtype, x.store))
            else:
                outs.append(_V(self.emit(G.SLICE, [x], dims=starts, shape=limits), shape, x.dtype, x.store))
            start += size
        return outs

    def _reshape(self, x, shape):
        shape = tuple(shape)
        if x.shape == shape:
            return x
        return _V(self.emit(G.RESHAPE, [x], shape=list(shape)), shape, x.dtype, x.store)

    def _transposed(self, x, perm):
        perm = [int(d) for d in perm]
        if perm == list(range(len(perm))):
            return x
        shape = tuple(x.shape[d] for d in perm)
        return _V(self.emit(G.TRANSPOSE, [x], dims=perm), shape, x.dtype, x.store)

    def _reshaped(self, x, shape):
        return _V(self.emit(G.RESHAPE, [x], shape=list(shape)), tuple(shape), x.dtype, x.store)

    def _joined(self, parts, d):
        """CONCATENATE along d (in f32 where the parts' stores differ)."""
        if any(q.store != parts[0].store for q in parts):
            parts = [self.f32(q) for q in parts]
        shape = list(parts[0].shape)
        shape[d] = sum(q.shape[d] for q in parts)
        return _V(self.emit(G.CONCATENATE, parts, index=d), shape, parts[0].dtype, parts[0].store)

    def _filled(self, value, like, shape):
        """A block of `shape` filled with the scalar `value`, for `like`'s dim."""
        fill = self.f32(value) if like.store == F32 else value
        return _V(self.emit(G.BROADCAST_IN_DIM, [fill], shape=list(shape), dims=[]), tuple(shape), like.dtype,
                  fill.store)

    def _slice_strided(self, x, starts, limits, strides):
        """x[starts:limits:strides] (lax.slice): one SLICE of the unit-stride box, then each
        strided dim's every stride-th element."""
        starts, limits, strides = [int(s) for s in starts], [int(s) for s in limits], [int(s) for s in strides]
        box_lo = [0 if st != 1 else lo for lo, st in zip(starts, strides)]
        box_hi = [x.shape[d] if st != 1 else hi for d, (hi, st) in enumerate(zip(limits, strides))]
        if box_lo != [0] * len(box_lo) or box_hi != list(x.shape):
            shape = tuple(hi - lo for lo, hi in zip(box_lo, box_hi))
            x = _V(self.emit(G.SLICE, [x], dims=box_lo, shape=box_hi), shape, x.dtype, x.store)
        for d, st in enumerate(strides):
            if st != 1:
                x = self._strided(x, d, starts[d], limits[d], st)
        return x

    def _strided(self, x, d, start, limit, stride):
        """x[start:limit:stride] along d: the range padded to a multiple of the stride, viewed as
        [m, stride] (RESHAPE) and its first column kept."""
        m = max(0, -(-(limit - start) // stride))
        end = min(start + stride * m, x.shape[d])
        starts, limits = [0] * len(x.shape), list(x.shape)
        starts[d], limits[d] = start, end
        shape = list(x.shape)
        shape[d] = end - start
        x = _V(self.emit(G.SLICE, [x], dims=starts, shape=limits), tuple(shape), x.dtype, x.store)
        if shape[d] < stride * m:
            tail = list(shape)
            tail[d] = stride * m - shape[d]
            x = self._joined([x, self._filled(self.scalar(0.0), x, tail)], d)
        s = list(x.shape)
        x = self._reshaped(x, s[:d] + [m, stride] + s[d + 1:])
        first = s[:d] + [m, 1] + s[d + 1:]
        x = _V(self.emit(G.SLICE, [x], dims=[0] * len(first), shape=first), tuple(first), x.dtype, x.store)
        return self._reshaped(x, s[:d] + [m] + s[d + 1:])

    def _interleaved(self, x, value, d, interior):
        """x with `interior` copies of value between its elements along d (lax.pad's interior):
        [n, 1] next to [n, interior] of the value, viewed as [n * (1 + interior)] and cut."""
        s, n = list(x.shape), x.shape[d]
        if n == 0:
            return x
        unit = self._reshaped(x, s[:d + 1] + [1] + s[d + 1:])
        x = self._joined([unit, self._filled(value, x, s[:d + 1] + [interior] + s[d + 1:])], d + 1)
        x = self._reshaped(x, s[:d] + [n * (1 + interior)] + s[d + 1:])
        limits = list(x.shape)
        limits[d] = n + (n - 1) * interior
        return _V(self.emit(G.SLICE, [x], dims=[0] * len(s), shape=limits), tuple(limits), x.dtype, x.store)

    def _pad(self, name, eqn, x, value, config, out_dtype):
        """lax.pad: per dim, the interior padding interleaved, then a slice for negative edges and a
        concatenation with blocks of the padding value for positive ones."""
        if value.shape:
            self._unsupported(name, eqn, "a padding value that is not a scalar")
        for d, (_, _, interior) in enumerate(config):
            if interior:
                x = self._interleaved(x, value, d, int(interior))
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
                    parts.append(self._filled(value, x, shape))
            if len(parts) > 1:
                x = self._joined(parts, d)
        return _V(x.id, x.shape, out_dtype, x.store)
