"""Linear algebra in meshrun._convert: jnp.linalg.qr (the `qr` primitive), which
jax.nn.initializers.orthogonal calls, so Flax's LSTMCell / GRUCell (whose recurrent kernels are
orthogonal by default) and orthogonally initialised policies initialise on the cluster.

QR as LAPACK's unblocked sgeqr2 / sorg2r compute it, from the program's ops: for each column j,
the Householder reflector H_j = I - tau_j v_j v_j^T that zeroes R's column j below the diagonal
(dlarfg's beta = -sign(alpha) * ||x||, tau = (beta - alpha) / beta, v = x / (alpha - beta) with
v[j] = 1; tau = 0 where the column is already zero below the diagonal), applied to R as a
DOT_GENERAL and an outer product, the column set to (beta, 0, ...) exactly; then Q = H_0 ... H_{k-1}
applied to the identity's first columns, last reflector first. Results equal jnp.linalg.qr's to
rounding (the same signs: R's diagonal is beta). f32 (a bf16 matrix is factored in f32); one
[m, n] matrix (a batch of matrices and pivoting=True are refused by name). About 20 ops per column.
"""
import numpy as np

from meshrun._ir import BF16, F32, G, _V

SUPPORTED_LINALG = {
    "qr": "Householder reflections as LAPACK's sgeqr2 / sorg2r, from SLICE, DOT_GENERAL, element-wise ops and "
          "SELECTs (one [m, n] matrix, f32; about 20 ops per column)",
}


class _Linalg:
    """Converter's linear algebra (a mixin: uses its emit, binary, unary, scalar, f32, _select,
    _reshape, _iota, upload and _unsupported)."""

    def _linalg_equation(self, name, p, ins, eqn):
        """The outputs of a linear-algebra primitive; None for another primitive."""
        if name != "qr":
            return None
        if p.get("pivoting"):
            self._unsupported(name, eqn, "pivoting=True (column-pivoted QR)")
        a = ins[0]
        if len(a.shape) != 2:
            self._unsupported(name, eqn, f"a batch of matrices {a.shape}; expected one [m, n] matrix")
        q, r = self._householder_qr(eqn, self.f32(a), bool(p.get("full_matrices", True)))
        if a.store == BF16:
            q, r = [_V(self.emit(G.CONVERT, [x], dtype=BF16), x.shape, a.dtype, BF16) for x in (q, r)]
        return [q, r]

    def _householder_qr(self, eqn, r, full):
        m, n = r.shape
        k = min(m, n)
        rows = self._iota((m,), 0)
        cols = self._iota((m, n), 1)
        zero = self.scalar(0.0)
        reflectors = []
        for j in range(k):
            col = self._reshape(self._cut(r, [0, j], [m, j + 1]), (m,))
            alpha = self._reshape(self._cut(col, [j], [j + 1]), ())
            at_j, below_j = self.binary("eq", rows, self.scalar(j)), self.binary("gt", rows, self.scalar(j))
            x = self.binary("mul", col, below_j)
            xnorm = self.unary("sqrt", self._sum(self.binary("mul", x, x)))
            h = self.unary("sqrt", self.binary("add", self.binary("mul", alpha, alpha), self.binary("mul", xnorm, xnorm)))
            beta = self._select("qr", eqn, [self.binary("ge", alpha, zero), h, self.unary("neg", h)], np.float32)
            # The column already zero below the diagonal: H = I (tau 0), R's column unchanged.
            flat = self.binary("eq", xnorm, zero)
            tau = self._select("qr", eqn, [flat, self.binary("div", self.binary("sub", beta, alpha), beta), zero],
                               np.float32)
            scaled = self.binary("mul", x, self.binary("div", self.scalar(1.0), self.binary("sub", alpha, beta)))
            v = self._select("qr", eqn, [flat, self.binary("add", scaled, at_j), at_j], np.float32)
            beta = self._select("qr", eqn, [flat, beta, alpha], np.float32)
            r = self._reflect(r, v, tau)
            # Column j exactly (beta, then zeros; the rows above it are H's fixed rows).
            fixed = self._select("qr", eqn, [at_j, self._select("qr", eqn, [below_j, col, zero], np.float32), beta],
                                 np.float32)
            spread = _V(self.emit(G.BROADCAST_IN_DIM, [fixed], shape=[m, n], dims=[0]), (m, n), np.float32, F32)
            r = self._select("qr", eqn, [self.binary("eq", cols, self.scalar(j)), r, spread], np.float32)
            reflectors.append((v, tau))
        width = m if full else k
        q = self.upload(np.eye(m, width, dtype=np.float32))
        for v, tau in reversed(reflectors):
            q = self._reflect(q, v, tau)
        return q, (r if full else self._cut(r, [0, 0], [k, n]))

    def _reflect(self, x, v, tau):
        """(I - tau v v^T) x for x [m, c], v [m], tau a scalar."""
        m, c = x.shape
        w = _V(self.emit(G.DOT_GENERAL, [v, x], lhs_contracting=[0], rhs_contracting=[0]), (c,), np.float32, F32)
        tv = self.binary("mul", v, tau)
        outer = self.binary(
            "mul", _V(self.emit(G.BROADCAST_IN_DIM, [tv], shape=[m, c], dims=[0]), (m, c), np.float32, F32),
            _V(self.emit(G.BROADCAST_IN_DIM, [w], shape=[m, c], dims=[1]), (m, c), np.float32, F32))
        return self.binary("sub", x, outer)

    def _cut(self, x, starts, limits):
        return _V(self.emit(G.SLICE, [x], dims=list(starts), shape=list(limits)),
                  tuple(hi - lo for lo, hi in zip(starts, limits)), x.dtype, x.store)

    def _sum(self, x):
        return _V(self.emit(G.REDUCE, [x], fn="sum", dims=list(range(len(x.shape)))), (), x.dtype, x.store)
