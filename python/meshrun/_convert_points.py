"""Gathers, scatters and scatter-adds at index vectors in meshrun._convert, where no one-hot
form of meshrun._convert_indexing fits: every index vector compared with every position of the
indexed dims (x[jnp.arange(n), labels], jnp.diagonal, jnp.take along any axis, searchsorted,
nonzero, x.at[idx].set / min / max / multiply at a batch of indices)."""
import numpy as np

from meshrun._ir import F32, G, I32, U32, _V


class _Points:
    """Gathers and scatter-adds of single elements (or whole windows along the other dims) at
    index vectors over one or several operand dims -- x[jnp.arange(n), labels], jnp.diagonal,
    jnp.take(x, i, axis=1), searchsorted's picks -- and their transposes (a mixin of
    _Indexing's helpers). The indexed dims are flattened into one of V positions, each index
    vector into its position (f32, exact below 2**24), and every index compared with every
    position: one select and one REDUCE sum over [n, V, R] (n index vectors, R elements per
    position), exact for any values, inf and NaN included. Sizes are bounded by _MAX_POINT_WORK."""

    def _points(self, name, eqn, p, op, idx, index_map, collapsed, upd=None):
        """Whether this is such a gather (scatter-add, given its updates `upd`): no batching dims,
        an index vector's dim last, windows of one element along the indexed dims (collapsed or
        kept as unit dims) and whole along the others, laid out anywhere in the result."""
        dn = p["dimension_numbers"]
        r = len(op.shape)
        index_map = [int(d) for d in index_map]
        if getattr(dn, "operand_batching_dims", ()) or not set(collapsed) <= set(index_map) or \
                len(set(index_map)) != len(index_map) or idx.shape[-1:] != (len(index_map),):
            return False
        window = [1 if d in index_map else op.shape[d] for d in range(r)]
        if upd is None and tuple(p["slice_sizes"]) != tuple(window):
            return False
        if upd is not None:  # the updates: the index vectors' dims and the windows' (non-inserted)
            wd = list(dn.update_window_dims)
            kept = [window[d] for d in range(r) if d not in collapsed]
            batch = [upd.shape[q] for q in range(len(upd.shape)) if q not in wd]
            if [upd.shape[q] for q in wd] != kept or tuple(batch) != tuple(idx.shape[:-1]):
                return False
        n, positions = int(np.prod(idx.shape[:-1])), int(np.prod([op.shape[d] for d in index_map]))
        work = n * positions * int(np.prod([op.shape[d] for d in range(r) if d not in index_map]))
        if positions >= 2 ** 24 or work > _MAX_POINT_WORK:
            self._unsupported(name, eqn, f"{n} index vectors into {positions} positions ({work} compares, above "
                                         f"{_MAX_POINT_WORK}); index one axis at a time (jnp.take_along_axis)")
        return True

    def _point_positions(self, p, op, idx, index_map):
        """The operand as [V, R] (indexed dims first, flattened), each index vector's position
        as f32 [n] (-1 where FILL_OR_DROP finds a component out of range; CLIP clamps each), and
        the in-range mask (None unless FILL_OR_DROP) and the inverse of the layout change."""
        r, nb = len(op.shape), len(idx.shape) - 1
        rest = [d for d in range(r) if d not in index_map]
        perm = [int(d) for d in index_map] + rest
        sizes = [op.shape[d] for d in index_map]
        n = int(np.prod(idx.shape[:-1]))
        x = self._reshape(self._transposed(op, perm), (int(np.prod(sizes)), int(np.prod([op.shape[d] for d in rest]))))
        mode = str(p.get("mode", ""))
        linear, ok, stride = None, None, 1
        for k in reversed(range(len(index_map))):
            starts, limits = [0] * (nb + 1), list(idx.shape)
            starts[-1], limits[-1] = k, k + 1
            part = _V(self.emit(G.SLICE, [idx], dims=starts, shape=limits), tuple(idx.shape[:-1]) + (1,), idx.dtype,
                      idx.store)
            c = self.f32(self._reshape(part, (n,)))
            if mode.endswith("CLIP"):
                c = self.binary("min", self.binary("max", c, self.scalar(0.0)), self.scalar(float(sizes[k] - 1)))
            if mode.endswith("FILL_OR_DROP"):
                inside = self.binary("mul", self.binary("ge", c, self.scalar(0.0)),
                                     self.binary("lt", c, self.scalar(float(sizes[k]))))
                ok = inside if ok is None else self.binary("mul", ok, inside)
            term = c if stride == 1 else self.binary("mul", c, self.scalar(float(stride)))
            linear = term if linear is None else self.binary("add", linear, term)
            stride *= sizes[k]
        if ok is not None:  # out of range: position -1, which no position equals
            linear = self.binary("sub", self.binary("mul", linear, ok), self.binary("sub", self.scalar(1.0), ok))
        inverse = [perm.index(d) for d in range(r)]
        return x, linear, ok, (tuple(sizes) + tuple(op.shape[d] for d in rest), inverse)

    def _gather_points(self, name, eqn, p, op, idx, out_dtype, out_shape):
        x, linear, ok, _ = self._point_positions(p, op, idx, p["dimension_numbers"].start_index_map)
        (positions, width), n = x.shape, linear.shape[0]
        integral = x.store in (I32, U32)
        if not integral:
            x = self.f32(x)
        mask = self._mask((n, positions, width), 1, linear, (0,))
        spread = _V(self.emit(G.BROADCAST_IN_DIM, [x], shape=[n, positions, width], dims=[1, 2]),
                    (n, positions, width), x.dtype, x.store)
        if integral:
            picked = self._select(name, eqn, [_V(mask.id, mask.shape, np.bool_, F32), self.int_scalar(0, x.dtype),
                                              spread], x.dtype)
        else:
            picked = self._pick(mask, self.scalar(0.0), spread, np.float32)
        v = _V(self.emit(G.REDUCE, [picked], fn="sum", dims=[1]), (n, width), picked.dtype, picked.store)
        if ok is not None:  # the fill value where an index is out of range
            fill = self._gather_fill(p, v.dtype, integral)
            inside = _V(self.emit(G.BROADCAST_IN_DIM, [ok], shape=[n, width], dims=[0]), (n, width), np.bool_, F32)
            v = self._select(name, eqn, [inside, fill, v], v.dtype)
        # [n, R] -> [index dims..., kept window dims...] -> the window dims at offset_dims
        dn = p["dimension_numbers"]
        nb = len(idx.shape) - 1
        kept = [1 if d in dn.start_index_map else op.shape[d] for d in range(len(op.shape))
                if d not in dn.collapsed_slice_dims]
        v = self._reshape(v, tuple(idx.shape[:-1]) + tuple(kept))
        batch = iter(range(nb))
        offsets = list(dn.offset_dims)
        v = self._transposed(v, [nb + offsets.index(q) if q in offsets else next(batch)
                                 for q in range(nb + len(kept))])
        if integral or op.store == F32:
            return _V(v.id, tuple(out_shape), out_dtype, v.store)
        return self._convert(name, eqn, v, out_dtype)

    def _scatter_add_points(self, name, eqn, p, op, idx, upd, out_dtype):
        _, linear, _, (shape, inverse) = self._point_positions(p, op, idx, p["dimension_numbers"].scatter_dims_to_operand_dims)
        k = len(p["dimension_numbers"].scatter_dims_to_operand_dims)
        n, positions, width = linear.shape[0], int(np.prod(shape[:k])), int(np.prod(shape[k:]))
        # int32 / uint32 add in their own (wrapping) integers, as XLA's
        store = {np.dtype(np.int32): I32, np.dtype(np.uint32): U32}.get(np.dtype(out_dtype))
        dtype = np.dtype(out_dtype) if store is not None else np.dtype(np.float32)
        u = self.integer(upd, store, dtype) if store is not None else self.f32(upd)
        wd = list(p["dimension_numbers"].update_window_dims)  # the index vectors' dims first
        u = self._transposed(u, [q for q in range(len(upd.shape)) if q not in wd] + wd)
        u = self._reshape(u, (n, width))
        mask = self._mask((n, positions, width), 1, linear, (0,))
        ub = _V(self.emit(G.BROADCAST_IN_DIM, [u], shape=[n, positions, width], dims=[0, 2]), (n, positions, width),
                u.dtype, u.store)
        if store is not None:
            spread = self._select(name, eqn, [_V(mask.id, mask.shape, np.bool_, F32), self.int_scalar(0, dtype), ub],
                                  dtype)
        else:
            spread = self._pick(mask, self.scalar(0.0), ub, np.float32)
        add = _V(self.emit(G.REDUCE, [spread], fn="sum", dims=[0]), (positions, width), spread.dtype, spread.store)
        add = self._transposed(self._reshape(add, shape), inverse)
        base = self.integer(op, store, dtype) if store is not None else self.f32(op)
        v = self.binary("add", base, add, dtype)
        return _V(v.id, op.shape, out_dtype, v.store)


    def _scatter_points(self, name, eqn, p, op, idx, upd, out_dtype):
        """x.at[idx].set / .min / .max / .multiply at a batch of index vectors: per position, the
        updates that land on it (every index compared with every position) combined -- set: the
        last index's update, as XLA's CPU scatter applies them in order; min / max / multiply: all
        of them with the operand's value; positions no index hits keep the operand's."""
        fn = _SCATTER_FNS[name]
        store = {np.dtype(np.int32): I32, np.dtype(np.uint32): U32}.get(np.dtype(out_dtype))
        if store is not None and fn is not None:
            self._unsupported(name, eqn, f"an integer ({np.dtype(out_dtype)}) scatter-{fn} at a batch of indices")
        index_map = p["dimension_numbers"].scatter_dims_to_operand_dims
        x, linear, _, (shape, inverse) = self._point_positions(p, op, idx, index_map)
        (positions, width), n = x.shape, linear.shape[0]
        dtype = np.dtype(out_dtype) if store is not None else np.dtype(np.float32)
        x = self.integer(x, store, dtype) if store is not None else self.f32(x)
        u = self.integer(upd, store, dtype) if store is not None else self.f32(upd)
        wd = list(p["dimension_numbers"].update_window_dims)  # the index vectors' dims first
        u = self._reshape(self._transposed(u, [q for q in range(len(upd.shape)) if q not in wd] + wd), (n, width))
        full = (n, positions, width)
        mask = self._mask(full, 1, linear, (0,))
        ub = _V(self.emit(G.BROADCAST_IN_DIM, [u], shape=list(full), dims=[0, 2]), full, u.dtype, u.store)

        def reduce(fn_, v):
            return _V(self.emit(G.REDUCE, [v], fn=fn_, dims=[0]), (positions, width), v.dtype, v.store)

        hit = reduce("max", mask)
        if fn is None:  # the last index vector landing on a position wins
            order = self.binary("add", self._iota(full, 0), self.scalar(1.0))
            last = reduce("max", self.binary("mul", mask, order))
            chosen = self.binary("eq", order, _V(self.emit(G.BROADCAST_IN_DIM, [last], shape=list(full), dims=[1, 2]),
                                                 full, np.float32, F32))
            chosen = self.binary("mul", chosen, mask)
            if store is not None:
                picked = self._select(name, eqn, [_V(chosen.id, full, np.bool_, F32), self.int_scalar(0, dtype), ub],
                                      dtype)
            else:
                picked = self._pick(chosen, self.scalar(0.0), ub, np.float32)
            new = reduce("sum", picked)
        elif fn == "mul":
            ones = self._pick(mask, self.scalar(1.0), ub, np.float32)
            new = self.binary("mul", x, self._reduce_prod(ones, [0], np.float32, (positions, width)))
        else:  # min / max: the updates' extreme (NaN propagating), then with the operand's value
            flip = fn == "min"  # min(v) = -max(-v)
            vals = self._pick(mask, self.scalar(float("-inf")), self.unary("neg", ub) if flip else ub, np.float32)
            extreme = reduce("max", vals)
            new = self.binary(fn, x, self.unary("neg", extreme) if flip else extreme)
        out = self._select(name, eqn, [_V(hit.id, hit.shape, np.bool_, F32), x, new], dtype)
        out = self._transposed(self._reshape(out, shape), inverse)
        return _V(out.id, tuple(op.shape), out_dtype, out.store)


# Compares a gather or scatter of points may make (n x V x R): 2**26, 256 MiB of f32 mask.
_MAX_POINT_WORK = 2 ** 26

# The combining fn of each scatter primitive (None: the updates replace the window).
_SCATTER_FNS = {"scatter": None, "scatter-add": "add", "scatter-mul": "mul", "scatter-min": "min",
                "scatter-max": "max"}
