"""jnp.linalg.qr on the cluster (Householder reflections, as LAPACK computes them) equals JAX's,
signs included, so orthogonal initialisers (Flax's LSTMCell's recurrent kernels) initialise on
the cluster as jax.jit initialises them."""
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
