"""What the client does with a program's results after a call: host callbacks (jax.debug.print,
jax.debug.callback) and run-time checks (a while loop that ran past the iterations unrolled).

A program cannot call back into the client while it runs, so the values a callback reads leave
the program as extra results (after the function's own), the client fetches them once the call
returns, runs the callback with them, and deletes them from the cluster. The callback itself is
JAX's: the primitive's own implementation runs with the fetched values (jax.debug.print's format
and numpy print options included), so the output is the one jax.jit prints.

As in jax.jit:
  - a callback in a lax.cond / lax.switch branch runs only when that branch is taken (meshrun runs
    every branch; the branch index leaves the program too, and the callback is skipped when
    another branch was chosen);
  - a callback in a shard_map body runs once per device with that device's blocks (in the mesh's
    device order, the first axis slowest);
  - in a lax.scan or a while loop it runs once per iteration, in a vmapped function once per
    element (JAX's batching rule unrolls it).
Every callback of a call runs after the whole program has run, in program order (so `ordered=True`
holds; JAX may interleave unordered ones with the computation).

Not supported (refused by name): `partitioned=True` outside a shard_map body.

A check is a bool the program computes that must be false (a while loop's predicate after the
iterations unrolled): the client raises FailedPreconditionError with its message, before any
callback runs, when it holds (for a check in a cond branch: when that branch was taken).
"""
import numpy as np

from meshrun import _sharding, errors
from meshrun._ir import EMPTY, F32, G, _V, _is_bool

# The host-callback primitives (jax.debug.print has its own since jax 0.6).
DEBUG_CALLBACKS = {"debug_callback", "debug_print"}

SUPPORTED_CALLBACKS = {
    k: "its operands as extra results, fetched after the call; the callback run on the client (a cond "
       "branch's only when taken; a shard_map body's once per device)" for k in DEBUG_CALLBACKS}


class Callback:
    """One callback site of a program: what to call and where its operands are among the
    program's extra results."""

    def __init__(self, primitive, params, operands, guards, devices):
        self.primitive = primitive
        self.params = params
        # Per operand: ("result", its extra result's index) or ("value", a numpy array). Typed PRNG
        # keys are their u32 words (jax.random.key_data), as jax.jit's callbacks get them.
        self.operands = operands
        # [(extra result index of a cond's branch index, this branch, the branch count, whether
        #   the index is per device)]
        self.guards = guards
        self.devices = devices  # 0: called once with global values; n: once per device's blocks


class Check:
    """A run-time check of a program: raise `message` if its extra result holds."""

    def __init__(self, result, message, guards, devices):
        self.result = result  # the bool's extra result index
        self.message = message
        self.guards = guards  # as Callback's
        self.devices = devices


class _Callbacks:
    """Converter's host callbacks and checks (a mixin: uses its emit, binary, mesh, _layouts,
    _manual_depth and _unsupported)."""

    def init_callbacks(self):
        self.callbacks = []  # host callbacks (Callback), in program order
        self.checks = []  # run-time checks (Check), once emit_extra_results has run
        self._pending_checks = {}  # (message, devices, guards) -> (predicate, guard results)
        self.extra_results = []  # the values they read: results after the function's own
        self._guards = []  # the cond branches being converted: (index, branch, count, in shard_map)
        self._stacked = {}  # block value id -> every device's block stacked (_per_device)

    def _debug_callback(self, name, eqn, p, ins):
        if p.get("partitioned") and not self._manual_depth:
            self._unsupported(name, eqn, "partitioned=True (a callback per shard) outside a shard_map body")
        devices = self._devices()
        operands = []
        for v in ins:
            if v.id == EMPTY:
                shape = (devices,) + tuple(v.shape) if devices else tuple(v.shape)
                operands.append(("value", np.zeros(shape, dtype=v.dtype)))
                continue
            operands.append(("result", self._extra_result(self._per_device(v) if devices else v)))
        self.callbacks.append(Callback(eqn.primitive, dict(p), operands, self._guard_results(), devices))
        return []

    def add_check(self, pred, message):
        """After each call, the client raises FailedPreconditionError(message) if `pred` (a bool
        value) holds, on any device in a shard_map body, and only if the cond branches around
        this point were taken. Checks with one message under the same branches (a loop nested
        in another's unrolled iterations) are one result, their predicates max-ed."""
        devices = self._devices()
        value = self._per_device(pred) if devices else pred
        key = (message, devices, tuple((index.id, branch) for index, branch, _, _ in self._guards))
        if key in self._pending_checks:
            held, guards = self._pending_checks[key]
            self._pending_checks[key] = (self.binary("max", held, value), guards)
        else:
            self._pending_checks[key] = (value, self._guard_results())

    def _devices(self):
        """How many calls a callback or check here makes: one per device in a shard_map body; 0
        (one call with global values) outside."""
        return self.mesh.size if self._manual_depth else 0

    def _guard_results(self):
        """The cond branches around this point as (extra result index of the branch index, branch,
        count, per device): a cond in a shard_map body has an index per device; one outside it,
        one for all."""
        return [(self._extra_result(self._per_device(index) if manual else index), branch, count, manual)
                for index, branch, count, manual in self._guards]

    def _per_device(self, block):
        """A block in a shard_map body as a global value stacking every device's block along a new
        dim 0 (SHARD_MAP_EXIT over every mesh axis); once per block."""
        if block.id in self._stacked:
            return self._stacked[block.id]
        shape = (1,) + tuple(block.shape)
        one = self.emit(G.RESHAPE, [block], shape=list(shape))
        axes = tuple(self.mesh.axis_names)
        entries = (axes,) + ((),) * len(block.shape)
        vid = self.emit(G.SHARD_MAP_EXIT, [_V(one, shape, block.dtype, block.store)],
                        spec=_sharding.spec_to_proto(entries))
        self._layouts[vid] = entries
        self._stacked[block.id] = _V(vid, (self.mesh.size,) + tuple(block.shape), block.dtype, block.store)
        return self._stacked[block.id]

    def _extra_result(self, v):
        """The index of v among the program's extra results (each value once)."""
        for i, x in enumerate(self.extra_results):
            if x.id == v.id:
                return i
        self.extra_results.append(v)
        return len(self.extra_results) - 1

    def emit_extra_results(self):
        """OUTPUT ops for the checks' and callbacks' values, after the function's results, each
        in the layout it has (the fetch assembles it)."""
        for (message, devices, _), (value, guards) in self._pending_checks.items():
            self.checks.append(Check(self._extra_result(value), message, guards, devices))
        self._pending_checks = {}
        for v in self.extra_results:
            entries = self._layouts.get(v.id, ())
            want = F32 if _is_bool(v.dtype) else _sharding.dtype_to_proto(v.dtype)
            if v.store != want:
                v = _V(self.emit(G.CONVERT, [v], dtype=want), v.shape, v.dtype, want)
            self.emit(G.OUTPUT, [v], spec=_sharding.spec_to_proto(entries))


def after_call(callbacks, checks, extra):
    """Makes a call's checks, then runs its callbacks, with its extra results `extra`
    (meshrun.Array, in program order); then deletes those from the cluster, also when a check
    fails (FailedPreconditionError) or a callback raises (its exception propagates, as jax.jit's
    call raises it)."""
    try:
        fetched = [np.asarray(a) for a in extra]
        for check in checks:
            for d in _taken_calls(check, fetched):
                held = fetched[check.result] if d is None else fetched[check.result][d]
                if bool(np.asarray(held).reshape(-1)[0]):
                    raise errors.FailedPreconditionError(check.message)
        for cb in callbacks:
            for d in _taken_calls(cb, fetched):
                cb.primitive.impl(*[_operand(op, fetched, d) for op in cb.operands], **cb.params)
    finally:
        for a in extra:
            a.delete()


def _operand(op, fetched, device):
    """A callback's operand for one call (device: the device's index, or None for the one call)."""
    x = op[1] if op[0] == "value" else fetched[op[1]]
    return x if device is None else x[device]


def _taken_calls(site, fetched):
    """The calls of a Callback or Check whose cond branches were taken: device indices in a
    shard_map body, else [None] (one call with global values) or []."""
    for d in range(site.devices) if site.devices else [None]:
        if all(_taken(fetched[i][d] if manual else fetched[i], branch, count)
               for i, branch, count, manual in site.guards):
            yield d


def _taken(index, branch, count):
    """Whether a cond with this index value took `branch` (lax.switch clamps the index)."""
    return min(max(int(index), 0), count - 1) == branch


def without_callbacks(jaxpr):
    """`jaxpr` (a jax core Jaxpr or ClosedJaxpr) less its host callbacks, in nested bodies too,
    for evaluating on the client while converting (a while loop's trip count), which must not
    print or call back: the program prints once, when it runs."""
    from jax._src import core

    if isinstance(jaxpr, core.ClosedJaxpr):
        return jaxpr.replace(jaxpr=without_callbacks(jaxpr.jaxpr))
    if not isinstance(jaxpr, core.Jaxpr):
        return jaxpr
    eqns = [e.replace(params={k: _param_without_callbacks(v) for k, v in e.params.items()},
                      effects=_pure(e.effects))
            for e in jaxpr.eqns if e.primitive.name not in DEBUG_CALLBACKS]
    return jaxpr.replace(eqns=eqns, effects=_pure(jaxpr.effects))


def _param_without_callbacks(v):
    if isinstance(v, (tuple, list)):
        return type(v)(_param_without_callbacks(x) for x in v)
    return without_callbacks(v)


def _pure(effects):
    """The effects less the debug callbacks' (jax._src.debugging's DebugEffect, OrderedDebugEffect)."""
    return type(effects)(e for e in effects if type(e).__name__ not in ("DebugEffect", "OrderedDebugEffect"))
