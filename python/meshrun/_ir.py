"""The values and ops of a program being converted from a jaxpr (meshrun._convert)."""
import numpy as np

from meshrun.v1 import common_pb2, program_pb2

G = program_pb2.GlobalOp
F32, BF16, I32, U32 = common_pb2.DTYPE_F32, common_pb2.DTYPE_BF16, common_pb2.DTYPE_I32, common_pb2.DTYPE_U32


def _summary(eqn):
    """file:line of the innermost frame of the equation's traceback outside installed packages
    (the user's code, not optax's or flax's); JAX's own summary otherwise."""
    try:
        tb = eqn.source_info.traceback
        for f in (tb.frames if tb is not None else []):
            if "/site-packages/" not in f.file_name and "/jax/" not in f.file_name:
                return f"{f.file_name}:{getattr(f, 'start_line', getattr(f, 'line_num', '?'))} ({f.function_name})"
        from jax._src import source_info_util

        return source_info_util.summarize(eqn.source_info)
    except Exception:  # pragma: no cover - private API moved
        return ""


# The id of a zero-size value: nothing on the cluster holds it (meshrun._convert's
# _empty_equation computes what reads it; an op that would take it as an operand is refused).
EMPTY = -1


class _V:
    """A value: its id in the program, global shape, logical (numpy) dtype, dtype on the cluster."""

    __slots__ = ("id", "shape", "dtype", "store")

    def __init__(self, id_, shape, dtype, store):
        self.id, self.shape, self.dtype, self.store = id_, tuple(shape), np.dtype(dtype), store


def _is_int(dt):
    return np.issubdtype(np.dtype(dt), np.integer)


def _is_bf16(dt):
    return str(np.dtype(dt)) == "bfloat16"


def _is_bool(dt):
    return np.dtype(dt) == np.bool_
