"""Pytree helpers: jax.tree_util when jax is installed, else plain containers."""


def _is_spec_leaf(x):
    """A PartitionSpec, a NamedSharding (JAX's or meshrun's) or None: one leaf's sharding."""
    if x is None or (hasattr(x, "spec") and hasattr(x, "mesh")):
        return True
    try:
        from jax.sharding import PartitionSpec

        return isinstance(x, PartitionSpec)
    except ImportError:  # pragma: no cover
        return False


def map_with_prefix(fn, prefix, tree):
    """fn(leaf, spec) over tree's leaves, where `prefix` (a tree of specs, or one spec) is a prefix
    of tree's structure, as jax.jit's in_shardings are."""
    import jax

    if _is_spec_leaf(prefix):
        return jax.tree_util.tree_map(lambda leaf: fn(leaf, prefix), tree)

    def sub(spec, subtree):
        return jax.tree_util.tree_map(lambda leaf: fn(leaf, spec), subtree)

    return jax.tree_util.tree_map(sub, prefix, tree, is_leaf=_is_spec_leaf)


def flat_specs(prefix, tree):
    """The spec of each of tree's leaves, in tree_flatten order (prefix as map_with_prefix)."""
    specs = []
    map_with_prefix(lambda leaf, spec: specs.append(spec), prefix, tree)
    return specs
