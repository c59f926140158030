"""Nested bodies in meshrun._convert: calls (jit, custom_jvp/vjp, remat) inlined, lax.scan
unrolled, while loops unrolled (a traced trip count: guarded iterations and a run-time check),
jax.shard_map regions with their collectives."""
import numpy as np

from meshrun import _sharding
from meshrun._convert_callbacks import without_callbacks
from meshrun._ir import BF16, F32, G, I32, U32, _V

# Collectives in a shard_map body -> JitBuilder::ManualCollective's fn.
_MANUAL = {"psum": "psum", "psum_invariant": "psum", "psum2": "psum", "pmax": "pmax",
           "all_gather": "all_gather", "reduce_scatter": "psum_scatter", "ppermute": "ppermute",
           "all_to_all": "all_to_all"}
_CALLS = {"jit", "pjit", "closed_call", "core_call", "remat", "remat2", "checkpoint", "custom_jvp_call",
          "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin"}


class _Regions:
    """Converter's nested bodies (a mixin: uses its emit, run, where, _unsupported)."""

    def _region_equation(self, name, p, ins, eqn):
        """The outputs of a nested-body primitive; None for another primitive."""
        if name in _CALLS:
            sub = next((p[k] for k in ("jaxpr", "call_jaxpr", "fun_jaxpr") if p.get(k) is not None), None)
            if sub is None:
                self._unsupported(name, eqn, "no body")
            closed_consts = list(getattr(sub, "consts", []))
            body = getattr(sub, "jaxpr", sub)
            self._sites.append(self.where(eqn))
            try:
                return self.run(body, closed_consts, ins[len(ins) - len(body.invars):], self.out_hints(eqn))
            finally:
                self._sites.pop()
        if name == "scan":
            return self._scan(eqn, p, ins)
        if name == "while":
            return self._while(eqn, p, ins)
        if name == "cond":
            return self._cond(eqn, p, ins)
        if name == "platform_index":  # lax.platform_dependent: the CPU's branch, else the default
            entries = list(p["platforms"])
            k = next((i for i, e in enumerate(entries) if e is not None and "cpu" in e),
                     next((i for i, e in enumerate(entries) if e is None), None))
            if k is None:
                self._unsupported(name, eqn, f"no branch for the CPU or a default among {entries}")
            v = self.int_scalar(k, np.int32)
            self._known_index[v.id] = k
            return [v]
        if name in ("empty", "empty2"):  # a cond branch's placeholder for another's residual
            shape = tuple(eqn.outvars[0].aval.shape)
            vid = self.emit(G.CONSTANT, value=0.0, shape=list(shape))
            return [_V(vid, shape, np.dtype(eqn.outvars[0].aval.dtype), F32)]
        if name == "shard_map":
            return self._shard_map(name, eqn, p, ins)
        if name in _MANUAL:
            return [self._manual(name, eqn, p, ins[0])]
        if name == "pmin":  # -pmax(-x); for integers ~pmax(~x), which cannot overflow
            x = ins[0]
            flip = self.bitwise_not if x.store in (I32, U32) else (lambda v: self.unary("neg", v))
            return [flip(self._manual("pmax", eqn, p, flip(x)))]
        if name == "axis_index":
            if not self._manual_depth:
                self._unsupported(name, eqn, "axis_index outside a shard_map body")
            axes = p["axis_name"] if isinstance(p["axis_name"], tuple) else (p["axis_name"],)
            vid = self.emit(G.AXIS_INDEX, axes=list(axes))
            return [_V(vid, (), np.int32, I32)]
        return None

    def _cond(self, eqn, p, ins):
        """lax.cond / lax.switch: every branch runs (they are pure) and the index selects each
        result (SELECT), as a vectorised cond does; the index is clamped as lax.switch clamps it."""
        index, operands = ins[0], ins[1:]
        branches = list(p["branches"])
        if index.id in self._known_index:  # (platform_index's): only that branch runs
            branches = [branches[min(max(self._known_index[index.id], 0), len(branches) - 1)]]
        results = []
        self._sites.append(self.where(eqn))
        try:
            for i, b in enumerate(branches):
                # (a host callback in the branch runs only when it is taken: _convert_callbacks)
                guard = [(index, i, len(branches), self._manual_depth > 0)] if len(branches) > 1 else []
                self._guards.extend(guard)
                try:
                    results.append(self.run(getattr(b, "jaxpr", b), list(getattr(b, "consts", [])), list(operands)))
                finally:
                    del self._guards[len(self._guards) - len(guard):]
        finally:
            self._sites.pop()
        outs = list(results[0])
        for i, branch in enumerate(results[1:], start=1):
            # index >= i picks branch i over those before it (the last wins: the clamp).
            pred = self.binary("ge", index, self.scalar(float(i)))
            for k, v in enumerate(branch):
                outs[k] = self._select("cond", eqn, [pred, outs[k], v], outs[k].dtype)
        return outs

    def _shard_map(self, name, eqn, p, ins):
        """jax.shard_map: operands laid out as in_specs enter the body as this device's blocks; the
        body runs per device with its collectives; results leave laid out as out_specs."""
        body = p["jaxpr"]
        body = getattr(body, "jaxpr", body)
        in_specs, out_specs = p["in_specs"], p["out_specs"]
        blocks = []
        for x, spec, var in zip(ins, in_specs, body.invars):
            entries = _sharding.normalize_spec(spec, self.mesh)
            vid = self.emit(G.SHARD_MAP_ENTER, [x], spec=_sharding.spec_to_proto(entries))
            blocks.append(_V(vid, tuple(var.aval.shape), x.dtype, x.store))
        self._sites.append(self.where(eqn))
        self._manual_depth += 1
        try:
            outs = self.run(body, [], blocks)
        finally:
            self._manual_depth -= 1
            self._sites.pop()
        results = []
        for v, spec, var in zip(outs, out_specs, eqn.outvars):
            entries = _sharding.normalize_spec(spec, self.mesh)
            vid = self.emit(G.SHARD_MAP_EXIT, [v], spec=_sharding.spec_to_proto(entries))
            self._layouts[vid] = entries
            results.append(_V(vid, tuple(var.aval.shape), v.dtype, v.store))
        return results

    def _manual(self, name, eqn, p, x):
        """A collective in a shard_map body, as ManualCollective (core/spmd/jit.h) runs it."""
        if not self._manual_depth:
            self._unsupported(name, eqn, "a collective outside a shard_map body")
        if p.get("axis_index_groups") is not None:
            self._unsupported(name, eqn, "axis_index_groups")
        axes = p.get("axes", p.get("axis_name"))
        axes = list(axes) if isinstance(axes, (tuple, list)) else [axes]
        fn, dim, dims, tiled = _MANUAL[name], 0, [], bool(p.get("tiled", False))
        if name == "all_gather":
            dim = int(p["all_gather_dimension"])
        elif name == "reduce_scatter":
            dim = int(p["scatter_dimension"])
        elif name == "all_to_all":
            dim, dims = int(p["split_axis"]), [int(p["concat_axis"])]
        elif name == "ppermute":
            dims = [int(i) for pair in p["perm"] for i in pair]
        shape = tuple(v.aval.shape for v in eqn.outvars)[0]
        if x.store in (I32, U32):
            if fn in ("psum", "pmax", "psum_scatter"):
                pass  # reduced in their integers (a sum wraps), as the collectives do
            else:
                # Moved, not computed: their bits travel as f32's and come back unchanged.
                store = x.store
                bits = _V(self.emit(G.BITCAST_CONVERT, [x], dtype=F32), x.shape, np.float32, F32)
                moved = self._manual(name, eqn, p, bits)
                return _V(self.emit(G.BITCAST_CONVERT, [moved], dtype=store), moved.shape, x.dtype, store)
        if x.store not in (F32, BF16, I32, U32):
            self._unsupported(name, eqn, f"a {x.dtype} operand")
        vid = self.emit(G.MANUAL_COLLECTIVE, [x], fn=fn, axes=axes, index=dim, dims=dims, value=1.0 if tiled else 0.0)
        return _V(vid, shape, x.dtype, x.store)

    def _while(self, eqn, p, ins):
        """lax.while_loop (and fori_loop with traced-free bounds) whose trip count is known while
        converting: the carries that start as constants and are updated from such carries alone
        (a counter) are evaluated on the client with JAX, the predicate counted down, and the
        body unrolled that many times. A predicate that reads a traced value: _while_masked."""
        from jax._src import core
        from jax._src.interpreters import partial_eval as pe

        cn, bn = int(p["cond_nconsts"]), int(p["body_nconsts"])
        cconsts, bconsts, init = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
        cond, body = p["cond_jaxpr"], p["body_jaxpr"]
        # invars: closed consts, consts, carries; evaluated below without printing
        cjaxpr = pe.convert_constvars_jaxpr(without_callbacks(cond.jaxpr))
        bjaxpr = pe.convert_constvars_jaxpr(without_callbacks(body.jaxpr))

        def concrete(vals):
            return [self._concrete.get(v.id) for v in vals]

        # known carries: a constant start, updated from known carries and constants only
        known = [v is not None for v in concrete(init)]
        bfixed = [True] * len(body.consts) + [v is not None for v in concrete(bconsts)]
        while True:
            deps = [pe.dce_jaxpr(bjaxpr, [j == k for j in range(len(init))])[1] for k in range(len(init))]
            still = [known[k] and all(ok for ok, used in zip(bfixed + known, deps[k]) if used)
                     for k in range(len(init))]
            if still == known:
                break
            known = still
        if tuple(cjaxpr.outvars[0].aval.shape) != ():  # a vmapped loop: a predicate per element
            return self._while_masked(eqn, cond, body, cconsts, bconsts, init)
        cfixed = [True] * len(cond.consts) + [v is not None for v in concrete(cconsts)]
        cused = pe.dce_jaxpr(cjaxpr, [True])[1]
        if not all(ok for ok, used in zip(cfixed + known, cused) if used):
            return self._while_masked(eqn, cond, body, cconsts, bconsts, init)
        kbody, kused = pe.dce_jaxpr(bjaxpr, known)
        kcond = pe.dce_jaxpr(cjaxpr, [True])[0]

        state = [np.asarray(v, dtype=a.aval.dtype) if v is not None else None
                 for v, a in zip(concrete(init), body.jaxpr.invars[bn:])]
        cargs = list(cond.consts) + concrete(cconsts)
        bargs = list(body.consts) + concrete(bconsts)
        trips = 0
        while True:
            cin = [a for a, used in zip(cargs + state, cused) if used]
            if not bool(core.eval_jaxpr(kcond, [], *cin)[0]):
                break
            trips += 1
            if trips > _MAX_WHILE_TRIPS:
                self._unsupported("while", eqn, f"more than {_MAX_WHILE_TRIPS} iterations to unroll")
            bin_ = [a for a, used in zip(bargs + state, kused) if used]
            new = iter(core.eval_jaxpr(kbody, [], *bin_))
            state = [np.asarray(next(new)) if k else None for k in known]
        carry = list(init)
        self._sites.append(self.where(eqn))
        try:
            for _ in range(trips):
                carry = self.run(body.jaxpr, list(body.consts), list(bconsts) + carry)
        finally:
            self._sites.pop()
        return carry

    def _while_masked(self, eqn, cond, body, cconsts, bconsts, init):
        """A while loop whose trip count depends on traced values: the body unrolled while_trips
        times, each iteration's carries kept only where the predicate held before it (SELECT); the
        predicate after the last must be false (a run-time check, meshrun._convert_callbacks),
        else the loop had not finished and the call fails. A vmapped loop's predicate has the
        batch's leading dims: it selects per element and the loop runs while any holds, as
        XLA's lowering of a batched while does."""
        carry = list(init)
        where = self.where(eqn)
        self._sites.append(where)
        try:
            for _ in range(self.while_trips):
                pred = self.run(cond.jaxpr, list(cond.consts), list(cconsts) + carry)[0]
                new = self.run(body.jaxpr, list(body.consts), list(bconsts) + carry)
                carry = [c if n.id == c.id else self._select(
                    "while", eqn, [self.broadcast(pred, c.shape, range(len(pred.shape))), c, n], _select_dtype(c))
                    for c, n in zip(carry, new)]
            pred = self.run(cond.jaxpr, list(cond.consts), list(cconsts) + carry)[0]
            if pred.shape:  # any element's
                pred = _V(self.emit(G.REDUCE, [pred], fn="max", dims=list(range(len(pred.shape)))), (), pred.dtype,
                          pred.store)
        finally:
            self._sites.pop()
        self.add_check(pred, f"lax.while_loop at {where} had not finished after the {self.while_trips} iterations "
                             "meshrun unrolls a loop whose trip count depends on traced values to, so its results "
                             "would be wrong; pass a larger cluster.jit(..., while_trips=N)")
        return carry

    def _scan(self, eqn, p, ins):
        """lax.scan unrolled: iteration i reads xs[i] (INDEX along the stacked dim 0) and the ys
        are stacked (STACK), as flax.linen.scan's layers are. A partitioned stacked dim is
        all_gathered for INDEX."""
        body, length = p["jaxpr"], int(p["length"])
        nc, ncarry = int(p["num_consts"]), int(p["num_carry"])
        consts, carry, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
        ys = [None] * length
        hints = self.out_hints(eqn)  # a stacked result's layout, less its stacked dim, per step
        hints = hints[:ncarry] + [h[1:] if h else None for h in hints[ncarry:]]
        order = range(length - 1, -1, -1) if p.get("reverse") else range(length)
        self._sites.append(self.where(eqn))
        try:
            for i in order:
                xi = [_V(self.emit(G.INDEX, [x], index=i), x.shape[1:], x.dtype, x.store) for x in xs]
                outs = self.run(body.jaxpr, list(body.consts), list(consts) + list(carry) + xi, hints)
                carry, ys[i] = outs[:ncarry], outs[ncarry:]
        finally:
            self._sites.pop()
        stacked = []
        for k in range(len(eqn.outvars) - ncarry):
            parts = [ys[i][k] for i in range(length)]
            if length == 0:
                self._unsupported("scan", eqn, "length 0")
            vid = self.emit(G.STACK, parts)
            stacked.append(_V(vid, (length,) + parts[0].shape, parts[0].dtype, parts[0].store))
        return list(carry) + stacked


def _select_dtype(v):
    """The dtype a SELECT between v and its next value runs in: integers (PRNG keys' words
    among them) as their store."""
    return _sharding.dtype_from_proto(v.store) if v.store in (I32, U32) else v.dtype


# The most iterations of a while loop unrolled into a program.
_MAX_WHILE_TRIPS = 1000
