"""Gathers, scatters and scatter-adds at index vectors in meshrun._convert, where no one-hot
form of meshrun._convert_indexing fits: every index vector compared with every position of the
indexed dims (x[jnp.arange(n), labels], jnp.diagonal, jnp.take along any axis, searchsorted,
nonzero, x.at[idx].set / min / max / multiply at a batch of indices)."""
import jax
import numpy as np

from meshrun._ir import F32, G, I32, U32, _V


class _Points:
    """Gathers and scatter-adds of single elements (or whole windows along the other dims) at
    index vectors over one or several operand dims -- x[jnp.arange(n), labels], jnp.diagonal,
    jnp.take(x, i, axis=1), searchsorted's picks -- and their transposes (a mixin of
    _Indexing's helpers). The indexed dims are flattened into one of V positions, each index
    vector into its position (f32, exact below 2**24), and every index compared with every
    position: one select and one REDUCE sum over [n, V, R] (n index vectors, R elements per
    position), exact for any values, inf and NaN included; batching dims (jax.vmap) are indexed by
    the vector's own batch coordinate. Sizes are bounded by _MAX_POINT_WORK."""

    @staticmethod
    def _batching(p):
        """The operand's batching dims and the indices' (jax.vmap of an indexing): a batch
        element's index vector reads only its own block of the operand."""
        dn = p["dimension_numbers"]
        ib = getattr(dn, "start_indices_batching_dims", None)
        if ib is None:
            ib = getattr(dn, "scatter_indices_batching_dims", ())
        return [int(d) for d in getattr(dn, "operand_batching_dims", ())], [int(d) for d in ib]

    @staticmethod
    def _clamps(p, gather):
        """Whether an index out of range is clamped into range: under lax's CLIP mode, and a
        gather's under PROMISE_IN_BOUNDS (XLA's gather clamps its starts, so `x[i]` of a traced i
        out of range reads the nearest row under jax.jit; XLA's scatter skips such an update)."""
        mode = str(p.get("mode", ""))
        return mode.endswith("CLIP") or (gather and mode.endswith("PROMISE_IN_BOUNDS"))

    def _point_dims(self, p, op, idx, index_map, collapsed, upd):
        """(points, whole): the index vector's components (k, operand dim) whose window is one
        element, and those whose window is the whole dim (jax.vmap's m[k] indexes [k, 0]: its
        start can only be 0); None where another window, or a layout this path does not take,
        occurs."""
        dn = p["dimension_numbers"]
        r = len(op.shape)
        index_map = [int(d) for d in index_map]
        ob, ib = self._batching(p)
        if len(set(index_map + ob)) != len(index_map) + len(ob) or len(ob) != len(ib) or \
                idx.shape[-1:] != (len(index_map),) or any(d >= len(idx.shape) - 1 for d in ib) or \
                any(op.shape[o] != idx.shape[i] for o, i in zip(ob, ib)) or not set(collapsed) <= set(index_map):
            return None
        if upd is None:
            window = [int(w) for w in p["slice_sizes"]]
        else:  # the updates: the index vectors' dims, then (at update_window_dims) the windows'
            wd = list(dn.update_window_dims)
            free = [d for d in range(r) if d not in collapsed and d not in ob]
            batch = [upd.shape[q] for q in range(len(upd.shape)) if q not in wd]
            if len(wd) != len(free) or tuple(batch) != tuple(idx.shape[:-1]):
                return None
            window = [1] * r
            for d, q in zip(free, wd):
                window[d] = upd.shape[q]
        if any(window[d] != 1 for d in ob) or any(window[d] != 1 for d in collapsed) or \
                any(window[d] != op.shape[d] for d in range(r) if d not in index_map and d not in ob):
            return None
        points = [(k, d) for k, d in enumerate(index_map) if window[d] == 1]
        whole = [(k, d) for k, d in enumerate(index_map) if window[d] != 1]
        if any(window[d] != op.shape[d] for _, d in whole):
            return None
        return points, whole

    def _points(self, name, eqn, p, op, idx, index_map, collapsed, upd=None, refuse=True):
        """Whether this gather (scatter, given its updates `upd`) takes the point path: windows
        of one element along the indexed and batching dims (collapsed or kept as unit dims),
        whole along the others, laid out anywhere; when too large, refused by name (or, with
        refuse=False, not taken)."""
        dims = self._point_dims(p, op, idx, index_map, collapsed, upd)
        if dims is None:
            return False
        ob, _ = self._batching(p)
        at = [d for _, d in dims[0]] + ob
        n, positions = int(np.prod(idx.shape[:-1])), int(np.prod([op.shape[d] for d in at]))
        work = n * positions * int(np.prod([op.shape[d] for d in range(len(op.shape)) if d not in at]))
        if positions >= 2 ** 24 or work > _MAX_POINT_WORK:
            if not refuse:
                return False
            self._unsupported(name, eqn, f"{n} index vectors into {positions} positions ({work} compares, above "
                                         f"{_MAX_POINT_WORK}); index one axis at a time (jnp.take_along_axis)")
        return True

    def _point_positions(self, p, op, idx, index_map, collapsed, upd=None):
        """The operand as [V, R] (point dims, then batching dims, first, flattened), each index
        vector's position as f32 [n] (-1 where FILL_OR_DROP finds a component out of range; CLIP
        clamps each; a batching dim's component is the vector's own batch coordinate), the
        in-range mask (None unless FILL_OR_DROP), and the [V, R] block's shape before flattening
        with the inverse of the layout change."""
        r, nb = len(op.shape), len(idx.shape) - 1
        ob, ib = self._batching(p)
        points, whole = self._point_dims(p, op, idx, index_map, collapsed, upd)
        dims = [d for _, d in points] + ob
        rest = [d for d in range(r) if d not in dims]
        perm = dims + rest
        sizes = [op.shape[d] for d in dims]
        n = int(np.prod(idx.shape[:-1]))
        x = self._reshape(self._transposed(op, perm), (int(np.prod(sizes)), int(np.prod([op.shape[d] for d in rest]))))
        mode = str(p.get("mode", ""))

        def component(k):
            starts, limits = [0] * (nb + 1), list(idx.shape)
            starts[-1], limits[-1] = k, k + 1
            part = _V(self.emit(G.SLICE, [idx], dims=starts, shape=limits), tuple(idx.shape[:-1]) + (1,),
                      idx.dtype, idx.store)
            return self.f32(self._reshape(part, (n,)))

        def within(c, size):  # 1 where 0 <= c < size
            return self.binary("mul", self.binary("ge", c, self.scalar(0.0)), self.binary("lt", c, self.scalar(float(size))))

        linear, ok, stride = None, None, 1
        for j in reversed(range(len(dims))):
            if j >= len(points):  # a batching dim: the index vector's coordinate along its pair
                c = self._reshape(self._iota(tuple(idx.shape[:-1]), ib[j - len(points)]), (n,))
            else:
                c = component(points[j][0])
                if self._clamps(p, gather=upd is None):
                    c = self.binary("min", self.binary("max", c, self.scalar(0.0)), self.scalar(float(sizes[j] - 1)))
                if mode.endswith("FILL_OR_DROP"):
                    ok = within(c, sizes[j]) if ok is None else self.binary("mul", ok, within(c, sizes[j]))
            term = c if stride == 1 else self.binary("mul", c, self.scalar(float(stride)))
            linear = term if linear is None else self.binary("add", linear, term)
            stride *= sizes[j]
        if mode.endswith("FILL_OR_DROP"):  # a whole-dim window is in bounds only at start 0
            for k, _ in whole:
                inside = within(component(k), 1)
                ok = inside if ok is None else self.binary("mul", ok, inside)
        if ok is not None:  # out of range: position -1, which no position equals
            linear = self.binary("sub", self.binary("mul", linear, ok), self.binary("sub", self.scalar(1.0), ok))
        inverse = [perm.index(d) for d in range(r)]
        return x, linear, ok, (tuple(sizes) + tuple(op.shape[d] for d in rest), inverse)

    def _window_points(self, idx, index_map, partial, sizes, adjust):
        """Index vectors [N..., W..., K]: one per element of each window of `partial` ((k, operand
        dim) pairs whose windows are longer than one element: W their sizes), the start
        adjust(k, d, start as f32 [N...]) plus the element's position along those dims; the other
        components as they come (f32)."""
        nshape = tuple(idx.shape[:-1])
        full = nshape + tuple(sizes[d] for _, d in partial)
        components = []
        for k, d in enumerate(index_map):
            part = _V(self.emit(G.SLICE, [idx], dims=[0] * len(nshape) + [k], shape=list(nshape) + [k + 1]),
                      nshape + (1,), idx.dtype, idx.store)
            c = self.f32(self._reshape(part, nshape))
            c = adjust(k, d, _V(c.id, nshape, np.float32, F32))  # (an index held as f32 computes in f32)
            c = _V(self.emit(G.BROADCAST_IN_DIM, [c], shape=list(full), dims=list(range(len(nshape)))), full,
                   np.float32, F32)
            for i, (kk, _) in enumerate(partial):
                if kk == k:
                    c = self.binary("add", c, self._iota(full, len(nshape) + i))
            components.append(self._reshape(c, full + (1,)))
        return _V(self.emit(G.CONCATENATE, components, index=len(full)), full + (len(index_map),), np.float32, F32)

    def _partial_windows(self, p, op, idx, index_map, collapsed, sizes):
        """The (k, operand dim) pairs of the index vector whose windows are longer than one
        element and shorter than their dim; None where the index vectors do not fit index_map."""
        if idx.shape[-1:] != (len(index_map),):
            return None
        return [(k, d) for k, d in enumerate(index_map) if 1 < sizes[d] < op.shape[d] and d not in collapsed]

    def _gather_windows(self, name, eqn, p, op, idx, out_dtype, out_shape):
        """A gather of windows longer than one element but shorter than their dim along indexed
        dims (jax.vmap of lax.dynamic_slice: per-example crops and sequence windows) as a gather of
        points: each start clamped into [0, size - window] as XLA's gather clamps it
        (FILL_OR_DROP: the whole window is the fill value where a start is out of that range, as
        JAX's), then one index vector per element of the window. None for another form (or where
        the points path would not take it)."""
        dn = p["dimension_numbers"]
        sizes, index_map = [int(w) for w in p["slice_sizes"]], [int(d) for d in dn.start_index_map]
        collapsed, ob = set(int(d) for d in dn.collapsed_slice_dims), self._batching(p)[0]
        partial = self._partial_windows(p, op, idx, index_map, collapsed, sizes)
        if not partial:
            return None
        windowed = {d for _, d in partial}
        nshape = tuple(idx.shape[:-1])
        fill = str(p.get("mode", "")).endswith("FILL_OR_DROP")
        ok = []

        def clamp(k, d, c):
            hi = self.scalar(float(op.shape[d] - sizes[d]))
            if fill:
                ok.append(self.binary("mul", self.binary("ge", c, self.scalar(0.0)), self.binary("le", c, hi)))
            return self.binary("min", self.binary("max", c, self.scalar(0.0)), hi)

        points = self._window_points(idx, index_map, partial, sizes, clamp)
        full = tuple(points.shape[:-1])
        kept = [d for d in range(len(op.shape)) if d not in collapsed and d not in ob]
        point_sizes = [1 if d in windowed else w for d, w in enumerate(sizes)]
        dn2 = jax.lax.GatherDimensionNumbers(
            offset_dims=tuple(range(len(full), len(full) + len(kept))), collapsed_slice_dims=dn.collapsed_slice_dims,
            start_index_map=dn.start_index_map, operand_batching_dims=dn.operand_batching_dims,
            start_indices_batching_dims=dn.start_indices_batching_dims)
        p2 = dict(p, dimension_numbers=dn2, slice_sizes=tuple(point_sizes), mode=jax.lax.GatherScatterMode.CLIP)
        if not self._points(name, eqn, p2, op, points, dn2.start_index_map, dn2.collapsed_slice_dims):
            return None
        v = self._gather_points(name, eqn, p2, op, points, out_dtype, full + tuple(point_sizes[d] for d in kept))
        # [N..., W..., kept (a partial dim's 1)...] -> the windows' axes in their dims' places
        rest = [d for d in kept if d not in windowed]
        v = self._reshape(v, full + tuple(sizes[d] for d in rest))
        axis = {pd: len(nshape) + i for i, (_, pd) in enumerate(partial)}
        axis.update({d: len(full) + j for j, d in enumerate(rest)})
        batch, offsets = iter(range(len(nshape))), list(dn.offset_dims)
        v = self._transposed(v, [axis[kept[offsets.index(q)]] if q in offsets else next(batch)
                                 for q in range(len(out_shape))])
        if not ok:
            return v
        inside = ok[0]
        for o in ok[1:]:
            inside = self.binary("mul", inside, o)
        pred = _V(self.emit(G.BROADCAST_IN_DIM, [inside], shape=list(out_shape),
                            dims=[q for q in range(len(out_shape)) if q not in offsets]), tuple(out_shape), np.bool_, F32)
        return self._select(name, eqn, [pred, self._gather_fill(p, out_dtype, v.store in (I32, U32)), v], out_dtype)

    def _scatter_windows(self, name, eqn, p, op, idx, upd, out_dtype):
        """The transpose of _gather_windows (jax.grad of vmapped dynamic_slice) and vmapped
        dynamic_update_slice: a scatter(-add, -set, -min, -max, -mul) of windows longer than one
        element along indexed dims as a scatter of points, one per element of each window. CLIP
        clamps each start into [0, size - window], as JAX's; FILL_OR_DROP and PROMISE_IN_BOUNDS
        drop a window that does not fit whole, as XLA's scatter skips it. None for another form."""
        dn = p["dimension_numbers"]
        index_map = [int(d) for d in dn.scatter_dims_to_operand_dims]
        collapsed, ob = set(int(d) for d in dn.inserted_window_dims), self._batching(p)[0]
        kept = [d for d in range(len(op.shape)) if d not in collapsed and d not in ob]
        wd = [int(q) for q in dn.update_window_dims]
        if len(wd) != len(kept) or idx.shape[-1:] != (len(index_map),):
            return None
        sizes = [1] * len(op.shape)
        for d, q in zip(kept, wd):
            sizes[d] = upd.shape[q]
        partial = self._partial_windows(p, op, idx, index_map, collapsed, sizes)
        if not partial:
            return None
        windowed = {d for _, d in partial}
        clip = str(p.get("mode", "")).endswith("CLIP")

        def start(k, d, c):
            hi = self.scalar(float(op.shape[d] - sizes[d]))
            if clip:
                return self.binary("min", self.binary("max", c, self.scalar(0.0)), hi)
            # a window that does not fit: every element's index out of range (dropped)
            fits = self.binary("mul", self.binary("ge", c, self.scalar(0.0)), self.binary("le", c, hi))
            away = self.scalar(-2.0 * (op.shape[d] + sizes[d]))
            return self.binary("add", self.binary("mul", c, fits),
                               self.binary("mul", self.binary("sub", self.scalar(1.0), fits), away))

        points = self._window_points(idx, index_map, partial, sizes, start)
        full = tuple(points.shape[:-1])
        # the updates as [N..., W..., kept (a partial dim's 1)...]
        u = self._transposed(upd, [q for q in range(len(upd.shape)) if q not in wd] +
                             [wd[kept.index(pd)] for _, pd in partial] +
                             [q for d, q in zip(kept, wd) if d not in windowed])
        point_sizes = [1 if d in windowed else w for d, w in enumerate(sizes)]
        u = self._reshape(u, full + tuple(point_sizes[d] for d in kept))
        dn2 = jax.lax.ScatterDimensionNumbers(
            update_window_dims=tuple(range(len(full), len(full) + len(kept))),
            inserted_window_dims=dn.inserted_window_dims, scatter_dims_to_operand_dims=dn.scatter_dims_to_operand_dims,
            operand_batching_dims=dn.operand_batching_dims, scatter_indices_batching_dims=dn.scatter_indices_batching_dims)
        p2 = dict(p, dimension_numbers=dn2,
                  mode=jax.lax.GatherScatterMode.CLIP if clip else jax.lax.GatherScatterMode.FILL_OR_DROP)
        if not self._points(name, eqn, p2, op, points, dn2.scatter_dims_to_operand_dims, dn2.inserted_window_dims, u):
            return None
        if name == "scatter-add":
            return self._scatter_add_points(name, eqn, p2, op, points, u, out_dtype)
        return self._scatter_points(name, eqn, p2, op, points, u, out_dtype)

    def _gather_points(self, name, eqn, p, op, idx, out_dtype, out_shape):
        dn = p["dimension_numbers"]
        x, linear, ok, _ = self._point_positions(p, op, idx, dn.start_index_map, dn.collapsed_slice_dims)
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
        nb = len(idx.shape) - 1
        ob, _ = self._batching(p)
        kept = [int(p["slice_sizes"][d]) for d in range(len(op.shape)) if d not in dn.collapsed_slice_dims and d not in ob]
        v = self._reshape(v, tuple(idx.shape[:-1]) + tuple(kept))
        batch = iter(range(nb))
        offsets = list(dn.offset_dims)
        v = self._transposed(v, [nb + offsets.index(q) if q in offsets else next(batch)
                                 for q in range(nb + len(kept))])
        if integral or op.store == F32:
            return _V(v.id, tuple(out_shape), out_dtype, v.store)
        return self._convert(name, eqn, v, out_dtype)

    def _scatter_add_points(self, name, eqn, p, op, idx, upd, out_dtype):
        dn = p["dimension_numbers"]
        x, linear, _, (shape, inverse) = self._point_positions(p, op, idx, dn.scatter_dims_to_operand_dims,
                                                               dn.inserted_window_dims, upd)
        (positions, width), n = x.shape, linear.shape[0]
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
        dn = p["dimension_numbers"]
        x, linear, _, (shape, inverse) = self._point_positions(p, op, idx, dn.scatter_dims_to_operand_dims,
                                                               dn.inserted_window_dims, upd)
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
