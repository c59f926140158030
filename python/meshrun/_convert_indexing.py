"""Indexing primitives in meshrun._convert: gathers and scatter-adds along one indexed axis as
one-hot selections (take_along_axis, jnp.take of rows, a single index), any other gather or
scatter-add at index vectors without batching dims by comparing every index with every position
(_Points), and scatters of one window at one index vector (x.at[i, j].set(v),
x.at[i, 2:5].add(v)) as a dynamic update of that window."""
import numpy as np

from meshrun._convert_points import _SCATTER_FNS, _Points
from meshrun._ir import F32, G, I32, U32, _V
from meshrun.v1 import common_pb2


class _Indexing(_Points):
    """Converter's gathers and scatters (a mixin: uses its emit, f32, binary, _convert,
    _reshape, _select and _unsupported)."""

    def _indexing_equation(self, name, p, ins, out_dtype, out_shape, eqn):
        """The outputs of a gather or scatter; None for another primitive."""
        if name == "gather":
            return [self._gather(name, eqn, p, ins, out_dtype, out_shape)]
        if name == "scatter-sub":  # x.at[i].subtract(u): as a scatter-add of -u (x + -u is x - u exactly)
            op, idx, upd = ins
            neg = self._elementwise_equation("neg", {}, [upd], upd.dtype, upd.shape, eqn)[0]
            return self._indexing_equation("scatter-add", p, [op, idx, neg], out_dtype, out_shape, eqn)
        if name in _SCATTER_FNS:
            window = self._scatter_window(name, eqn, p, ins, out_dtype)
            if window is not None:
                return [window]
            if name == "scatter-add":
                return [self._scatter_add(name, eqn, p, ins, out_dtype)]
            op, idx, upd = ins
            dn = p["dimension_numbers"]
            if self._points(name, eqn, p, op, idx, dn.scatter_dims_to_operand_dims, dn.inserted_window_dims, upd):
                return [self._scatter_points(name, eqn, p, op, idx, upd, out_dtype)]
            windows = self._scatter_windows(name, eqn, p, op, idx, upd, out_dtype)
            if windows is not None:
                return [windows]
            self._unsupported(name, eqn, _FORMS)
        return None

    # Gathers and their transposes along one indexed axis, as one-hot selections (exact; as in
    # JAX, an index out of range reads the fill value, NaN for floats, and its scatter-add adds
    # nothing under FILL_OR_DROP, jnp's default; CLIP clamps it):
    #   take_along_axis  operand [B..., C], indices [B..., J, 1] (or [B..., 1]: vmapped row[i]),
    #                    batching dims B... -> [B..., J]
    #                    (the batch dims flattened into one: optax's integer-label cross-entropy
    #                    over [batch, time, vocab] logits)
    #   jnp.take rows    operand [V, D], indices [..., 1] -> [..., D] (a select up to _EXACT_ROWS elements,
    #                    else a one-hot matmul: nn.Embed)
    #   one index        operand [..], indices [1] -> the operand without the indexed axis

    def _index_form(self, name, eqn, operand_shape, idx, indexed, batch_op, batch_ix, window):
        k = indexed
        r = len(operand_shape)
        if idx.shape[-1:] != (1,):
            return None
        lead = tuple(range(r - 1))
        if r >= 2 and batch_op == lead and batch_ix == lead and k == r - 1 and len(idx.shape) in (r, r + 1):
            return "along"  # (r: one index per batch element, as jax.vmap(lambda row, i: row[i]) gives)
        if not batch_op and not batch_ix and r == 2 and k == 0 and len(idx.shape) >= 2 and \
                window == (len(idx.shape) - 1,):
            return "rows"
        if not batch_op and not batch_ix and idx.shape == (1,):
            return "one"
        return None

    def _iota(self, shape, dim):
        vid = self.emit(G.IOTA, dtype=F32, shape=list(shape), index=dim, spec=common_pb2.PartitionSpec())
        return _V(vid, shape, np.float32, F32)

    def _mask(self, shape, dim, idx, idx_dims):
        """(iota along `dim` of `shape`) == idx broadcast from its dims `idx_dims` (f32 1 / 0)."""
        i = self.f32(idx)
        ib = _V(self.emit(G.BROADCAST_IN_DIM, [i], shape=list(shape), dims=list(idx_dims)), shape, np.float32, F32)
        return self.binary("eq", self._iota(shape, dim), ib)

    def _pick(self, pred, on_false, on_true, dtype):
        return _V(self.emit(G.SELECT, [pred, on_false, on_true]), pred.shape, dtype, F32)

    def _gather(self, name, eqn, p, ins, out_dtype, out_shape):
        op, idx = ins
        dn = p["dimension_numbers"]
        form, k = None, dn.start_index_map[0] if len(dn.start_index_map) == 1 else None
        if k is not None and tuple(dn.collapsed_slice_dims) == (k,):
            ones = {k, *dn.operand_batching_dims}
            if all(p["slice_sizes"][d] == (1 if d in ones else op.shape[d]) for d in range(len(op.shape))):
                form = self._index_form(name, eqn, op.shape, idx, k, tuple(dn.operand_batching_dims),
                                        tuple(dn.start_indices_batching_dims), tuple(dn.offset_dims))
        if form is None:
            if self._points(name, eqn, p, op, idx, dn.start_index_map, dn.collapsed_slice_dims):
                return self._gather_points(name, eqn, p, op, idx, out_dtype, out_shape)
            windows = self._gather_windows(name, eqn, p, op, idx, out_dtype, out_shape)
            if windows is not None:
                return windows
            self._unsupported(name, eqn, _FORMS)
        mode = str(p.get("mode", ""))
        idx = self._clipped(p, idx, op.shape[k], gather=True)
        # An int32 / uint32 operand is picked and summed in its integers (f32 would round it).
        integral = op.store in (I32, U32)
        x = op if integral else self.f32(op)
        vt, st = (op.dtype, op.store) if integral else (np.float32, F32)
        zero = self.int_scalar(0, op.dtype) if integral else self.scalar(0.0)

        def pick(mask, on_true):
            if integral:
                return self._select(name, eqn, [_V(mask.id, mask.shape, np.bool_, F32), zero, on_true], vt)
            return self._pick(mask, zero, on_true, np.float32)

        def spread(v, shape, dims):
            return _V(self.emit(G.BROADCAST_IN_DIM, [v], shape=list(shape), dims=dims), tuple(shape), vt, st)

        if form == "along":  # out[b, j] = op[b, idx[b, j]], over the batch dims flattened
            b, c = int(np.prod(op.shape[:-1])), op.shape[-1]
            j = int(np.prod(idx.shape[:-1])) // b  # indices per batch element
            mask = self._mask((b, j, c), 2, self._reshape(idx, (b, j)), (0, 1))
            picked = pick(mask, spread(self._reshape(x, (b, c)), (b, j, c), [0, 2]))
            v = _V(self.emit(G.REDUCE, [picked], fn="sum", dims=[2]), (b, j), vt, st)
        elif form == "rows" and (integral or int(np.prod(idx.shape[:-1])) * op.shape[0] * op.shape[1] <= _EXACT_ROWS):
            # out[n, :] = sum_v [idx[n] == v] op[v, :], a select: exact for any values
            (vocab, depth), n = op.shape, int(np.prod(idx.shape[:-1]))
            mask = self._mask((n, vocab, depth), 1, self._reshape(idx, (n,)), (0,))
            picked = pick(mask, spread(x, (n, vocab, depth), [1, 2]))
            v = _V(self.emit(G.REDUCE, [picked], fn="sum", dims=[1]), (n, depth), vt, st)
        elif form == "rows":  # out[n, :] = op[idx[n], :]: one_hot(idx) @ op, over idx flattened
            # (a large table, an embedding's: 0 * inf in the product makes an inf in the table
            # NaN in the other rows' picks)
            (vocab, depth), n = op.shape, int(np.prod(idx.shape[:-1]))
            onehot = self._mask((n, vocab), 1, self._reshape(idx, (n,)), (0,))
            vid = self.emit(G.DOT_GENERAL, [onehot, x], lhs_contracting=[1], rhs_contracting=[0])
            v = _V(vid, (n, depth), np.float32, F32)
        else:  # out = op[..., idx, ...]
            mask = self._mask(op.shape, k, self._reshape(idx, ()), ())
            picked = pick(mask, x)
            v = _V(self.emit(G.REDUCE, [picked], fn="sum", dims=[k]), tuple(d for i, d in enumerate(op.shape) if i != k),
                   vt, st)
        if mode.endswith("FILL_OR_DROP"):  # an index out of range reads the fill value, as JAX's
            v = self._filled_where_out_of_range(name, eqn, p, form, v, idx, op.shape[k], integral)
        v = self._reshape(v, out_shape)
        if integral or op.store == F32:
            return _V(v.id, out_shape, out_dtype, v.store)
        return self._convert("gather", eqn, v, out_dtype)

    def _clipped(self, p, idx, size, gather=False):
        """idx clamped into [0, size) where the mode clamps (_Points._clamps), as f32, as the
        masks read it."""
        if not self._clamps(p, gather):
            return idx
        return self.binary("min", self.binary("max", self.f32(idx), self.scalar(0.0)), self.scalar(float(size - 1)))

    def _filled_where_out_of_range(self, name, eqn, p, form, v, idx, size, integral):
        """v (a gather of `form`'s picks) where idx is in [0, size), else the fill value."""
        i = self.f32(idx)
        ok = self.binary("mul", self.binary("ge", i, self.scalar(0.0)), self.binary("lt", i, self.scalar(float(size))))
        ok = _V(ok.id, ok.shape, np.bool_, F32)
        if form == "along":  # v: [batch, j], idx's elements in order
            ok = self._reshape(ok, v.shape)
        else:  # rows: one index per row of v; one: a single index for all of v
            lead = (v.shape[0],) if form == "rows" else ()
            ok = _V(self.emit(G.BROADCAST_IN_DIM, [self._reshape(ok, lead)], shape=list(v.shape),
                              dims=list(range(len(lead)))), v.shape, np.bool_, F32)
        return self._select(name, eqn, [ok, self._gather_fill(p, v.dtype, integral), v], v.dtype)

    def _gather_fill(self, p, dtype, integral):
        """The gather's fill_value, else jnp's default: NaN, or the most negative (signed) /
        largest (unsigned) integer."""
        value = p.get("fill_value")
        if integral:
            info = np.iinfo(dtype)
            return self.int_scalar(int(value) if value is not None else info.min if info.min < 0 else info.max, dtype)
        return _V(self.emit(G.CONSTANT, value=float("nan") if value is None else float(value)), (), np.float32, F32)

    def _scatter_add(self, name, eqn, p, ins, out_dtype):
        op, idx, upd = ins
        dn = p["dimension_numbers"]
        form, k = None, dn.scatter_dims_to_operand_dims[0] if len(dn.scatter_dims_to_operand_dims) == 1 else None
        if k is not None and tuple(dn.inserted_window_dims) == (k,):
            form = self._index_form(name, eqn, op.shape, idx, k, tuple(dn.operand_batching_dims),
                                    tuple(dn.scatter_indices_batching_dims), tuple(dn.update_window_dims))
        if form is not None and np.dtype(out_dtype) in (np.int32, np.uint32) and self._points(
                name, eqn, p, op, idx, dn.scatter_dims_to_operand_dims, dn.inserted_window_dims, upd, refuse=False):
            return self._scatter_add_points(name, eqn, p, op, idx, upd, out_dtype)  # exact (one-hot sums in f32)
        if form is None:
            if self._points(name, eqn, p, op, idx, dn.scatter_dims_to_operand_dims, dn.inserted_window_dims, upd):
                return self._scatter_add_points(name, eqn, p, op, idx, upd, out_dtype)
            windows = self._scatter_windows(name, eqn, p, op, idx, upd, out_dtype)
            if windows is not None:
                return windows
            self._unsupported(name, eqn, _FORMS)
        idx = self._clipped(p, idx, op.shape[k])  # (an index out of range adds nothing: FILL_OR_DROP)
        u = self.f32(upd)
        zero = self.scalar(0.0)
        if form == "along":  # out[b, c] = op[b, c] + sum_j [idx[b, j] == c] upd[b, j], batch dims flat
            b, c = int(np.prod(op.shape[:-1])), op.shape[-1]
            j = int(np.prod(idx.shape[:-1])) // b  # indices per batch element
            mask = self._mask((b, j, c), 2, self._reshape(idx, (b, j)), (0, 1))
            ub = _V(self.emit(G.BROADCAST_IN_DIM, [self._reshape(u, (b, j))], shape=[b, j, c], dims=[0, 1]),
                    (b, j, c), np.float32, F32)
            spread = self._pick(mask, zero, ub, np.float32)
            add = self._reshape(_V(self.emit(G.REDUCE, [spread], fn="sum", dims=[1]), (b, c), np.float32, F32),
                                op.shape)
        elif form == "rows":  # out = op + one_hot(idx)^T @ upd, over idx and upd's rows flattened
            (vocab, depth), n = op.shape, int(np.prod(idx.shape[:-1]))
            onehot = self._mask((n, vocab), 1, self._reshape(idx, (n,)), (0,))
            vid = self.emit(G.DOT_GENERAL, [onehot, self._reshape(u, (n, depth))], lhs_contracting=[0],
                            rhs_contracting=[0])
            add = _V(vid, op.shape, np.float32, F32)
        else:
            mask = self._mask(op.shape, k, self._reshape(idx, ()), ())
            others = [d for d in range(len(op.shape)) if d != k]
            ub = _V(self.emit(G.BROADCAST_IN_DIM, [u], shape=list(op.shape), dims=others), op.shape, np.float32, F32)
            add = self._pick(mask, zero, ub, np.float32)
        v = self.binary("add", self.f32(op), add)
        return _V(v.id, op.shape, out_dtype, F32)

    def _scatter_window(self, name, eqn, p, ins, out_dtype):
        """A scatter of one window at one index vector (indices [K] for K operand dims, updates
        the window): the operand with the window at those starts replaced (scatter) or combined
        with the updates (scatter-add / -mul / -min / -max) through DYNAMIC_SLICE and
        DYNAMIC_UPDATE_SLICE. Those clamp a start that would put the window out of bounds, where
        the scatter's FILL_OR_DROP mode (jnp's default) drops the update: the operand is then
        kept whole. None for another form."""
        op, idx, upd = ins
        dn = p["dimension_numbers"]
        to_dims = tuple(dn.scatter_dims_to_operand_dims)
        if dn.operand_batching_dims or idx.shape != (len(to_dims),) or \
                len(upd.shape) != len(dn.update_window_dims):
            return None
        r = len(op.shape)
        sizes = iter(upd.shape[d] for d in dn.update_window_dims)
        window = tuple(1 if d in dn.inserted_window_dims else next(sizes) for d in range(r))
        starts = []
        for d in range(r):
            if d in to_dims:
                k = to_dims.index(d)
                s = _V(self.emit(G.SLICE, [idx], dims=[k], shape=[k + 1]), (1,), idx.dtype, idx.store)
                starts.append(self._reshape(s, ()))
            else:
                starts.append(self.int_scalar(0, np.int32))
        u = self._reshape(upd, window)
        if u.store != op.store:
            u = _V(self.emit(G.CONVERT, [u], dtype=op.store), u.shape, op.dtype, op.store)
        fn = _SCATTER_FNS[name]
        if fn is not None:  # the window's current values combined with the updates
            cur = _V(self.emit(G.DYNAMIC_SLICE, [op] + starts, shape=list(window)), window, op.dtype, op.store)
            u = self.binary(fn, cur, u, op.dtype)
            if u.store != op.store:
                u = _V(self.emit(G.CONVERT, [u], dtype=op.store), u.shape, op.dtype, op.store)
        new = _V(self.emit(G.DYNAMIC_UPDATE_SLICE, [op, u] + starts), op.shape, op.dtype, op.store)
        if not str(p.get("mode", "")).endswith("FILL_OR_DROP"):
            return _V(new.id, op.shape, out_dtype, new.store)  # CLIP / PROMISE_IN_BOUNDS: clamped
        def holds(fn, a, b):  # a comparison's 1 / 0, a bool held as f32
            v = self.binary(fn, a, b)
            return _V(v.id, v.shape, np.bool_, F32)

        inside = None
        for d in to_dims:
            s = self.f32(starts[d])
            ok = self.binary("mul", holds("ge", s, self.scalar(0.0)),
                             holds("le", s, self.scalar(float(op.shape[d] - window[d]))), np.bool_)
            inside = ok if inside is None else self.binary("mul", inside, ok, np.bool_)
        if inside is None:
            return _V(new.id, op.shape, out_dtype, new.store)
        pred = _V(self.emit(G.BROADCAST_IN_DIM, [inside], shape=list(op.shape), dims=[]), op.shape, np.bool_, F32)
        return self._select(name, eqn, [pred, op, new], out_dtype)


_FORMS = ("this gather / scatter form (supported: take_along_axis, jnp.take, single elements or windows at "
          "index vectors over any dims, batched or not)")

# Up to this many elements (n x V x D), a row gather selects rather than multiplies by a one-hot
# matrix: 2**22, 16 MiB of f32.
_EXACT_ROWS = 2 ** 22
