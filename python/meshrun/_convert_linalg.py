"""Linear algebra in meshrun._convert, from the program's ops (SLICE, DOT_GENERAL, element-wise
ops and SELECTs), one column or row at a time, as LAPACK's unblocked routines compute it:
  - jnp.linalg.qr (the `qr` primitive), which jax.nn.initializers.orthogonal calls, so Flax's
    LSTMCell / GRUCell (whose recurrent kernels are orthogonal by default) and orthogonally
    initialised policies initialise on the cluster;
  - jnp.linalg.cholesky (`cholesky`, spotf2: the lower factor; all NaN for a matrix that is not
    positive definite, as JAX returns it) and `triangular_solve` (forward or back substitution,
    strsm's cases), so jax.scipy.linalg.cho_solve / solve_triangular and
    jax.random.multivariate_normal run;
  - `lu` (sgetf2: partial pivoting, the first row holding the column's largest magnitude), and
    `custom_linear_solve` (its solve body inlined), so jnp.linalg.solve, inv, det and slogdet run.
Each takes one matrix (f32; bf16 computed in f32); a batch of matrices is refused by name.

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

from meshrun._ir import F32, G, I32, _V

SUPPORTED_LINALG = {
    "qr": "Householder reflections as LAPACK's sgeqr2 / sorg2r, from SLICE, DOT_GENERAL, element-wise ops and "
          "SELECTs (one [m, n] matrix, f32; about 20 ops per column)",
    "cholesky": "column by column as LAPACK's spotf2 (one [n, n] matrix; all NaN unless positive definite)",
    "triangular_solve": "forward or back substitution, a row (or column) at a time (one [m, m] matrix)",
    "lu": "Gaussian elimination with partial pivoting as LAPACK's sgetf2 (one [m, n] matrix): row swaps as SELECTs",
    "custom_linear_solve": "its solve body inlined (jnp.linalg.solve)",
}


class _Linalg:
    """Converter's linear algebra (a mixin: uses its emit, binary, unary, scalar, f32, broadcast,
    _select, _convert, _reshape, _transposed, _joined, _iota, upload and _unsupported)."""

    def _linalg_equation(self, name, p, ins, eqn):
        """The outputs of a linear-algebra primitive; None for another primitive."""
        if name == "cholesky":
            a = ins[0]
            if len(a.shape) != 2 or a.shape[0] != a.shape[1]:
                self._unsupported(name, eqn, f"an operand of shape {a.shape}; expected one [n, n] matrix")
            return [self._convert(name, eqn, self._cholesky(self.f32(a)), a.dtype)]
        if name == "triangular_solve":
            return [self._triangular_solve(name, p, ins, eqn)]
        if name == "lu":
            return self._lu(name, ins[0], eqn)
        if name == "custom_linear_solve":  # as JAX's impl: the solve jaxpr on its consts and b
            lengths = list(p["const_lengths"])
            start = sum(lengths[:2])
            solve = p["jaxprs"].solve
            operands = list(ins[start:start + lengths[2]]) + list(ins[sum(lengths):])
            return self.run(solve.jaxpr, list(solve.consts), operands)
        if name != "qr":
            return None
        if p.get("pivoting"):
            self._unsupported(name, eqn, "pivoting=True (column-pivoted QR)")
        a = ins[0]
        if len(a.shape) != 2:
            self._unsupported(name, eqn, f"a batch of matrices {a.shape}; expected one [m, n] matrix")
        q, r = self._householder_qr(eqn, self.f32(a), bool(p.get("full_matrices", True)))
        return [self._convert(name, eqn, x, a.dtype) for x in (q, r)]

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
            xnorm = self.unary("sqrt", self._reduce("sum", self.binary("mul", x, x)))
            squares = self.binary("add", self.binary("mul", alpha, alpha), self.binary("mul", xnorm, xnorm))
            h = self.unary("sqrt", squares)
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
            spread = self.broadcast(fixed, (m, n), [0])
            r = self._select("qr", eqn, [self.binary("eq", cols, self.scalar(j)), r, spread], np.float32)
            reflectors.append((v, tau))
        width = m if full else k
        q = self.upload(np.eye(m, width, dtype=np.float32))
        for v, tau in reversed(reflectors):
            q = self._reflect(q, v, tau)
        return q, (r if full else self._cut(r, [0, 0], [k, n]))

    def _cholesky(self, a):
        """The lower Cholesky factor of a (its lower triangle read): column j is
        (a[:, j] - L L[j, :]^T) / sqrt of its diagonal entry, below the diagonal; zeros above. A
        pivot that is not positive makes every entry NaN (JAX's result for LAPACK's info > 0)."""
        n = a.shape[0]
        rows, cols = self._iota((n,), 0), self._iota((n, n), 1)
        zero = self.scalar(0.0)
        low = self.broadcast(zero, (n, n), [])
        ok = None
        for j in range(n):
            row = self._reshape(self._cut(low, [j, 0], [j + 1, n]), (n,))
            done = self._contract(low, 1, row)
            c = self.binary("sub", self._reshape(self._cut(a, [0, j], [n, j + 1]), (n,)), done)
            pivot = self._reshape(self._cut(c, [j], [j + 1]), ())
            good = self.binary("gt", pivot, zero)  # (NaN is not)
            ok = good if ok is None else self.binary("mul", ok, good)
            d = self.unary("sqrt", pivot)
            at_j, below_j = self.binary("eq", rows, self.scalar(j)), self.binary("gt", rows, self.scalar(j))
            col = self._select("cholesky", None, [at_j, self._select("cholesky", None, [below_j, zero,
                                                                                          self.binary("div", c, d)],
                                                                      np.float32), d], np.float32)
            spread = self.broadcast(col, (n, n), [0])
            low = self._select("cholesky", None, [self.binary("eq", cols, self.scalar(j)), low, spread], np.float32)
        return self._select("cholesky", None, [ok, self.scalar(float("nan")), low], np.float32)

    def _triangular_solve(self, name, p, ins, eqn):
        """x with op(a) x = b (left_side) or x op(a) = b, op(a) = a or a^T, a's `lower` or upper
        triangle read (its diagonal taken as ones with unit_diagonal): substitution one row of x
        at a time, each from the rows already solved (strsm's)."""
        a, b = ins
        if len(b.shape) != 2:
            self._unsupported(name, eqn, f"a right-hand side of shape {b.shape}; expected one matrix")
        if len(a.shape) != 2 or a.shape[0] != a.shape[1]:
            self._unsupported(name, eqn, f"a of shape {a.shape}; expected one [m, m] matrix")
        t = self.f32(a)
        lower, left = bool(p["lower"]), bool(p["left_side"])
        if p["transpose_a"]:  # op(a) = a^T: the other triangle of a matrix read transposed
            t, lower = self._transposed(t, [1, 0]), not lower
        rhs = self.f32(b)
        if not left:  # x t = b  <=>  t^T x^T = b^T
            t, lower, rhs = self._transposed(t, [1, 0]), not lower, self._transposed(rhs, [1, 0])
        m, n = rhs.shape
        if t.shape[0] != m:
            self._unsupported(name, eqn, f"a of shape {a.shape} against b of shape {b.shape}")
        rows, row_of = self._iota((m,), 0), self._iota((m, n), 0)
        zero = self.scalar(0.0)
        x = self.broadcast(zero, (m, n), [])
        for i in (range(m) if lower else range(m - 1, -1, -1)):
            row = self._reshape(self._cut(t, [i, 0], [i + 1, m]), (m,))
            solved = self.binary("lt" if lower else "gt", rows, self.scalar(i))
            coef = self._select(name, eqn, [solved, zero, row], np.float32)
            known = self._contract(coef, 0, x)
            xi = self.binary("sub", self._reshape(self._cut(rhs, [i, 0], [i + 1, n]), (n,)), known)
            if not p["unit_diagonal"]:
                xi = self.binary("div", xi, self._reshape(self._cut(row, [i], [i + 1]), ()))
            spread = self.broadcast(xi, (m, n), [1])
            x = self._select(name, eqn, [self.binary("eq", row_of, self.scalar(i)), x, spread], np.float32)
        if not left:
            x = self._transposed(x, [1, 0])
        return self._convert(name, eqn, x, b.dtype)

    def _lu(self, name, a, eqn):
        """[lu, pivots, permutation] of a as lax.linalg.lu gives them: for each column j, the first
        row at or below j holding the largest magnitude is swapped into row j (pivots[j], i32),
        the entries below the pivot divided by it (left as they are when it is 0: a singular
        matrix, as sgetf2 leaves it) and the trailing block updated; permutation (i32) is
        where each row of the factored matrix came from."""
        if len(a.shape) != 2:
            self._unsupported(name, eqn, f"a batch of matrices {a.shape}; expected one [m, n] matrix")
        x = self.f32(a)
        m, n = x.shape
        rows, row_of, col_of = self._iota((m,), 0), self._iota((m, n), 0), self._iota((m, n), 1)
        zero = self.scalar(0.0)
        perm, pivots = rows, []
        for j in range(min(m, n)):
            col = self._reshape(self._cut(x, [0, j], [m, j + 1]), (m,))
            above = self.binary("lt", rows, self.scalar(j))
            score = self._select(name, eqn, [above, self.unary("abs", col), self.scalar(-1.0)], np.float32)
            best = self.binary("eq", score, self._reduce("max", score))
            # the first such row: m - max((m - row) where best)
            p = self.binary("sub", self.scalar(m), self._reduce("max", self.binary(
                "mul", best, self.binary("sub", self.scalar(m), rows))))
            pivots.append(p)
            at_p = self.binary("eq", rows, p)
            x = self._swap_rows(x, j, p, at_p, row_of)
            perm = self._swap_rows(perm, j, p, at_p, rows)
            col = self._reshape(self._cut(x, [0, j], [m, j + 1]), (m,))
            pivot = self._reshape(self._cut(col, [j], [j + 1]), ())
            below = self.binary("gt", rows, self.scalar(j))
            scaled = self._select(name, eqn, [self.binary("eq", pivot, zero), self.binary("div", col, pivot), col],
                                  np.float32)
            low = self._select(name, eqn, [below, zero, scaled], np.float32)
            right = self.binary("mul", self._reshape(self._cut(x, [j, 0], [j + 1, n]), (n,)),
                                self.binary("gt", self._iota((n,), 0), self.scalar(j)))
            outer = self.binary(
                "mul", self.broadcast(low, (m, n), [0]),
                self.broadcast(right, (m, n), [1]))
            x = self.binary("sub", x, outer)
            spread = self.broadcast(self._select(name, eqn, [below, col, low], np.float32), (m, n), [0])
            x = self._select(name, eqn, [self.binary("eq", col_of, self.scalar(j)), x, spread], np.float32)
        x = self._convert(name, eqn, x, a.dtype)
        piv = self._joined([self._reshape(v, (1,)) for v in pivots], 0) if len(pivots) > 1 else self._reshape(
            pivots[0], (1,))
        as_i32 = lambda v: _V(self.emit(G.CONVERT, [v], dtype=I32), v.shape, np.int32, I32)  # noqa: E731
        return [x, as_i32(piv), as_i32(perm)]

    def _swap_rows(self, x, j, p, at_p, row_index):
        """x with rows j and p (a scalar value; at_p: rows == p) swapped; x [m] or [m, n]."""
        if len(x.shape) == 1:
            xj = self._reshape(self._cut(x, [j], [j + 1]), ())
            xp = self._reduce("sum", self.binary("mul", x, at_p))
            out = self._select("lu", None, [at_p, x, xj], np.float32)
            return self._select("lu", None, [self.binary("eq", row_index, self.scalar(j)), out, xp], np.float32)
        m, n = x.shape
        xj = self._reshape(self._cut(x, [j, 0], [j + 1, n]), (n,))
        xp = self._contract(at_p, 0, x)
        out = self._select("lu", None, [self.binary("eq", row_index, p), x, self.broadcast(xj, (m, n), [1])],
                           np.float32)
        return self._select("lu", None, [self.binary("eq", row_index, self.scalar(j)), out,
                                         self.broadcast(xp, (m, n), [1])], np.float32)

    def _contract(self, a, a_dim, b):
        """f32 a and b contracted over a's dim a_dim and b's dim 0 (a DOT_GENERAL)."""
        shape = tuple(d for i, d in enumerate(a.shape) if i != a_dim) + tuple(b.shape[1:])
        vid = self.emit(G.DOT_GENERAL, [a, b], lhs_contracting=[a_dim], rhs_contracting=[0])
        return _V(vid, shape, np.float32, F32)

    def _reduce(self, fn, x):
        return _V(self.emit(G.REDUCE, [x], fn=fn, dims=list(range(len(x.shape)))), (), x.dtype, x.store)

    def _reflect(self, x, v, tau):
        """(I - tau v v^T) x for x [m, c], v [m], tau a scalar."""
        m, c = x.shape
        w = self._contract(v, 0, x)
        tv = self.binary("mul", v, tau)
        outer = self.binary(
            "mul", self.broadcast(tv, (m, c), [0]),
            self.broadcast(w, (m, c), [1]))
        return self.binary("sub", x, outer)

    def _cut(self, x, starts, limits):
        return _V(self.emit(G.SLICE, [x], dims=list(starts), shape=list(limits)),
                  tuple(hi - lo for lo, hi in zip(starts, limits)), x.dtype, x.store)
