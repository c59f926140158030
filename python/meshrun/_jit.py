"""cluster.jit: a JAX function traced to a jaxpr, converted into meshrun's GlobalProgram and
partitioned and run by the coordinator (mirrors jax.jit(fun, in_shardings=..., out_shardings=...,
static_argnums=..., donate_argnums=..., static_argnames=..., donate_argnames=...)).

On the first call for given argument shapes, dtypes and shardings, `fun` is traced with
jax.make_jaxpr on abstract values (nothing is computed locally) and converted (meshrun._convert);
the coordinator partitions the program (sharding propagation, with_sharding_constraint, the
collectives) and caches it by its bytes; later calls reuse both. Results are meshrun.Array pytrees
that stay on the cluster. A result with no out_sharding keeps the layout it is known to have (an
argument's, a shard_map's out_specs, a with_sharding_constraint's), and any other gets the layout
the coordinator's sharding propagation gives it (a sharded argument's carried through elementwise
ops, a dot's, ...), as XLA's propagation lays out jax.jit's results: a train step's new state
comes back laid out as its state argument, so it can be passed straight back in.
"""
import inspect
import time

import numpy as np

from meshrun import _array, _convert_callbacks, _sharding, _tree, errors
from meshrun._convert_random import is_key_dtype
from meshrun.v1 import coordinator_pb2


def _explicit_context_mesh(mesh):
    """The abstract mesh of the enclosing `jax.set_mesh` when it has the cluster's axis names and
    sizes and an Explicit axis; else None (Auto axes: values carry no layout in their types)."""
    import jax

    try:
        am = jax.sharding.get_abstract_mesh()
        axis_types = tuple(str(t) for t in getattr(am, "axis_types", ()))
        if am is None or am.empty or not any("Explicit" in t for t in axis_types):
            return None
        if tuple(am.axis_names) != tuple(mesh.axis_names) or dict(am.shape) != dict(mesh.shape):
            return None
        return am
    except AttributeError:  # pragma: no cover - an older jax without explicit sharding
        return None


def _as_tuple(x):
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


class _Compiled:
    def __init__(self, program, consts, out_treedef, out_avals, out_key_dtypes, out_entries, trace_seconds,
                 callbacks=(), checks=(), extra_results=0):
        self.program = program
        self.consts = consts  # meshrun.Arrays of the program's constants, held as long as it is
        self.out_treedef = out_treedef
        self.out_avals = out_avals
        self.out_key_dtypes = out_key_dtypes
        self.out_entries = out_entries
        self.trace_seconds = trace_seconds
        # jax.debug.print / jax.debug.callback sites; their values are the results after out_avals'
        self.callbacks = list(callbacks)
        self.checks = list(checks)  # run-time checks (a while loop past its unrolled iterations)
        self.extra_results = extra_results  # how many
        self.reuse = []  # per result: the argument whose place it takes (_reused_arguments), or None


def _reused_arguments(compiled, arrays, donated):
    """Per result of `compiled`: the position among `arrays` of the donated argument whose id it
    takes (the first unused one of its shape, dtype and sharding, as a TrainState is updated in
    place), or None. Shapes, dtypes, shardings and donation are the cache key's, so this holds for
    every call that finds `compiled`."""
    free = [i for i, d in enumerate(donated) if d]
    reuse = []
    for aval, entries in zip(compiled.out_avals, compiled.out_entries):
        if entries is None:  # laid out by propagation: known once the first call answers
            reuse.append(None)
            continue
        match = next((i for i in free if arrays[i].shape == tuple(aval.shape)
                      and arrays[i].dtype == np.dtype(aval.dtype) and arrays[i]._entries == tuple(entries)), None)
        if match is not None:
            free.remove(match)
        reuse.append(match)
    return reuse


class Jitted:
    """The callable cluster.jit returns. Arguments: pytrees of meshrun.Array (laid out as
    in_shardings when given; numpy arrays, scalars and typed PRNG keys (jax.random.key) are put
    on the cluster first, laid out so), positionally or by keyword as jax.jit takes them (a
    keyword argument of a positional parameter takes its position; keyword-only parameters and
    **kwargs are traced as keywords, and with in_shardings given only static ones are taken, as
    jax.jit refuses the others). Returns a pytree of meshrun.Array; typed key arguments and
    results are key arrays (meshrun.Array.key_dtype), traced as keys.
    `static_argnums` / `static_argnames`: hashable Python values the function is traced with
    (one trace per value). `donate_argnums` / `donate_argnames`: those arguments are consumed; a
    result of the same shape, dtype and sharding takes the first unused donated array's place on
    the cluster (a TrainState updated in place). Errors: UnsupportedPrimitiveError naming the
    primitive and the user's file:line; InvalidArgumentError for shardings over another mesh,
    shapes the mesh does not divide, an in_sharding or out_sharding with more entries than its
    value's rank (as jax.jit), an argument laid out other than its in_sharding, an
    argnames entry that is none of fun's parameters, or dynamic keyword arguments beside
    in_shardings; TypeError for arguments that fun's signature does not bind; the coordinator's
    errors as meshrun.errors. Not thread-safe.

    `while_trips` (meshrun's, default 16, 1..1000): a lax.while_loop whose trip count depends on
    traced values (a loop until convergence, jax.random.gamma's rejection sampling) has no loop op
    to run as: its body is unrolled this many times, each iteration applied only where the
    predicate still holds (as a vmapped while_loop runs), so the results are jax.jit's whenever
    the loop finishes within that many iterations; a call in which it does not raises
    FailedPreconditionError naming the loop's file:line (its results are deleted). Programs grow
    with it (nested loops multiply). jax.debug.print / jax.debug.callback run after the call
    (meshrun._convert_callbacks)."""

    def __init__(self, cluster, fun, in_shardings, out_shardings, static_argnums, donate_argnums,
                 static_argnames=(), donate_argnames=(), while_trips=None):
        from meshrun import _convert

        if while_trips is None:
            while_trips = _convert.DEFAULT_WHILE_TRIPS
        if isinstance(while_trips, bool) or not isinstance(while_trips, int) or not 1 <= while_trips <= 1000:
            raise errors.InvalidArgumentError(f"while_trips {while_trips!r}: expected an int in 1..1000")
        self._while_trips = while_trips
        self._cluster = cluster
        self._fun = fun
        self._in_shardings = in_shardings
        self._out_shardings = out_shardings
        try:
            self._signature = inspect.signature(fun)
        except (TypeError, ValueError):  # a callable without one takes positional arguments only
            self._signature = None
        static_pos, self._static_names = self._parameters(static_argnums, static_argnames, "static_argnames")
        self._static = tuple(sorted(static_pos))
        self._donate, self._donate_names = self._parameters(donate_argnums, donate_argnames, "donate_argnames")
        self._cache = {}
        self._layouts = {}  # (treedef, dynamic positions) -> _layout's
        self.last_trace_seconds = 0.0  # tracing plus conversion of the last cache miss
        self.last_collectives = []  # the partitioner's collectives, "psum(model)", ...
        self.last_program = None  # the GlobalProgram (program_pb2) the last call ran

    def _parameters(self, argnums, argnames, what):
        """(positions, names) of the parameters that `argnums` and `argnames` select, as jax.jit
        resolves them: a positional parameter by either (its name also selects it when it is passed
        by keyword), a keyword-only one, or any name when fun takes **kwargs, by name. Errors:
        InvalidArgumentError naming a name that is none of fun's parameters."""
        params = list(self._signature.parameters.values()) if self._signature is not None else []
        positional = [q.name for q in params if q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD)]
        keyword = [q.name for q in params if q.kind == q.KEYWORD_ONLY]
        var_keyword = any(q.kind == q.VAR_KEYWORD for q in params)
        positions = set(_as_tuple(argnums))
        names = {positional[i] for i in positions if 0 <= i < len(positional)}
        for name in _as_tuple(argnames):
            if name in positional:
                positions.add(positional.index(name))
            elif name not in keyword and not var_keyword:
                raise errors.InvalidArgumentError(
                    f"{what}: '{name}' is not a parameter of {getattr(self._fun, '__name__', 'fun')}"
                    f" (its parameters: {', '.join(positional + keyword) or 'none known'})")
            names.add(name)
        return positions, names

    def _bind(self, args, kwargs):
        """(positional, keyword) arguments: a keyword argument of a positional parameter takes its
        position (as jax.jit binds them); keyword-only ones, **kwargs' and those after a parameter
        left to its default stay keywords."""
        if not kwargs or self._signature is None:
            return args, kwargs
        bound = self._signature.bind(*args, **kwargs)
        return bound.args, bound.kwargs

    def _split(self, args, kwargs):
        """(static values, positions of the dynamic arguments, static keywords, dynamic ones)."""
        static_vals = tuple(args[i] for i in self._static if i < len(args))
        dyn_pos = [i for i in range(len(args)) if i not in self._static]
        static_kw = tuple(sorted((k, v) for k, v in kwargs.items() if k in self._static_names))
        dyn_kw = {k: v for k, v in kwargs.items() if k not in self._static_names}
        if dyn_kw and self._in_shardings is not None:
            raise errors.InvalidArgumentError(
                f"keyword arguments {sorted(dyn_kw)} with in_shardings given: jax.jit takes none either "
                "('pjit does not support kwargs when in_shardings is specified'); pass them by position, "
                "or make them static_argnames")
        return static_vals, dyn_pos, static_kw, dyn_kw

    def __call__(self, *args, **kwargs):
        import jax

        args, kwargs = self._bind(args, kwargs)
        static_vals, dyn_pos, static_kw, dyn_kw = self._split(args, kwargs)
        dyn = (tuple(args[i] for i in dyn_pos), dyn_kw)
        leaves, treedef = jax.tree_util.tree_flatten(dyn)
        specs, normalized, donated = self._layout(treedef, dyn, dyn_pos)
        arrays = []
        for leaf, spec, want in zip(leaves, specs, normalized):
            if isinstance(leaf, _array.Array):
                leaf._check_live()
                if want is not None and want != leaf._entries:
                    raise errors.InvalidArgumentError(
                        f"argument array '{leaf.id}' is laid out as {leaf.sharding.spec} but its "
                        f"in_sharding is {spec}: device_put it with that sharding first")
                arrays.append(leaf)
            else:
                arrays.append(self._cluster._put_value(leaf, spec))
        key = (static_vals, len(args), static_kw, treedef,
               tuple((a.shape, a.dtype, a._entries, None if a.key_dtype is None else str(a.key_dtype))
                     for a in arrays), donated)
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self._compile(static_vals, dyn_pos, static_kw, treedef, arrays, specs, len(args))
            compiled.reuse = _reused_arguments(compiled, arrays, donated)
            self._cache[key] = compiled
        return self._run(compiled, arrays, donated)

    def _layout(self, treedef, dyn, dyn_pos):
        """What a call's structure alone decides, worked out once per structure: each leaf's
        in_sharding (None: none given), that sharding over the cluster's mesh, and whether the
        leaf is donated."""
        import jax

        cache_key = (treedef, tuple(dyn_pos))
        layout = self._layouts.get(cache_key)
        if layout is not None:
            return layout
        dyn_args, dyn_kw = dyn
        if self._in_shardings is None:
            specs = [None] * treedef.num_leaves
        else:  # _split refused dynamic keywords
            prefix = self._in_shardings
            if not _tree._is_spec_leaf(prefix):
                prefix = tuple(prefix)
                if len(prefix) != len(dyn_args):
                    raise errors.InvalidArgumentError(
                        f"in_shardings has {len(prefix)} entries for {len(dyn_args)} non-static arguments")
            specs = _tree.flat_specs(prefix, dyn_args)
        mesh = self._cluster.mesh
        normalized = [None if s is None else _sharding.normalize_spec(s, mesh) for s in specs]
        donated = []
        for pos, arg in zip(dyn_pos, dyn_args):
            donated += [pos in self._donate] * len(jax.tree_util.tree_leaves(arg))
        for name in sorted(dyn_kw):  # a dict's leaves go in its sorted keys' order
            donated += [name in self._donate_names] * len(jax.tree_util.tree_leaves(dyn_kw[name]))
        layout = (specs, normalized, tuple(donated))
        self._layouts[cache_key] = layout
        return layout

    def _compile(self, static_vals, dyn_pos, static_kw, treedef, arrays, specs, nargs):
        import jax

        from meshrun import _convert

        start = time.perf_counter()

        def flat_fun(dyn_args, dyn_kw):
            full = [None] * nargs
            for i, v in zip((i for i in self._static if i < nargs), static_vals):
                full[i] = v
            for i, v in zip(dyn_pos, dyn_args):
                full[i] = v
            return self._fun(*full, **dict(static_kw), **dyn_kw)

        # A typed key travels as its u32 words and the function is traced with the key itself, as
        # jax.jit traces it. Under a mesh with Explicit axes (jax.make_mesh's default) the values
        # carry their layouts in their types, as jax.jit's arguments do (shard_map checks them).
        explicit = _explicit_context_mesh(self._cluster.mesh)

        def aval(a, spec):
            shape, dtype, entries = a.shape, a.dtype, list(a._entries)
            if a.key_dtype is not None:
                shape, dtype, entries = a.shape[:-1], a.key_dtype, entries[:len(a.shape) - 1]
            if spec is not None:  # once per compiled shape, as jax.jit checks when it traces
                _sharding.check_rank(spec, shape, f"in_sharding of argument array '{a.id}'")
            if explicit is None:
                return jax.ShapeDtypeStruct(shape, dtype)
            spec = _sharding.to_partition_spec(entries)
            return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(explicit, spec))

        avals = [aval(a, spec) for a, spec in zip(arrays, specs)]
        dyn_avals = jax.tree_util.tree_unflatten(treedef, avals)
        closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*dyn_avals)
        out_avals, out_treedef = jax.tree_util.tree_flatten(out_shape)
        # A typed PRNG key result is held as its u32 words (jax.random.key_data's shape), an Array
        # that knows its key dtype.
        out_key_dtypes = [a.dtype if is_key_dtype(a.dtype) else None for a in out_avals]
        out_avals = [jax.ShapeDtypeStruct(*_convert.aval_of(a)) for a in out_avals]
        mesh = self._cluster.mesh
        if self._out_shardings is None:
            out_entries = [None for _ in out_avals]  # the converter's known layouts, or propagated
        else:
            out_specs = _tree.flat_specs(self._out_shardings, out_shape)
            for i, (s, a) in enumerate(zip(out_specs, jax.tree_util.tree_leaves(out_shape))):
                _sharding.check_rank(s, a.shape, f"out_shardings of result {i}")
            out_entries = [_sharding.normalize_spec(s, mesh) for s in out_specs]
        conv = _convert.Converter(mesh, self._while_trips)
        program, consts = conv.convert(closed, [(a.shape, a.dtype, a._entries) for a in arrays], out_entries)
        out_entries = conv.out_entries
        return _Compiled(program, [self._cluster._put(c, _sharding.to_partition_spec(e)) for c, e in consts], out_treedef, out_avals, out_key_dtypes, out_entries,
                         time.perf_counter() - start, conv.callbacks, conv.checks, len(conv.extra_results))

    def _run(self, compiled, arrays, donated):
        import jax

        self.last_trace_seconds = compiled.trace_seconds
        self.last_program = compiled.program
        if not compiled.out_avals and not compiled.extra_results:
            # Nothing to compute and no effect to run (a function returning None or an empty
            # pytree): jax.jit returns the empty result too, and the cluster runs no empty program.
            self.last_collectives = []
            return jax.tree_util.tree_unflatten(compiled.out_treedef, [])
        req = coordinator_pb2.JitRequest(program=compiled.program)
        req.input_ids.extend([a.id for a in arrays + compiled.consts])
        req.donate_argnums.extend(i for i, d in enumerate(donated) if d)
        req.output_ids.extend("" if i is None else arrays[i].id for i in compiled.reuse)
        if req.output_ids:
            req.output_ids.extend("" for _ in range(compiled.extra_results))
        try:
            resp = self._cluster._call("Jit", req, timeout=max(self._cluster.timeout, 600.0))
        except errors.MeshrunError as e:
            if "are consumed" in str(e):  # a failed run consumes its donated arrays (jax.jit's rule)
                for a, d in zip(arrays, donated):
                    a._deleted = a._deleted or d
            raise
        self.last_collectives = list(resp.collectives)
        if any(e is None for e in compiled.out_entries):  # the layouts propagation chose, the same every call
            compiled.out_entries = [_sharding.spec_from_proto(info.sharding.spec) if e is None else e
                                    for e, info in zip(compiled.out_entries, resp.outputs)]
            compiled.reuse = _reused_arguments(compiled, arrays, donated)
        for a, d in zip(arrays, donated):
            if d:
                a._deleted = True  # consumed, as jax.jit's donated buffers (the cluster dropped them)
        outs = [_array.Array(self._cluster, info, np.bool_ if np.dtype(aval.dtype) == np.bool_ else None, k)
                for info, aval, k in zip(resp.outputs, compiled.out_avals, compiled.out_key_dtypes)]
        extra = [_array.Array(self._cluster, info) for info in resp.outputs[len(compiled.out_avals):]]
        if extra:
            try:
                _convert_callbacks.after_call(compiled.callbacks, compiled.checks, extra)
            except BaseException:
                for a in outs:  # the call raises, as jax.jit's does when a callback fails
                    if not any(a.id == x.id and not x._deleted for x in arrays):
                        a.delete()
                raise
        return jax.tree_util.tree_unflatten(compiled.out_treedef, outs)
