"""The conversion table of meshrun._convert: each supported jaxpr primitive -> what runs on the
cluster for it (also `meshrun.SUPPORTED_PRIMITIVES`)."""
from meshrun._convert_callbacks import SUPPORTED_CALLBACKS
from meshrun._convert_elementwise import _BINARY, _COMPARE, _IDENTITY, _UNARY
from meshrun._convert_linalg import SUPPORTED_LINALG
from meshrun._convert_random import SUPPORTED_RANDOM
from meshrun._convert_special import SUPPORTED_SPECIAL
from meshrun._convert_regions import _CALLS, _MANUAL
from meshrun._convert_windows import SUPPORTED_WINDOWS

# The conversion table: primitive -> what runs on the cluster.
SUPPORTED = {
    **{k: f"UNARY {v}" for k, v in _UNARY.items()},
    **{k: f"BINARY {v}" for k, v in _BINARY.items()},
    **{k: f"BINARY {v} (f32 1/0)" for k, v in _COMPARE.items()},
    "integer_pow": "UNARY square / BINARY mul chains (div for negative powers; integers in their own wrapping mul)",
    "round": "UNARY round_away / round_even",
    "reduce_precision": "CONVERTs to bf16 and back (8 exponent, 7 mantissa bits; none for more)",
    "select_n": "SELECT (two cases; more: a tree of them on index >= the upper half's first, as JAX lowers it)",
    "and": "mul (bool); BINARY and (integers)", "or": "max (bool); BINARY or (integers)",
    "not": "1 - x (bool); BINARY xor with all ones (integers)",
    "dot_general": "DOT_GENERAL (f32 / bf16; an integer product is refused)", "broadcast_in_dim": "BROADCAST_IN_DIM (layout propagated)",
    "reshape": "RESHAPE (after a TRANSPOSE by its dimensions, if given)", "squeeze": "RESHAPE", "expand_dims": "RESHAPE",
    "transpose": "TRANSPOSE",
    "slice": "SLICE (a dim cut short is gathered); strides: a RESHAPE to [m, stride], its first column",
    "reduce_sum": "REDUCE sum", "reduce_max": "REDUCE max", "stack": "RESHAPEs and CONCATENATE",
    "reduce_prod": "a pairwise tree of BINARY mul over SLICEd halves, per axis (jnp.prod)",
    "reduce_min": "-REDUCE max(-x)", "reduce_and": "-REDUCE max(-x) of bools (jnp.all)",
    "reduce_or": "REDUCE max of bools (jnp.any)", "convert_element_type": "CONVERT (or none)",
    "iota": "IOTA", "sharding_constraint": "CONSTRAINT", "reshard": "CONSTRAINT",
    "scan": "unrolled: INDEX of xs[i], the body inlined, STACK of the ys",
    "while": "unrolled: a trip count that follows from constant-started counters is counted while "
             "converting (at most 1000 trips); any other, while_trips iterations each SELECTed by the "
             "predicate, and a run-time check that the loop finished",
    "concatenate": "CONCATENATE (the dim unsharded)",
    "pad": "SLICE / CONCATENATE with the padding value; interior: interleaved by CONCATENATE and RESHAPE",
    "split": "SLICEs", "unstack": "SLICEs and RESHAPEs",
    **{k: f"CUMULATIVE {k[3:]} (the dim gathered)" for k in ("cumsum", "cumprod", "cummax", "cummin")},
    "cumlogsumexp": "CUMULATIVE logsumexp, each step jnp.logaddexp in f32 (the dim gathered)",
    "rev": "REVERSE (jnp.flip, x[::-1]; the reversed dims gathered)",
    "sort": "SORT per result (stable; the sorted dim gathered)",
    "top_k": "SORT by the complement of x's total-order key (an integer's, itself), with an IOTA, SLICEd to k along its axis (as XLA's)",
    "cond": "every branch inlined, SELECTs by the index (lax.cond, lax.switch); only the chosen one for a "
            "platform_index",
    "platform_index": "the index of the CPU's branch, else the default's (lax.platform_dependent)",
    "empty2": "CONSTANT 0 (a cond branch's placeholder residual)", "empty": "CONSTANT 0",
    "dynamic_slice": "DYNAMIC_SLICE (starts clamped; a dim cut short is gathered)",
    "dynamic_update_slice": "DYNAMIC_UPDATE_SLICE (starts clamped; dims not covered whole gathered)",
    "gather": "one-hot SELECT and REDUCE sum, or a one-hot DOT_GENERAL for rows (take_along_axis, "
              "jnp.take of rows for ids of any shape as nn.Embed, one index); other index vectors: each "
              "compared with every position, SELECT and REDUCE sum (_convert_points); an index out of range "
              "reads the fill value (FILL_OR_DROP) or is clamped (CLIP), as in JAX",
    "scatter-add": "the transposes of those gathers; or as scatter's window form",
    "scatter-sub": "as scatter-add of the negated updates",
    "scatter": "one window at one index vector (x.at[i, j].set(v), x.at[i, 2:5].set(v)): DYNAMIC_UPDATE_SLICE, "
               "the operand kept where the window is out of bounds (FILL_OR_DROP); a batch of index vectors: "
               "each compared with every position, the last update landing on one wins",
    **{k: f"as scatter's window form, the window's values {k[8:]}-combined first (DYNAMIC_SLICE); a batch of "
          "index vectors: the updates landing on a position combined (floats)"
       for k in ("scatter-mul", "scatter-min", "scatter-max")},
    "tile": "BROADCAST_IN_DIM to [r0, n0, r1, n1, ...], RESHAPE",
    "shard_map": "SHARD_MAP_ENTER, the body per device, SHARD_MAP_EXIT",
    **{k: f"MANUAL_COLLECTIVE {v} (in a shard_map body)" for k, v in _MANUAL.items()},
    "pmin": "-pmax(-x) (~pmax(~x) for integers)",
    "axis_index": "AXIS_INDEX (in a shard_map body)",
    **{k: f"BINARY {k[:2]} of int32 keys: the f32 bits with the low 31 flipped where negative (lax's total "
          "order)" for k in ("lt_to", "le_to", "eq_to")},
    "cbrt": "BINARY pow(|x|, 1/3), one Newton step, x's sign (within an ulp)",
    "sign": "(x > 0) - (x < 0); x itself for +-0 and NaN", "is_finite": "(x - x) == 0", "clamp": "min(max(x, lo), hi)",
    "argmax": "REDUCE max, then the least index holding it", "argmin": "argmax of -x",
    **{k: "the value itself" for k in _IDENTITY},
    **{k: "its body, inlined" for k in _CALLS},
    **SUPPORTED_RANDOM,
    **SUPPORTED_SPECIAL,
    **SUPPORTED_WINDOWS,
    **SUPPORTED_CALLBACKS,
    **SUPPORTED_LINALG,
}
