"""jnp.linalg.qr, cholesky, triangular solves and LU on the cluster (as LAPACK's unblocked
routines compute them) equal JAX's, signs and pivots included, so orthogonal initialisers (Flax's
LSTMCell's recurrent kernels) initialise on the cluster as jax.jit initialises them, and
cho_solve, solve_triangular, multivariate_normal, solve, inv, det and slogdet run."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshrun import errors


@pytest.mark.parametrize("shape", [(6, 4), (4, 6), (5, 5), (48, 32), (1, 3), (3, 1)])
def test_qr_equals_jaxs(cluster, shape):
    a = np.random.default_rng(sum(shape)).normal(size=shape).astype(np.float32)
    for mode in ("reduced", "complete"):
        f = lambda a: jnp.linalg.qr(a, mode=mode)  # noqa: E731
        got, want = cluster.jit(f)(cluster.device_put(a, P())), jax.jit(f)(a)
        for g, w in zip(got, want):
            assert g.shape == w.shape, (mode, g.shape, w.shape)
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=5e-6)


def test_a_column_already_zero_below_the_diagonal_is_left_as_lapack_leaves_it(cluster):
    # Column 0: nothing to zero below a negative pivot (tau 0); the matrix has full rank.
    a = np.array([[-2.0, 0.5, 1.0], [0.0, 1.0, -1.0], [0.0, 2.0, 0.5], [0.0, 0.0, 3.0]], np.float32)
    got, want = cluster.jit(jnp.linalg.qr)(cluster.device_put(a, P())), jax.jit(jnp.linalg.qr)(a)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-6)


def test_an_lstm_initialised_on_the_cluster_equals_jaxs_init(cluster):
    model = nn.RNN(nn.LSTMCell(16))  # recurrent kernels: jax.nn.initializers.orthogonal()
    x = np.ones((8, 5, 4), np.float32)
    init = lambda key: model.init(key, x)  # noqa: E731
    got, want = cluster.jit(init)(jax.random.key(0)), jax.jit(init)(jax.random.key(0))
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-6)


def test_a_batch_of_matrices_is_refused_by_name(cluster):
    with pytest.raises(errors.UnsupportedPrimitiveError, match=r"'qr' .*a batch of matrices \(2, 3, 3\)"):
        cluster.jit(jnp.linalg.qr)(cluster.device_put(np.ones((2, 3, 3), np.float32), P()))


def spd(n, seed):
    a = np.random.default_rng(seed).normal(size=(n, n)).astype(np.float32)
    return (a @ a.T + n * np.eye(n)).astype(np.float32), a


def test_cholesky_and_triangular_solves_equal_jaxs(cluster):
    import jax.scipy.linalg as jsl

    s, a = spd(6, 1)
    b = np.random.default_rng(2).normal(size=(6, 3)).astype(np.float32)

    def f(s, a, b):
        solves = [jsl.solve_triangular(s, b, lower=lo, trans=tr, unit_diagonal=u)
                  for lo in (True, False) for tr in (0, 1) for u in (False, True)]
        right = [jax.lax.linalg.triangular_solve(s, b.T, left_side=False, lower=lo, transpose_a=tr)
                 for lo in (True, False) for tr in (False, True)]
        # the GP marginal likelihood's terms and their gradient (the factor's JVP solves too)
        nll = lambda s: (jsl.cho_solve((jnp.linalg.cholesky(s), True), b) ** 2).sum() + 2 * jnp.log(  # noqa: E731
            jnp.diag(jnp.linalg.cholesky(s))).sum()
        return jnp.linalg.cholesky(s), jnp.linalg.cholesky(a), solves, right, jax.grad(nll)(s)

    got, want = cluster.jit(f)(s, a, b), jax.jit(f)(s, a, b)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=2e-6)
    # not positive definite: NaN throughout the factor (jnp.linalg.cholesky zeroes above it), as JAX's
    assert np.isnan(np.asarray(got[1])[np.tril_indices(6)]).all()


def test_multivariate_normal_draws_equal_jaxs(cluster):
    s, _ = spd(5, 3)
    f = lambda key: jax.random.multivariate_normal(key, jnp.arange(5.0), jnp.asarray(s), (16,))  # noqa: E731
    np.testing.assert_allclose(np.asarray(cluster.jit(f)(jax.random.key(4))), np.asarray(jax.jit(f)(jax.random.key(4))),
                               rtol=1e-5, atol=2e-6)


def test_lu_solve_inv_det_and_their_gradients_equal_jaxs(cluster):
    rng = np.random.default_rng(5)
    a = rng.normal(size=(6, 6)).astype(np.float32)
    b = rng.normal(size=(6, 3)).astype(np.float32)
    wide = rng.normal(size=(5, 7)).astype(np.float32)
    singular = a.copy()
    singular[:, 2] = 0.0  # a zero pivot: its column is left unscaled, as LAPACK leaves it

    def f(a, b, wide, singular):
        return (jax.lax.linalg.lu(a), jax.lax.linalg.lu(wide), jax.lax.linalg.lu(wide.T), jax.lax.linalg.lu(singular),
                jnp.linalg.solve(a, b), jnp.linalg.solve(a, b[:, 0]), jnp.linalg.inv(a), jnp.linalg.det(a),
                jnp.linalg.slogdet(a), jnp.linalg.det(singular),
                jax.grad(lambda a: (jnp.linalg.solve(a, b) ** 2).sum())(a), jax.grad(lambda a: jnp.linalg.slogdet(a)[1])(a))

    got, want = cluster.jit(f)(a, b, wide, singular), jax.jit(f)(a, b, wide, singular)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
        if w.dtype.kind == "i":  # pivots and permutations: the same rows chosen
            np.testing.assert_array_equal(g, w)
        else:
            np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)
