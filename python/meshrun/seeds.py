"""The seeds' models (../shared/seeds), as their guides write them, for the SDK's benchmark and
tests: seed 000's DotReluDot and scanned MLP (Flax's pjit guide; linen), and seeds 002/003's NNX
DotReluDot (Flax NNX's GSPMD guide). Shapes row-major, f32; parameters annotated for the
('data', 'model') mesh. Needs flax (the `jax` extra)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.lax import with_sharding_constraint
from jax.sharding import PartitionSpec


class DotReluDot(nn.Module):
    """Seed 000: x [b, d] -> (z [b, d], None); W1 [d, depth] over (None, 'model'), W2 [depth, d]
    over ('model', None); the tuple is what flax.linen.scan expects."""

    depth: int

    @nn.compact
    def __call__(self, x):
        W1 = self.param("W1", nn.with_partitioning(nn.initializers.xavier_normal(), (None, "model")),
                        (x.shape[-1], self.depth))
        y = jax.nn.relu(jnp.dot(x, W1))
        y = with_sharding_constraint(y, PartitionSpec("data", "model"))
        W2 = self.param("W2", nn.with_partitioning(nn.initializers.xavier_normal(), ("model", None)),
                        (self.depth, x.shape[-1]))
        z = jnp.dot(y, W2)
        z = with_sharding_constraint(z, PartitionSpec("data", None))
        return z, None


class MLP(nn.Module):
    """Seed 000 with use_scan=True: num_layers DotReluDot blocks stacked by nn.scan (their
    parameters get a leading layer dim, not partitioned)."""

    num_layers: int
    depth: int

    @nn.compact
    def __call__(self, x):
        x, _ = nn.scan(DotReluDot, length=self.num_layers, variable_axes={"params": 0},
                       split_rngs={"params": True}, metadata_params={nn.PARTITION_NAME: None})(self.depth)(x)
        return x


class NnxDotReluDot(nnx.Module):
    """Seeds 002/003: x [b, depth] -> [b, depth]; dot1's kernel over (None, 'model'), w2 over
    ('model', None). Create it under jax.set_mesh (Flax's eager sharding)."""

    def __init__(self, depth: int, rngs: nnx.Rngs):
        init_fn = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(depth, depth, kernel_init=nnx.with_partitioning(init_fn, (None, "model")),
                               use_bias=False, rngs=rngs)
        self.w2 = nnx.Param(init_fn(rngs.params(), (depth, depth)), sharding=("model", None))

    def __call__(self, x: jax.Array):
        y = self.dot1(x)
        y = jax.nn.relu(y)
        y = jax.lax.with_sharding_constraint(y, PartitionSpec("data", "model"))
        z = jnp.dot(y, self.w2[...])
        return z
