"""Windowed primitives in meshrun._convert: convolutions (lax.conv_general_dilated, flax's
nn.Conv) and window reductions (lax.reduce_window_sum / _max / _min: nn.avg_pool, nn.max_pool)
with max pooling's gradient (select_and_scatter_add).

Each is lowered to ops the coordinator already partitions: the operand padded (lax.pad), one
strided SLICE per window position, and for a convolution one DOT_GENERAL (oneDNN's GEMM) over
the stacked slices, im2col style; for a window reduction the slices' sum / max / min. Shapes are
row-major as JAX's; a convolution's operands and result keep their dimension_numbers' layouts
(TRANSPOSEs to and from [batch, spatial..., feature] around the product).
"""
import itertools

import numpy as np

from meshrun._ir import BF16, F32, G, I32, U32, _V

SUPPORTED_WINDOWS = {
    "conv_general_dilated": "per window position a strided SLICE of the padded (lhs-dilated) operand, "
                            "CONCATENATEd and contracted with the kernel in one DOT_GENERAL (or, for a "
                            "window larger than the output -- a kernel gradient -- one DOT_GENERAL per "
                            "output position); feature and batch groups as SLICEs",
    "reduce_window_sum": "the padded operand's strided SLICEs per window position, added",
    "reduce_window_max": "the padded operand's strided SLICEs per window position, BINARY max",
    "reduce_window_min": "the padded operand's strided SLICEs per window position, BINARY min",
    "select_and_scatter_add": "per window position: the first position holding the window's max (min), "
                              "its source value padded back into place and added (max pooling's gradient)",
}


def _positions(sizes):
    """Every index tuple of a box of `sizes`, row-major (XLA's window iteration order)."""
    return itertools.product(*[range(int(s)) for s in sizes])


class _Windows:
    """Converter's windowed primitives (a mixin: uses emit, f32, binary and _Layout's _pad, _slice_strided, _joined)."""

    def _window_equation(self, name, p, ins, out_dtype, out_shape, eqn):
        """The outputs of a windowed primitive; None for another primitive."""
        if name == "conv_general_dilated":
            return [self._conv(name, p, ins, out_dtype, out_shape, eqn)]
        if name in ("reduce_window_sum", "reduce_window_max", "reduce_window_min"):
            return [self._reduce_window(name, p, ins[0], out_dtype, out_shape, eqn)]
        if name == "select_and_scatter_add":
            return [self._select_and_scatter_add(name, p, ins, out_dtype, eqn)]
        return None

    # -- shared: strided windows ---------------------------------------------------------------

    @staticmethod
    def _tiles(window, strides, dilation, counts):
        """Whether the windows tile their operand (stride = window, undilated): each element in
        at most one window, so the operand is viewed as windows rather than sliced per stride."""
        return all(int(w) == int(s) and int(d) == 1 for w, s, d in zip(window, strides, dilation)) and all(counts)

    def _tiled_view(self, x, window, counts):
        """x's first counts * window elements per dim viewed as [c0, w0, c1, w1, ...]: window
        position w of window i along dim d is element (i, w) of the pair."""
        need = [int(c) * int(w) for c, w in zip(counts, window)]
        if need != list(x.shape):
            x = self._slice_strided(x, [0] * len(need), need, [1] * len(need))
        return self._reshape(x, [v for c, w in zip(counts, window) for v in (int(c), int(w))])

    def _window_slices(self, x, window, strides, dilation, counts):
        """Per window position (row-major), x's elements that position meets in each of `counts`
        windows: x[w * dilation : ... : strides] along every dim (a slice of the tiled view when
        the windows tile)."""
        out = []
        if self._tiles(window, strides, dilation, counts):
            view = self._tiled_view(x, window, counts)
            for w in _positions(window):
                starts = [v for wi in w for v in (0, wi)]
                limits = [v for c, wi in zip(counts, w) for v in (int(c), wi + 1)]
                part = _V(self.emit(G.SLICE, [view], dims=starts, shape=limits),
                          tuple(hi - lo for lo, hi in zip(starts, limits)), view.dtype, view.store)
                out.append(self._reshape(part, tuple(int(c) for c in counts)))
            return out
        for w in _positions(window):
            starts = [wi * di for wi, di in zip(w, dilation)]
            limits = [st + (n - 1) * s + 1 if n else st for st, n, s in zip(starts, counts, strides)]
            out.append(self._slice_strided(x, starts, limits, strides))
        return out

    def _check_positions(self, name, eqn, window):
        """Refuses a window of more than _MAX_POSITIONS positions, each of which would be an op."""
        if int(np.prod(window)) > _MAX_POSITIONS:
            self._unsupported(name, eqn, f"a window of {int(np.prod(window))} positions {tuple(window)} that does "
                              f"not tile its operand (at most {_MAX_POSITIONS}: each is a slice on the cluster)")

    def _padded(self, x, value, padding, interior):
        config = [(int(lo), int(hi), int(i) - 1) for (lo, hi), i in zip(padding, interior)]
        if all(c == (0, 0, 0) for c in config):
            return x
        return self._pad("pad", None, x, value, config, x.dtype)

    # -- window reductions ---------------------------------------------------------------------

    def _reduce_window(self, name, p, x, out_dtype, out_shape, eqn):
        """lax.reduce_window_{sum,max,min}: the operand padded with the reduction's identity
        (base dilation's holes too), then the strided slices of each window position combined
        (max / min propagate NaN, as XLA's). An int32 / uint32 operand stays in its integers (a
        sum wraps; through f32 a value past 2**24 would round)."""
        fn = name.rsplit("_", 1)[1]
        integral = x.store in (I32, U32) and x.dtype in (np.int32, np.uint32)
        if integral:
            info = np.iinfo(x.dtype)
            identity = self.int_scalar({"sum": 0, "max": info.min, "min": info.max}[fn], x.dtype)
        else:
            if x.store not in (F32, BF16):
                x = self.f32(x)
            identity = self.scalar({"sum": 0.0, "max": float("-inf"), "min": float("inf")}[fn])
        x = self._padded(x, identity, p["padding"], p["base_dilation"])
        window, strides, dilation = p["window_dimensions"], p["window_strides"], p["window_dilation"]
        if self._tiles(window, strides, dilation, out_shape) and int(np.prod(window)) > _SLICED_WINDOW:
            # a large tiling window (a global pooling): one REDUCE over the view's window dims
            view = self._tiled_view(x, window, out_shape)
            # min(x) = -max(-x); of integers ~max(~x), which cannot overflow
            flip = self.bitwise_not if integral else (lambda v: self.unary("neg", v))
            if fn == "min":
                view = flip(view)
            vid = self.emit(G.REDUCE, [view], fn="sum" if fn == "sum" else "max",
                            dims=list(range(1, 2 * len(window), 2)))
            acc = _V(vid, tuple(out_shape), view.dtype, view.store)
            acc = flip(acc) if fn == "min" else acc
            return _V(acc.id, tuple(out_shape), out_dtype, acc.store)
        self._check_positions(name, eqn, window)
        slices = self._window_slices(x, window, strides, dilation, out_shape)
        acc = slices[0]
        for s in slices[1:]:
            acc = self.binary({"sum": "add"}.get(fn, fn), acc, s)
        return _V(acc.id, tuple(out_shape), out_dtype, acc.store)

    def _select_and_scatter_add(self, name, p, ins, out_dtype, eqn):
        """Max (min) pooling's gradient, as XLA's SelectAndScatter with `ge` (`le`): in each window
        of the padded operand the first position (row-major) holding the window's max (min) gets
        the window's source value; values landing on one element add up."""
        source, operand = ins
        select = getattr(p["select_prim"], "name", str(p["select_prim"]))
        if select not in ("ge", "le"):
            self._unsupported(name, eqn, f"select_prim {select} (ge and le are supported)")
        source, operand = self.f32(source), self.f32(operand)
        window, strides, padding = p["window_dimensions"], p["window_strides"], p["padding"]
        self._check_positions(name, eqn, window)
        ones = [1] * len(operand.shape)
        fill = self.scalar(float("-inf") if select == "ge" else float("inf"))
        padded = self._padded(operand, fill, padding, ones)
        slices = self._window_slices(padded, window, strides, ones, source.shape)
        best = slices[0]
        for s in slices[1:]:
            best = self.binary("max" if select == "ge" else "min", best, s)
        tiles = self._tiles(window, strides, ones, source.shape)
        taken, total, parts = None, None, []
        for w, s in zip(_positions(window), slices):
            hit = self.binary("eq", s, best)
            if taken is not None:
                hit = self.binary("mul", hit, self.binary("sub", self.scalar(1.0), taken))
            taken = hit if taken is None else self.binary("add", taken, hit)
            part = self.binary("mul", source, hit)
            if tiles:  # placed below, all at once
                parts.append(self._reshape(part, (1,) + tuple(source.shape)))
                continue
            # back to the padded operand's positions w + stride * i
            config = []
            for d, (wi, st, n) in enumerate(zip(w, strides, source.shape)):
                used = wi + (n - 1) * int(st) + 1 if n else wi
                config.append((int(wi), padded.shape[d] - used, int(st) - 1))
            part = self._pad(name, None, part, self.scalar(0.0), config, np.float32)
            total = part if total is None else self.binary("add", total, part)
        if tiles:  # [k, c...] -> [w..., c...] -> [c0, w0, c1, w1, ...] -> the padded operand's shape
            r = len(window)
            stacked = self._reshape(parts[0] if len(parts) == 1 else self._joined(parts, 0),
                                    tuple(int(w) for w in window) + tuple(source.shape))
            view = self._transposed(stacked, [v for d in range(r) for v in (r + d, d)])
            total = self._reshape(view, tuple(int(c) * int(w) for c, w in zip(source.shape, window)))
            rest = [(0, padded.shape[d] - total.shape[d], 0) for d in range(r)]
            if any(hi for _, hi, _ in rest):
                total = self._pad(name, None, total, self.scalar(0.0), rest, np.float32)
        lo = [int(a) for a, _ in padding]
        total = self._slice_strided(total, lo, [a + n for a, n in zip(lo, operand.shape)], ones)
        return _V(total.id, operand.shape, out_dtype, total.store)

    # -- convolutions --------------------------------------------------------------------------

    def _conv(self, name, p, ins, out_dtype, out_shape, eqn):
        """lax.conv_general_dilated: both operands transposed to [batch, spatial..., feature] and
        [spatial..., in feature, out feature], each feature group (batch group) computed by
        _conv_group and the groups concatenated along the output feature, the result transposed
        to out_spec's layout. An integer convolution is refused (meshrun's GEMMs are f32 / bf16)."""
        lhs, rhs = ins
        if np.dtype(out_dtype).kind in "iub":
            self._unsupported(name, eqn, f"an integer ({np.dtype(out_dtype)}) convolution; convert the operands "
                              "to float32 first")
        lspec, rspec, ospec = p["dimension_numbers"]
        k = len(lspec) - 2
        if lhs.store not in (F32, BF16) or rhs.store != lhs.store:
            lhs, rhs = self.f32(lhs), self.f32(rhs)
        lhs = self._transposed(lhs, [lspec[0]] + list(lspec[2:]) + [lspec[1]])
        rhs = self._transposed(rhs, list(rspec[2:]) + [rspec[1], rspec[0]])
        fgc, bgc = int(p["feature_group_count"]), int(p["batch_group_count"])
        n, cin, cout = lhs.shape[0], lhs.shape[-1], rhs.shape[-1]
        groups, parts = max(fgc, bgc), []
        for g in range(groups):
            lo_in = [0] * (k + 2)
            hi_in = list(lhs.shape)
            if fgc > 1:  # feature group g: the lhs's g-th block of features
                lo_in[-1], hi_in[-1] = g * (cin // fgc), (g + 1) * (cin // fgc)
            if bgc > 1:  # batch group g: the lhs's g-th block of the batch
                lo_in[0], hi_in[0] = g * (n // bgc), (g + 1) * (n // bgc)
            lo_k, hi_k = [0] * (k + 2), list(rhs.shape)
            lo_k[-1], hi_k[-1] = g * (cout // groups), (g + 1) * (cout // groups)
            part_lhs = self._slice_strided(lhs, lo_in, hi_in, [1] * (k + 2))
            part_rhs = self._slice_strided(rhs, lo_k, hi_k, [1] * (k + 2))
            parts.append(self._conv_group(part_lhs, part_rhs, p, eqn))
        out = parts[0] if len(parts) == 1 else self._joined(parts, k + 1)
        # ours is [batch, spatial..., feature]; out_spec names where each goes
        ours = {ospec[0]: 0, ospec[1]: k + 1, **{ospec[2 + i]: 1 + i for i in range(k)}}
        out = self._transposed(out, [ours[d] for d in range(k + 2)])
        return self._gemm_result(out, out_dtype, out_shape)

    def _conv_group(self, lhs, rhs, p, eqn):
        """One group: lhs [n, s..., c] (padded, lhs-dilated here), rhs [k..., c, o] -> [n, o_s..., o].
        Per kernel position a strided slice [n, o_s..., c] of the padded lhs; when the kernel has
        no more positions than the output, the slices are concatenated along c and contracted with
        rhs viewed as [k... * c, o] in one GEMM, else per output position the window [n, k..., c]
        is contracted with rhs over (k..., c) and the results stacked."""
        k = len(lhs.shape) - 2
        window = rhs.shape[:k]
        strides, rdil = [int(s) for s in p["window_strides"]], [int(d) for d in p["rhs_dilation"]]
        zero = self.scalar(0.0)
        lhs = self._padded(lhs, zero, [(0, 0)] + list(p["padding"]) + [(0, 0)],
                           [1] + list(p["lhs_dilation"]) + [1])
        spatial = [max(0, (lhs.shape[1 + i] - (window[i] - 1) * rdil[i] - 1) // strides[i] + 1) for i in range(k)]
        n, c, o = lhs.shape[0], lhs.shape[-1], rhs.shape[-1]
        self._check_positions("conv_general_dilated", eqn, window if int(np.prod(window)) <= int(np.prod(spatial))
                              else spatial)
        if int(np.prod(window)) <= int(np.prod(spatial)):
            slices = self._window_slices(lhs, [1] + list(window) + [1], [1] + strides + [1],
                                         [1] + rdil + [1], [n] + spatial + [c])
            cols = slices[0] if len(slices) == 1 else self._joined(slices, k + 1)
            kernel = self._reshape(rhs, (int(np.prod(window)) * c, o))
            if cols.store != kernel.store:  # (a bf16 operand padded with an f32 zero)
                cols, kernel = self.f32(cols), self.f32(kernel)
            vid = self.emit(G.DOT_GENERAL, [cols, kernel], lhs_contracting=[k + 1], rhs_contracting=[0])
            return _V(vid, (n, *spatial, o), lhs.dtype, lhs.store)
        rows = []
        for pos in _positions(spatial):
            starts = [0] + [pi * si for pi, si in zip(pos, strides)] + [0]
            limits = [n] + [st + (w - 1) * d + 1 for st, w, d in zip(starts[1:], window, rdil)] + [c]
            region = self._slice_strided(lhs, starts, limits, [1] + rdil + [1])
            if region.store != rhs.store:
                region, rhs = self.f32(region), self.f32(rhs)
            vid = self.emit(G.DOT_GENERAL, [region, rhs], lhs_contracting=list(range(1, k + 2)),
                            rhs_contracting=list(range(k + 1)))
            rows.append(self._reshape(_V(vid, (n, o), lhs.dtype, lhs.store), (n, 1, o)))
        out = rows[0] if len(rows) == 1 else self._joined(rows, 1)
        return self._reshape(out, (n, *spatial, o))


# A tiling window of more positions than this is reduced by one REDUCE over a view, not sliced.
_SLICED_WINDOW = 16
# The most window (or output) positions a lowering slices one by one.
_MAX_POSITIONS = 4096
