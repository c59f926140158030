"""Convolutions and pooling under cluster.jit (meshrun._convert_windows) match JAX's: the
primitives on their own for each kind of padding, stride, dilation and group, their gradients,
and a Flax CNN trained with Adam."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxcompare import compare, emulated_mesh

CONVS = [
    # (lhs shape, rhs shape, lax.conv_general_dilated keywords)
    ((4, 9, 9, 2), (3, 3, 2, 4), dict(window_strides=(2, 2), padding="SAME")),
    ((4, 2, 9, 7), (4, 2, 3, 2), dict(window_strides=(1, 2), padding=((1, 0), (2, 1)), rhs_dilation=(2, 1),
                                      dimension_numbers=("NCHW", "OIHW", "NCHW"))),
    ((4, 9, 9, 4), (3, 3, 2, 6), dict(window_strides=(1, 1), padding="VALID", feature_group_count=2)),
    ((4, 5, 5, 2), (3, 3, 2, 4), dict(window_strides=(1, 1), padding=((2, 2), (1, 1)), lhs_dilation=(2, 2))),
    ((4, 6, 6, 2), (3, 3, 2, 4), dict(window_strides=(1, 1), padding="VALID", batch_group_count=2)),
    ((4, 12, 3), (5, 3, 4), dict(window_strides=(3,), padding="SAME", dimension_numbers=("NWC", "WIO", "NWC"))),
    ((4, 12, 3), (5, 3, 4), dict(window_strides=(3,), padding=((-1, 2),), dimension_numbers=("NWC", "WIO", "NWC"))),
    # windows that tile the image (a ViT's patches; with a remainder left out): viewed, not sliced
    ((4, 8, 8, 3), (4, 4, 3, 5), dict(window_strides=(4, 4), padding="VALID")),
    ((4, 9, 10, 2), (2, 3, 2, 3), dict(window_strides=(2, 3), padding="VALID")),
    # a window larger than the output (as a kernel gradient's): one product per output position
    ((4, 7, 7, 2), (7, 7, 2, 3), dict(window_strides=(1, 1), padding=((1, 1), (1, 0)))),
]


@pytest.mark.parametrize("lhs_shape,rhs_shape,kw", CONVS)
def test_conv_general_dilated_and_its_gradients_match_jax(cluster, lhs_shape, rhs_shape, kw):
    kw = dict(kw)
    kw.setdefault("dimension_numbers", ("NHWC", "HWIO", "NHWC"))
    rng = np.random.default_rng(len(lhs_shape) * 10 + rhs_shape[0])
    x = rng.normal(size=lhs_shape).astype(np.float32)
    w = rng.normal(size=rhs_shape).astype(np.float32)

    def f(x, w):
        y = lax.conv_general_dilated(x, w, **kw)
        # the gradients are convolutions too: the input's with lhs_dilation where strided,
        # the kernel's with the output as its window
        return y, jax.grad(lambda x, w: jnp.sum(jnp.sin(lax.conv_general_dilated(x, w, **kw))), (0, 1))(x, w)

    want = jax.jit(f)(x, w)
    got = cluster.jit(f, in_shardings=(P("data"), P()), out_shardings=P())(
        cluster.device_put(x, P("data")), cluster.device_put(w, P()))
    for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        r = np.asarray(r)
        assert np.asarray(g).shape == r.shape
        np.testing.assert_allclose(np.asarray(g), r, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(r).max())))


def test_an_integer_convolution_is_refused_by_name(cluster):
    x = np.ones((2, 4, 4, 1), np.int32)
    w = np.ones((2, 2, 1, 1), np.int32)
    f = cluster.jit(lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "VALID",
                                                          dimension_numbers=("NHWC", "HWIO", "NHWC")))
    with pytest.raises(Exception, match=r"conv_general_dilated.*integer \(int32\) convolution"):
        f(cluster.device_put(x, P()), cluster.device_put(w, P()))


def test_window_reductions_and_max_pooling_gradient_with_ties_match_jax(cluster):
    def pools(x):
        return (lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME"),
                lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1), (1, 1, 2, 1), ((0, 0), (1, 1), (0, 1), (0, 0))),
                lax.reduce_window(x, jnp.inf, lax.min, (1, 2, 2, 1), (1, 1, 1, 1), "VALID",
                                  window_dilation=(1, 2, 1, 1)),
                lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1), (1, 1, 1, 1), "VALID", base_dilation=(1, 2, 1, 1)),
                # tiling windows (slices of a view), with a remainder left out
                nn.avg_pool(x, (2, 2), (2, 2)),
                lax.reduce_window(x, jnp.inf, lax.min, (1, 3, 1, 1), (1, 3, 1, 1), "VALID"),
                lax.reduce_window(x, -jnp.inf, lax.max, (2, 1, 2, 1), (2, 1, 2, 1), ((0, 0), (0, 0), (1, 0), (0, 0))),
                # max pooling's gradient (select_and_scatter_add): the first max of a window takes it
                jax.grad(lambda x: jnp.sum(nn.max_pool(x, (2, 2), (2, 2), padding="SAME") ** 2))(x),
                jax.grad(lambda x: jnp.sum(jnp.cos(nn.max_pool(x, (3, 3), (1, 2)))))(x),
                jax.grad(lambda x: jnp.sum(jnp.sin(nn.max_pool(x, (3, 2), (3, 2)))))(x),
                jax.grad(lambda x: jnp.sum(lax.reduce_window(x, jnp.inf, lax.min, (1, 2, 2, 1), (1, 2, 1, 1),
                                                             "SAME") ** 2))(x),
                jax.grad(lambda x: jnp.sum(nn.avg_pool(x, (3, 2), (2, 2), padding="SAME") ** 3))(x))

    # rounded to one decimal: many windows hold their max twice
    x = np.round(np.random.default_rng(7).normal(size=(4, 7, 7, 3)), 1).astype(np.float32)
    want = jax.jit(pools)(x)
    got = cluster.jit(pools, in_shardings=P("data"), out_shardings=P())(cluster.device_put(x, P("data")))
    for g, r in zip(got, want):
        assert np.asarray(g).shape == np.asarray(r).shape
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6, atol=1e-6)


class CNN(nn.Module):
    """A Fashion-MNIST-style CNN: the first convolution's output features over 'model'."""

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(8, (3, 3), kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(),
                                                                (None, None, None, "model")))(x)
        x = nn.max_pool(nn.relu(x), (2, 2), (2, 2))
        x = nn.Conv(8, (3, 3), strides=2, padding="VALID")(x)
        x = nn.avg_pool(nn.gelu(x), (2, 2), (1, 1))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


def test_integer_window_reductions_stay_in_their_integers_as_jaxs(cluster):
    """reduce_window max / min / sum of int32 and uint32 values, sliding (with padding) and as one
    tiling reduction: equal to jax.jit's, past 2**24 and at the dtype's bounds too (through f32,
    16777217 would round to 16777216; a sum wraps as XLA's)."""
    rng = np.random.default_rng(0)
    ints = rng.integers(-2**31, 2**31 - 1, (2, 8, 40), dtype=np.int64).astype(np.int32)
    ints[0, 0, :4] = [16777217, 16777216, 16777219, 3]
    uints = rng.integers(0, 2**32 - 1, (2, 8, 40), dtype=np.uint64).astype(np.uint32)

    def pools(x):
        lo, hi, t = np.iinfo(x.dtype).min, np.iinfo(x.dtype).max, x.dtype.type
        return (lax.reduce_window(x, t(lo), lax.max, (1, 2, 2), (1, 2, 2), "VALID"),
                lax.reduce_window(x, t(hi), lax.min, (1, 3, 1), (1, 1, 1), ((0, 0), (1, 1), (0, 0))),
                lax.reduce_window(x, t(0), lax.add, (1, 2, 3), (1, 2, 3), "VALID"),
                lax.reduce_window(x, t(lo), lax.max, (1, 8, 40), (1, 8, 40), "VALID"),
                lax.reduce_window(x, t(hi), lax.min, (1, 8, 40), (1, 8, 40), "VALID"),
                lax.reduce_window(x, t(0), lax.add, (1, 8, 20), (1, 8, 20), "VALID"))

    for x in (ints, uints):
        want = jax.jit(pools)(x)
        got = cluster.jit(pools, in_shardings=P("data"))(cluster.device_put(x, P("data")))
        for i, (g, w) in enumerate(zip(got, want)):
            assert np.asarray(g).dtype == w.dtype, (x.dtype, i)
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{x.dtype} pool {i}")


def test_a_cnn_with_max_and_avg_pooling_trains_as_under_jax(cluster):
    mesh = emulated_mesh()
    model, tx = CNN(), optax.adam(1e-2)
    rng = np.random.default_rng(3)
    data = [(rng.random((16, 14, 14, 1), np.float32), rng.normal(size=(16, 10)).astype(np.float32))
            for _ in range(20)]
    with jax.set_mesh(mesh):
        boxed = model.init(jax.random.PRNGKey(0), data[0][0])["params"]
    param_spec = nn.get_partition_spec(boxed)
    params = jax.tree_util.tree_map(np.asarray, nn.unbox(boxed))
    opt_state = jax.tree_util.tree_map(np.asarray, tx.init(params))
    opt_spec = optax.tree_map_params(tx, lambda _, s: s, opt_state, param_spec,
                                     transform_non_params=lambda *_: P(), is_leaf=lambda x: isinstance(x, P))

    def step(state, x, y):
        params, opt_state = state
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(optax.l2_loss(model.apply({"params": p}, x), y)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    compare(cluster, step, (params, opt_state), (param_spec, opt_spec), data, mesh)


def test_a_global_pooling_window_is_one_reduction_and_a_huge_sliding_window_is_refused(cluster):
    x = np.random.default_rng(9).normal(size=(4, 8, 8, 3)).astype(np.float32)
    x[1, 2, 3, 0] = np.nan  # max propagates it, as XLA's

    def pools(x):
        return (nn.avg_pool(x, (8, 8), (8, 8)), lax.reduce_window(x, -jnp.inf, lax.max, (1, 8, 8, 1), (1, 8, 8, 1), "VALID"),
                lax.reduce_window(x, jnp.inf, lax.min, (1, 4, 8, 1), (1, 4, 8, 1), "VALID"),
                jax.grad(lambda x: jnp.sum(nn.avg_pool(x, (8, 8), (8, 8)) ** 2))(x))

    want = jax.jit(pools)(x)
    got = cluster.jit(pools, in_shardings=P("data"), out_shardings=P())(cluster.device_put(x, P("data")))
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6, atol=1e-6)
    big = cluster.jit(lambda x: lax.reduce_window(x, 0.0, lax.add, (80, 80), (1, 1), "VALID"))
    with pytest.raises(Exception, match=r"reduce_window_sum.*a window of 6400 positions \(80, 80\)"):
        big(cluster.device_put(np.ones((96, 96), np.float32), P()))
