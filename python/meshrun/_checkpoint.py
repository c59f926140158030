"""Sharded checkpoints of pytrees of meshrun.Arrays, as flax.training.checkpoints saves and
restores a train state: each worker writes and reads only its own blocks (the coordinator's
SaveCheckpoint / RestoreCheckpoint; the C++ SDK's TrainState and `meshrun ckpt` use the same
format), so restoring needs no byte to pass through the client."""
import secrets

import numpy as np

from meshrun import _array, _sharding, _tree, errors
from meshrun._convert_random import is_key_dtype
from meshrun.v1 import coordinator_pb2


def _key_name(k):
    """One tree-path entry as a name part: a dict key, a sequence index, an attribute name."""
    for attr in ("key", "idx", "name"):  # DictKey, SequenceKey / FlattenedIndexKey, GetAttrKey
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _leaves_with_names(tree):
    """(name, leaf) per leaf in tree_flatten order; a leaf's name is its tree path joined by "/"
    (e.g. "params/Dense_0/kernel", "opt/0/mu/w"), as orbax and the C++ SDK's TrainState name
    theirs, so a restore needs a target of the same structure."""
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [("/".join(_key_name(k) for k in path) or "value", leaf) for path, leaf in flat]


def save(cluster, ckpt_dir, target, step, keep):
    named = _leaves_with_names(target)
    if not named:
        raise errors.InvalidArgumentError("save_checkpoint: the target has no leaves")
    if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
        raise errors.InvalidArgumentError(f"save_checkpoint: step={step!r}; expected an int >= 0")
    if not isinstance(keep, (int, np.integer)) or isinstance(keep, bool) or keep < 0:
        raise errors.InvalidArgumentError(f"save_checkpoint: keep={keep!r}; expected an int >= 0 (0: keep all)")
    req = coordinator_pb2.SaveCheckpointRequest(root=str(ckpt_dir), step=int(step), keep=int(keep))
    for name, leaf in named:
        if not isinstance(leaf, _array.Array):
            raise errors.InvalidArgumentError(
                f"save_checkpoint: leaf {name} is a {type(leaf).__name__}; expected a meshrun.Array "
                "(cluster.device_put it first)")
        leaf._check_live()
        req.arrays.add(name=name, id=leaf.id)
    return cluster._call("SaveCheckpoint", req, timeout=max(cluster.timeout, 600.0)).path


def restore(cluster, path, target, shardings):
    named = _leaves_with_names(target)
    if not named:
        raise errors.InvalidArgumentError("restore_checkpoint: the target has no leaves")
    if shardings is None:
        specs = []
        for name, leaf in named:
            if not isinstance(leaf, _array.Array):
                raise errors.InvalidArgumentError(
                    f"restore_checkpoint: leaf {name} is a {type(leaf).__name__} and no shardings "
                    "were given; pass shardings= (a PartitionSpec or a pytree of them) or a target of meshrun.Arrays")
            specs.append(leaf._entries)
    else:
        specs = [_sharding.normalize_spec(s, cluster.mesh) for s in _tree.flat_specs(shardings, target)]
    tag = secrets.token_hex(4)
    req = coordinator_pb2.RestoreCheckpointRequest(path=str(path))
    for i, ((name, _), entries) in enumerate(zip(named, specs)):
        req.arrays.add(name=name, id=f"restored-{tag}-{i}", spec=_sharding.spec_to_proto(entries))
    infos = cluster._call("RestoreCheckpoint", req, timeout=max(cluster.timeout, 600.0)).arrays
    arrays = [_restored(cluster, leaf, info) for (_, leaf), info in zip(named, infos)]
    for (name, leaf), a in zip(named, arrays):
        mismatch = _mismatch(leaf, a)
        if mismatch:
            for b in arrays:  # nothing half-restored stays on the cluster
                b.delete()
            raise errors.InvalidArgumentError(f"restore_checkpoint: {name} {mismatch}")
    import jax

    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(target), arrays)


def _restored(cluster, leaf, info):
    """The restored array as a meshrun.Array with the target leaf's logical dtype (bool, typed
    PRNG keys)."""
    dtype = getattr(leaf, "dtype", None)
    key_dtype = getattr(leaf, "key_dtype", None) or (dtype if is_key_dtype(dtype) else None)
    logical = np.bool_ if key_dtype is None and dtype is not None and np.dtype(dtype) == np.bool_ else None
    return _array.Array(cluster, info, logical, key_dtype)


def _mismatch(leaf, a):
    """How the restored array `a` differs from the target leaf in shape or stored dtype ("" if it
    does not; a leaf without a shape or dtype is not checked)."""
    shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
    if shape is None or dtype is None:
        return ""
    shape = tuple(shape)
    if is_key_dtype(dtype):
        shape, dtype = shape + (2,), np.uint32  # a jax key array: its words
    stored, got = _sharding.stored_dtype(dtype), _sharding.stored_dtype(a.dtype)
    if shape == a.shape and stored == got:
        return ""
    return f"is saved as {got}{list(a.shape)}; the target has {stored}{list(shape)}"
