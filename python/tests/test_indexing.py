"""Gathers and scatters at index vectors over several dims (x[jnp.arange(n), labels],
jnp.diagonal, jnp.take along any axis, x.at[idx].set, jax.vmap of indexing) and their transposes
under cluster.jit match JAX's bit for bit, out-of-range modes and non-finite values included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P


def test_point_gathers_diagonals_and_their_transposes_match_jax_bit_for_bit(cluster):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 5)).astype(np.float32)
    x[2, 3] = -np.inf  # read only where picked: never NaN in another row's pick
    lab = rng.integers(0, 5, 8).astype(np.int32)
    cube = rng.normal(size=(4, 3, 6)).astype(np.float32)
    ii = np.array([0, 3, 2, 1, 3, 0, 1, 2], np.int32)

    def f(x, lab, cube, ii):
        finite = jnp.where(jnp.isfinite(x), x, 0.0)
        return {
            "pick": x[jnp.arange(8), lab],
            "nll": -jnp.mean(jax.nn.log_softmax(jnp.where(jnp.isfinite(x), x, -1e9))[jnp.arange(8), lab]),
            "grad": jax.grad(lambda x: jnp.sum(x[jnp.arange(8), lab] ** 2))(finite),
            "diagonal": jnp.diagonal(x[:5]),  # (lax.platform_dependent inside: the CPU's branch)
            "rows": cube[ii[:4], ii[4:] % 3],  # two indexed dims and a window over the third
            "fill": x.at[jnp.array([0, 9, -1]), jnp.array([1, 1, 7])].get(mode="fill", fill_value=-5.0),
            "nan_fill": x.at[jnp.array([0, 9]), jnp.array([1, 1])].get(mode="fill"),
            "clip": x.at[jnp.array([0, 9]), jnp.array([-2, 7])].get(mode="clip"),
            "row_fill": x.at[jnp.array([1, 9])].get(mode="fill", fill_value=3.0),
            "row_with_inf": x[jnp.array([1, 2, 1])],
            "scatter": jnp.zeros((4, 3, 6)).at[ii[:4], ii[4:] % 3].add(1.5),
            "dropped": jnp.zeros((4, 3)).at[jnp.array([0, 4, 1]), jnp.array([2, 0, -7])].add(2.0, mode="drop"),
            "ints": jnp.arange(40, dtype=jnp.int32).reshape(8, 5)[jnp.arange(8), lab] + 2 ** 25,
        }

    want = jax.jit(f)(x, lab, cube, ii)
    got = cluster.jit(f, in_shardings=(P("data"), P("data"), P(), P()), out_shardings=P())(
        cluster.device_put(x, P("data")), cluster.device_put(lab, P("data")), cluster.device_put(cube, P()),
        cluster.device_put(ii, P()))
    for key in want:
        w, g = np.asarray(want[key]), np.asarray(got[key])
        assert g.shape == w.shape and g.dtype == w.dtype, key
        np.testing.assert_array_equal(g, w, err_msg=key)


def test_a_traced_index_out_of_range_reads_the_nearest_row_as_xlas_gather_clamps(cluster):
    """x[i] and x.at[i].get() of a traced i gather with PROMISE_IN_BOUNDS, whose XLA gather
    clamps the start index (9 reads the last row, -20 the first after jnp's wrap); a scatter in
    the same mode skips such an update."""
    x = np.arange(16, dtype=np.float32).reshape(8, 2) - 5.5
    xi = (np.arange(24, dtype=np.int32).reshape(8, 3) + 2 ** 25) * np.array([1, -1, 1], np.int32)
    i = np.array([0, 9, -1, -20, 7, 30], np.int32)

    def f(x, xi, i):
        return {
            "rows": x[i],
            "promise": x.at[i].get(mode="promise_in_bounds"),
            "ints": xi[i],
            "points": x[i, i % 3],  # two indexed dims: column 2 is out of range too
            "column": x[:, i[1] - 8],
            "scatter": x.at[i].add(100.0, mode="promise_in_bounds"),
            "fill": jnp.take(x, i, axis=0),  # jnp.take's default mode fills (NaN)
        }

    want = jax.jit(f)(x, xi, i)
    got = cluster.jit(f)(cluster.device_put(x, P()), cluster.device_put(xi, P()), cluster.device_put(i, P()))
    assert np.asarray(want["rows"])[1].tolist() == x[7].tolist()  # (what XLA's clamp gives)
    for key in want:
        w, g = np.asarray(want[key]), np.asarray(got[key])
        assert g.shape == w.shape and g.dtype == w.dtype, key
        np.testing.assert_array_equal(g, w, err_msg=key)


def test_vmapped_dynamic_slices_their_gradients_and_window_scatters_match_jax(cluster):
    """jax.vmap of lax.dynamic_slice (per-example crops, sequence windows) gathers windows at
    batched starts; its gradient and a vmapped dynamic_update_slice scatter them. Starts out of
    range clamp (CLIP), fill the whole window (gather FILL_OR_DROP) or drop it (scatter
    FILL_OR_DROP / PROMISE_IN_BOUNDS), as jax.jit's."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(8, 12)).astype(np.float32)
    img = rng.normal(size=(4, 10, 9, 3)).astype(np.float32)
    seq = rng.normal(size=(6, 11, 5)).astype(np.float32)
    xi = np.arange(96, dtype=np.int32).reshape(8, 12) + 2 ** 25
    st = np.array([0, 3, 9, 10, -2, 5, 20, 1], np.int32)
    crop = lambda im, i, j: jax.lax.dynamic_slice(im, (i, j, 0), (6, 5, 3))  # noqa: E731
    window = lambda q, i: jax.lax.dynamic_slice_in_dim(q, i, 4, axis=0)  # noqa: E731
    dims = jax.lax.ScatterDimensionNumbers(update_window_dims=(1, 2), inserted_window_dims=(),
                                           scatter_dims_to_operand_dims=(1,))
    upd = jnp.ones((8, 8, 3)) * jnp.arange(8.0)[:, None, None]

    def f(x, img, seq, xi, st):
        return {
            "rows": jax.vmap(lambda r, i: jax.lax.dynamic_slice(r, (i,), (3,)))(x, st),
            "int_rows": jax.vmap(lambda r, i: jax.lax.dynamic_slice(r, (i,), (4,)))(xi, st),
            "crops": jax.vmap(crop)(img, st[:4], st[4:]),
            "windows": jax.vmap(window)(seq, st[:6]),
            "unbatched": jax.vmap(lambda i: jax.lax.dynamic_slice(x, (i, 2), (2, 5)))(st),
            "filled": x.at[st[:, None] + jnp.arange(3)].get(mode="fill", fill_value=-1.0),
            "crop_grad": jax.grad(lambda z: (jax.vmap(crop)(z, st[:4], st[4:]) ** 2).sum())(img),
            "window_grad": jax.grad(lambda z: (jax.vmap(window)(z, st[:6]) ** 3).sum())(seq),
            "updated": jax.vmap(lambda r, i: jax.lax.dynamic_update_slice(r, jnp.full((3,), 9.0), (i,)))(x, st),
            "int_updated": jax.vmap(lambda r, i: jax.lax.dynamic_update_slice(r, jnp.full((4,), -7, jnp.int32),
                                                                               (i,)))(xi, st),
            "dropped": jax.lax.scatter_add(x, st[:, None], upd, dims, mode="drop"),
            "clipped": jax.lax.scatter_add(x, st[:, None], upd, dims, mode="clip"),
            "promised": jax.lax.scatter_add(x, st[:, None], upd, dims, mode="promise_in_bounds"),
            "max": jax.lax.scatter_max(x, st[:, None], upd, dims, mode="clip"),
        }

    args = (x, img, seq, xi, st)
    want = jax.jit(f)(*args)
    got = cluster.jit(f)(*[cluster.device_put(a, P()) for a in args])
    for key in want:
        w, g = np.asarray(want[key]), np.asarray(got[key])
        assert g.shape == w.shape and g.dtype == w.dtype, key
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6, err_msg=key)


def test_a_point_gather_too_large_to_compare_is_refused_with_its_size(cluster):
    x = np.zeros((4096, 4096), np.float32)
    f = cluster.jit(lambda x, i: x[i, i])
    with pytest.raises(Exception, match=r"4096 index vectors into 16777216 positions .*take_along_axis"):
        f(cluster.device_put(x, P()), cluster.device_put(np.arange(4096, dtype=np.int32), P()))


def test_take_along_other_axes_searchsorted_nonzero_and_interp_match_jax(cluster):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(8, 8)).astype(np.float32)
    table = np.sort(np.concatenate([rng.normal(size=5), [0.0, -0.0, np.nan]]).astype(np.float32))
    queries = np.array([-0.0, 0.0, np.nan, -np.inf, np.inf, 0.5, -0.5, table[2]], np.float32)

    def f(x, table, queries):
        return {
            "take_axis1": jnp.take(x, jnp.array([3, 1, 9]), axis=1, mode="fill", fill_value=-2.0),
            "take_clip": jnp.take(x, jnp.array([[0, 7], [-3, 12]]), axis=1, mode="clip"),
            "take_grad": jax.grad(lambda x: jnp.sum(jnp.take(x, jnp.array([3, 1, 3]), axis=1) ** 2))(x),
            # searchsorted compares in lax's total order (lt_to / le_to): -0 below +0, NaN last
            "left": jnp.searchsorted(table, queries),
            "right": jnp.searchsorted(table, queries, side="right"),
            "nonzero": jnp.nonzero(x[0] > 0, size=8, fill_value=-1)[0],
            "argwhere": jnp.argwhere(x[:3, :3] > 0, size=9, fill_value=-1),
            "interp": jnp.interp(x[1], jnp.sort(x[0]), x[2]),
        }

    want = jax.jit(f)(x, table, queries)
    got = cluster.jit(f, out_shardings=P())(cluster.device_put(x, P()), cluster.device_put(table, P()),
                                            cluster.device_put(queries, P()))
    for key in want:
        w, g = np.asarray(want[key]), np.asarray(got[key])
        assert g.shape == w.shape and g.dtype == w.dtype, key
        if key == "interp":  # its arithmetic rounds in another order: an ulp or two
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7, err_msg=key)
        else:
            np.testing.assert_array_equal(g, w, err_msg=key)


def test_scatters_at_a_batch_of_indices_match_jax_bit_for_bit(cluster):
    """x.at[idx].set / .min / .max / .multiply / .subtract with duplicate, negative and out-of-range indices:
    the last duplicate set wins (as on XLA's CPU), NaN propagates through min / max, an index
    out of range is dropped; int32 sets, and int32 / uint32 adds and subtracts (wrapping, as
    XLA's), stay exact."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(6, 4)).astype(np.float32)
    x[0, 0] = np.nan
    idx = np.array([1, 3, 1, 5, 9, -1], np.int32)
    upd = rng.normal(size=(6, 4)).astype(np.float32)

    def f(x, idx, upd):
        return {
            "set": x.at[idx].set(upd), "set_scalar": x.at[idx[:3]].set(7.0), "max": x.at[idx].max(upd),
            "min": x.at[idx].min(upd), "mul": x.at[idx].multiply(upd), "drop": x.at[idx].set(upd, mode="drop"),
            "points": x.at[idx[:4], jnp.array([0, 1, 2, 3])].set(upd[0]),
            "one_hot": jnp.zeros((6, 10)).at[jnp.arange(6), idx % 10].set(1.0),
            "ints": jnp.arange(24, dtype=jnp.int32).reshape(6, 4).at[idx].set(jnp.full((6, 4), 2 ** 30 + 1, jnp.int32)),
            "grad": jax.grad(lambda u: jnp.sum(x.at[idx].set(u) ** 2))(upd),
            "sub": x.at[idx[:4]].subtract(upd[:4]),
            "sub_ints": jnp.arange(24, dtype=jnp.int32).reshape(6, 4).at[idx].subtract(jnp.int32(2 ** 31 - 1)),
            "add_ints": jnp.arange(24, dtype=jnp.int32).reshape(6, 4).at[idx].add(jnp.int32(2 ** 30 + 3)),
            "add_ints_along": jnp.zeros((6, 4), jnp.uint32).at[jnp.arange(6), idx % 4].add(jnp.uint32(2 ** 31 + 5)),
            "sub_grads": jax.grad(lambda a, u: jnp.sum(a.at[idx].subtract(u) ** 2), argnums=(0, 1))(x, upd),
        }

    want = jax.jit(f)(x, idx, upd)
    got = cluster.jit(f, out_shardings=P())(cluster.device_put(x, P()), cluster.device_put(idx, P()),
                                            cluster.device_put(upd, P()))
    for key in want:
        for w, g in zip(jax.tree_util.tree_leaves(want[key]), jax.tree_util.tree_leaves(got[key])):
            w, g = np.asarray(w), np.asarray(g)
            assert g.dtype == w.dtype, key
            np.testing.assert_array_equal(g, w, err_msg=key)


def test_vmapped_indexing_gathers_and_scatters_with_batching_dims_match_jax(cluster):
    """jax.vmap of row[k], m[k] (a whole row at k), row.at[k].set / .add and their gradients:
    gathers and scatters with batching dims, each index reading its own batch element's block."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 5)).astype(np.float32)
    i = rng.integers(0, 5, 8).astype(np.int32)
    cube = rng.normal(size=(2, 4, 5)).astype(np.float32)
    upd = rng.normal(size=(8,)).astype(np.float32)

    def f(x, i, cube, upd):
        return {
            "pick": jax.vmap(lambda row, k: row[k])(x, i),
            "pick_grad": jax.grad(lambda x: jnp.sum(jax.vmap(lambda row, k: row[k])(x, i) ** 2))(x),
            "nested": jax.vmap(jax.vmap(lambda row, k: row[k]))(cube, i.reshape(2, 4)),
            "nll": jax.vmap(lambda row, k: -jax.nn.log_softmax(row)[k])(x, i),
            "rows": jax.vmap(lambda m, k: m[k])(cube, i[:2] % 4),
            "rows_grad": jax.grad(lambda c: jnp.sum(jax.vmap(lambda m, k: m[k])(c, i[:2] % 4) ** 2))(cube),
            "set": jax.vmap(lambda row, k, u: row.at[k].set(u))(x, i, upd),
            "add": jax.vmap(lambda row, k, u: row.at[k].add(u))(x, i, upd),
        }

    want = jax.jit(f)(x, i, cube, upd)
    got = cluster.jit(f, in_shardings=(P("data"), P("data"), P(), P()), out_shardings=P())(
        cluster.device_put(x, P("data")), cluster.device_put(i, P("data")), cluster.device_put(cube, P()),
        cluster.device_put(upd, P()))
    for key in want:
        w, g = np.asarray(want[key]), np.asarray(got[key])
        assert g.shape == w.shape, key
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7, err_msg=key)  # (nll: an ulp of log_softmax)
