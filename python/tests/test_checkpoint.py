"""cluster.save_checkpoint / restore_checkpoint (flax.training.checkpoints' names): a train state
saved under one layout comes back bit for bit under another and trains on exactly as it would
have; bool and PRNG-key leaves keep their dtypes; a wrong target is refused with nothing left on
the cluster."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from meshrun import errors
from clusterutil import listed




def test_a_saved_train_state_restores_under_another_layout_and_trains_on_identically(cluster, tmp_path):
    rng = np.random.default_rng(3)
    params = {"w": rng.normal(size=(16, 8)).astype(np.float32), "b": np.zeros(8, np.float32)}
    tx = optax.adam(1e-2)
    state = {"params": params, "opt": tx.init(params)}
    spec = jax.tree_util.tree_map(lambda _: P(), state)
    spec["params"] = {"w": P("data", "model"), "b": P("model")}
    x = rng.normal(size=(8, 16)).astype(np.float32)

    def step(state, x):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"] + p["b"]) ** 2))(state["params"])
        updates, opt = tx.update(g, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    run = cluster.jit(step, out_shardings=(spec, P()))
    xs = cluster.device_put(x, P("data"))
    s, _ = run(cluster.device_put(state, spec), xs)
    path = cluster.save_checkpoint(str(tmp_path), s, 1)
    assert os.path.basename(path) == "step_00000001"
    with open(os.path.join(path, "manifest.json")) as f:  # leaves named by their tree paths
        names = {a["name"] for a in json.load(f)["arrays"]}
    assert {"params/w", "params/b", "opt/0/count", "opt/0/mu/w", "opt/0/nu/b"} <= names

    other = jax.tree_util.tree_map(lambda _: P(), state)
    other["params"] = {"w": P("model", None), "b": P()}
    restored = cluster.restore_checkpoint(path, s, other)
    assert restored["params"]["w"].sharding.spec == P("model")
    for a, b in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(s)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Restored in the saved layout (the target's own), two more steps from the saved state and
    # from the restored one give the same bits (another layout would add partial sums in another
    # order).
    restored = cluster.restore_checkpoint(path, s)
    for _ in range(2):
        s, loss_a = run(s, xs)
        restored, loss_b = run(restored, xs)
        assert float(np.asarray(loss_a)) == float(np.asarray(loss_b))
    np.testing.assert_array_equal(np.asarray(restored["params"]["w"]), np.asarray(s["params"]["w"]))


def test_bool_and_key_leaves_come_back_as_such_and_numpy_targets_need_shardings(cluster, tmp_path):
    state = {"mask": np.array([True, False, True, True]), "key": jax.random.key(5), "n": np.int32(3)}
    saved = cluster.device_put(state, P())
    path = cluster.save_checkpoint(str(tmp_path), saved, 0)
    back = cluster.restore_checkpoint(path, state, P())  # numpy / jax leaves: shape and dtype only
    np.testing.assert_array_equal(np.asarray(back["mask"]), state["mask"])
    assert back["mask"].dtype == np.bool_ and back["key"].key_dtype == state["key"].dtype
    draw = cluster.jit(lambda s: jax.random.normal(s["key"], (3,)) * s["n"])
    np.testing.assert_allclose(np.asarray(draw(back)), jax.random.normal(state["key"], (3,)) * 3, rtol=1e-6)
    with pytest.raises(errors.InvalidArgumentError, match=r"no shardings were given"):
        cluster.restore_checkpoint(path, state)


def test_a_wrong_target_is_refused_by_name_and_leaves_nothing_behind(cluster, tmp_path):
    saved = cluster.device_put({"a": np.ones((8, 4), np.float32), "b": np.ones(4, np.float32)}, P())
    path = cluster.save_checkpoint(str(tmp_path), saved, 2)
    before = listed(cluster)
    with pytest.raises(errors.InvalidArgumentError, match=r": a is saved as float32\[8, 4\]; the target has float32\[4, 8\]"):
        cluster.restore_checkpoint(path, {"a": np.zeros((4, 8), np.float32), "b": np.ones(4, np.float32)}, P())
    with pytest.raises(errors.InvalidArgumentError, match=r": b is saved as float32\[4\]; the target has int32\[4\]"):
        cluster.restore_checkpoint(path, {"a": np.zeros((8, 4), np.float32), "b": np.ones(4, np.int32)}, P())
    with pytest.raises(errors.NotFoundError, match=r"array c is not in the checkpoint"):
        cluster.restore_checkpoint(path, {"c": np.ones(4, np.float32)}, P())
    with pytest.raises(errors.NotFoundError, match=r"no committed checkpoint"):
        cluster.restore_checkpoint(str(tmp_path / "absent"), saved)
    assert listed(cluster) == before
    with pytest.raises(errors.InvalidArgumentError, match=r"leaf x is a ndarray; expected a meshrun.Array"):
        cluster.save_checkpoint(str(tmp_path), {"x": np.ones(2, np.float32)}, 3)
    with pytest.raises(errors.InvalidArgumentError, match=r"step=-1"):
        cluster.save_checkpoint(str(tmp_path), saved, -1)
    # keep=1: only the newest committed step stays.
    newest = cluster.save_checkpoint(str(tmp_path), saved, 4, keep=1)
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(newest)]
