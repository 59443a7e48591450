"""How a tuned :class:`~aitune.torch.module.Module` answers a call: which backend serves it, or why eager does.

:class:`Dispatch` owns everything a TUNED wrapper needs per call — its :class:`TunedGraph` per graph (backend,
run-time guard), the routes from a call's shape to a graph (the fast path), the weight watch, the counters
of :attr:`Module.stats`. ``Module`` makes a new one whenever its backends change as a whole (tuning,
loading, re-recording), so what one caches lives and dies with it; a single graph's backend or guard
changes through :meth:`TunedGraph.set_backend` / :attr:`TunedGraph.guard`, which the routes read through.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import torch

from aitune.errors import BackendRuntimeError
from aitune.torch.backend.accepted import ValueGate
from aitune.torch.backend.base import Backend
from aitune.torch.backend.eager import TorchEagerBackend
from aitune.torch.check.baked_state import BakedState, Policy
from aitune.torch.check.guard import StateWatch
from aitune.torch.check.native_watch import call_key_function
from aitune.torch.record.llm import (
    REWINDABLE_LAYERS,
    PhaseCall,
    cache_advanced,
    counter_snapshot,
    llm_phase,
    phase_call,
    rewind_cache,
    rewindable,
    slow_route_facts,
)
from aitune.torch.record.pytree import LEAF, tree_flatten, tree_unflatten
from aitune.torch.record.samples import flat_call_key, graph_device, make_graph_key, on_host

logger = logging.getLogger(__name__)


class TunedGraph:
    """One tuned graph, the backend that serves it and its run-time guard, with what the per-call path needs
    to know about them computed once (:meth:`set_backend`).

    Args:
        graph: the tuned :class:`~aitune.torch.record.samples.GraphSpec`.
        backend: the backend built (or restored) for it.
    """

    __slots__ = ("graph", "backend", "guard", "passthrough", "bakes_weights", "training", "checks_inputs",
                 "values", "drops_state", "late_state")

    def __init__(self, graph, backend) -> None:
        self.graph = graph
        self.guard = None  # a RuntimeGuard (aitune.torch.check.guard), or None: no checks against eager
        self.training = bool(graph.training)
        self.set_backend(backend)

    def set_backend(self, backend) -> None:
        """Serve the graph with ``backend`` from the next call on."""
        self.backend = backend
        self.passthrough = bool(getattr(backend, "passthrough", False))  # plain eager: nothing to route around
        self.bakes_weights = bool(backend.bakes_weights)
        # a copy of the module (an exported graph, a frozen compile) would drop the state forward updates
        self.drops_state = bool(self.graph.stateful) and bool(getattr(backend, "bakes_module_state", False))
        # NOTE [module check after launch]: is the module's own state watched for this backend, and may it be
        # checked after the backend ran?
        self.late_state = (Policy(backend).module and bool(getattr(backend, "runs_own_copy", False))
                           and not self.graph.mutated_inputs and not self.graph.stateful)
        # Backend.rejects accepts everything; only a backend that overrides it is asked per call.
        self.checks_inputs = getattr(backend.rejects, "__func__", None) is not Backend.rejects
        # values the recorded calls never had (NOTE [value gate] in aitune/torch/backend/accepted.py)
        self.values = None if self.passthrough else ValueGate.for_graph(self.graph, bool(backend.is_quantizing))

    def refusal(self, module: torch.nn.Module) -> tuple[Any, str] | None:
        """Why this graph's artifact may not serve a call of ``module`` now, as ``(fallback key, message)``, or
        None when it may. Every call routed here asks, before the inputs are looked at: what the artifact baked
        in at build time and the module may have changed since belongs here (today: the training flag).

        Args:
            module: the wrapped (original) module.
        """
        if module.training != self.training:
            return "training", (f"module.training is {module.training} but it was tuned with {self.training}: "
                                "eager runs")
        if self.drops_state:
            return "stateful", (f"{self.graph.stateful_reason or 'forward changes the module state'}, which "
                                f"{self.backend.name}'s copy of the module would not: eager runs")
        return None


class Dispatch:
    """A tuned module's calls: routes each to its graph's backend (or eager, saying why), with the guard,
    the weight watch and the run-time counters.

    Args:
        module: the wrapped (original) module: eager runs it.
        name: the wrapper's name (for messages).
        signature: the recorder's :class:`~aitune.torch.record.signature.CallSignature` (normalises calls).
        entries: ``(GraphSpec, Backend)`` per tuned graph; empty for a module that is not tuned.
        eager_fallback_error: when set, calls the backends do not take raise
            :class:`~aitune.errors.BackendRuntimeError` with this reason instead of running eagerly.
    """

    __slots__ = ("module", "name", "signature", "graphs", "_by_key", "_by_flat_key", "_by_id", "_routes", "watch",
                 "fallbacks", "backend_calls", "_warned", "eager_fallback_error", "baked", "phases",
                 "_phase_routes", "_phase_plans", "_native_key")

    def __init__(self, module: torch.nn.Module, name: str, signature, entries=(),
                 eager_fallback_error: str | None = None) -> None:
        self.module = module
        self.name = name
        self.signature = signature
        self.graphs: list[TunedGraph] = [TunedGraph(graph, backend) for graph, backend in entries]
        self._by_key = {tuned.graph.key: tuned for tuned in self.graphs}
        self.phases = any(tuned.graph.phase is not None for tuned in self.graphs)  # route by LLM phase too
        # PhaseCall.route -> (TunedGraph, top-level leaf offsets, leaf count, any top-level tensor on the CPU)
        self._phase_routes: dict = {}
        self._phase_plans: dict = {}  # keyword names of a phase call -> CallSignature.plan (NOTE [phase fast path])
        self._by_id = {id(tuned.graph): tuned for tuned in self.graphs}
        self._by_flat_key = {}  # flat key of a graph's first sample -> TunedGraph (no flattening for such calls)
        for tuned in self.graphs:
            if tuned.graph.samples and tuned.graph.phase is None:  # a phase is read from values, not the key
                sample = tuned.graph.samples[0]
                key = flat_call_key(sample.args, sample.kwargs)
                if key is not None:
                    self._by_flat_key[key] = tuned
        self._routes: dict = {}  # raw call key -> (TunedGraph, plan, on_host, quiet) (NOTE [dispatch fast path])
        # NOTE [native call key]: the extension's call_key (aitune/torch/check/native_watch.cpp) keys a flat call in
        # one C call: each tensor's dtype, rank and device, and whether it is contiguous with elements ("regular":
        # a route whose key says so for every tensor skips the per-call loop over them). Where it does not key a
        # call (NotImplemented: a tensor subclass that dispatches to Python, sparse, nested) or the extension is
        # unavailable, flat_call_key does. _by_flat_key keeps flat_call_key's keys (made rarely: here and when a
        # route is made).
        self._native_key = call_key_function() if self.graphs else None
        self.watch: StateWatch | None = None  # set by watch_state when a backend bakes the weights in
        self.baked: BakedState | None = None  # what the backends took for granted (set by watch_state)
        self.fallbacks: dict[str, int] = {}  # reason kind -> calls that ran eager for it
        self.backend_calls = 0  # calls answered by a tuned (non-eager) backend
        self._warned: set = set()
        self.eager_fallback_error = eager_fallback_error

    # ---- the tuned graphs
    def find(self, graph) -> TunedGraph | None:
        """The entry of ``graph`` (the GraphSpec object itself), or None when it is not tuned here."""
        return self._by_id.get(id(graph))

    def backends(self) -> list[tuple[Any, Any]]:
        """``(GraphSpec, Backend)`` per tuned graph, in the order given."""
        return [(tuned.graph, tuned.backend) for tuned in self.graphs]

    def stale_weights(self) -> str | None:
        """What changed in the module's weights since a backend baked them in (every check made now, values
        edited through ``.data`` included where the sampled values show it); else None. A change found here is
        found for the calls too: they run eager from now on, as they would once the per-call watch saw it."""
        changed = self.watch.changed_now() if self.watch is not None else None
        return changed or (self.baked.values_changed() if self.baked is not None and self.watch is not None else None)

    def guards(self) -> dict[str, Any]:
        """The armed run-time guards by graph name."""
        return {tuned.graph.name: tuned.guard for tuned in self.graphs if tuned.guard is not None}

    def watch_state(self, stale: str | None = None) -> None:
        """Watch the module's weights when a tuned backend baked them in (``stale``: they already differ, for
        this reason); a watch already stale stays stale."""
        bakes = any(tuned.backend.bakes_weights and not tuned.graph.stateful for tuned in self.graphs)
        previous = self.watch.reason if self.watch is not None else None
        self.watch = StateWatch(self.module) if bakes or stale else None
        if self.watch is not None:
            self.watch.reason = stale or previous
        stale_values = None
        if self.baked is not None:  # a .data edit found (or about to be) stays found
            stale_values = self.baked.values_changed()
        self.baked = BakedState(self.module) if self.graphs else None
        if self.baked is not None:
            self.baked.stale = stale_values

    def release(self) -> None:
        """Release every backend (device memory, CUDA graphs); releasing never raises."""
        for tuned in self.graphs:
            try:
                tuned.backend.deactivate()
            except Exception:  # noqa: BLE001 - releasing must not fail the new state
                logger.debug("deactivating %s failed", tuned.backend, exc_info=True)

    def replace_backend(self, tuned: TunedGraph, replacement) -> None:
        """Serve ``tuned``'s graph with ``replacement`` (None: eager) from now on; the retired backend is released."""
        graph = tuned.graph
        if replacement is None:
            replacement = TorchEagerBackend.from_checkpoint(Path(tempfile.gettempdir()),
                                                            TorchEagerBackend.config_class(),
                                                            {}, self.module, graph, graph_device(graph))
        tuned.backend.deactivate()
        tuned.set_backend(replacement)
        replacement.activate()

    # ---- calls
    def call(self, args: tuple, kwargs: dict):
        """Answer one call of the tuned module (its arguments as given).

        Eager runs the call as given, not its canonical form: forward(-pre) hooks of the wrapped module see the
        positional arguments the caller passed (NOTE [calls as given] in aitune/torch/record/samples.py)."""
        given = args, kwargs
        # NOTE [dispatch fast path]: a call whose arguments are all tensors or plain constants (no nesting) is keyed
        # as given, before normalisation, by dtype/rank/device and constant values; the key finds the TunedGraph
        # (whose per-call facts were computed once) and the normalising plan made from the first such call. The
        # host work before the backend's launch is then a few µs, which counts in the GPU latency of every call
        # (the wrapped module should stay within 3 % of the backend called directly: benchmarks/gpu_wrapper_cost.py).
        phase = flat = None
        host_values = True  # may the call hold CPU tensors the value gate reads (NOTE [value gate])?
        # NOTE [phase fast path]: a decoder inside generate is called with the same keywords at every step, and one
        # of them is a key/value cache, so the flat key above never applies. The keyword names of such a call
        # find the normalising plan made from the first one (no flat key tried, no binding); the phase and the
        # cache's fill are then read per call (phase_call), and the route from them.
        plan = self._phase_plans.get(tuple(kwargs)) if self.phases and not args else None
        if plan is not None and (phase := phase_call(*(normal := plan(args, kwargs)), read_device=False)) is not None:
            args, kwargs = normal
            tuned, leaves, checked, phase, host_values = self._phase_route(phase, args, kwargs)
        else:
            native = self._native_key
            raw_key = native(args, kwargs) if native is not None else NotImplemented
            keyed = raw_key is not NotImplemented
            if not keyed:
                raw_key = flat_call_key(args, kwargs)
            route = self._routes.get(raw_key) if raw_key is not None else None
            if route is not None:
                tuned, normalize, host_values, quiet = route
                args, kwargs = normalize(args, kwargs)
                leaves = checked = flat = [*args, *kwargs.values()]  # every leaf (tensors and plain constants)
                if quiet:  # (every tensor contiguous with elements: the loop below has nothing to find)
                    checked = ()
            else:
                raw_args, raw_kwargs = args, kwargs
                args, kwargs = self.signature.normalize(args, kwargs)
                if self.phases and (phase := phase_call(args, kwargs, read_device=False)) is not None:
                    tuned, leaves, checked, phase, host_values = self._phase_route(phase, args, kwargs)
                    if not raw_args and tuple(raw_kwargs) not in self._phase_plans:
                        self._phase_plans[tuple(raw_kwargs)] = self.signature.plan(raw_args, raw_kwargs)
                else:
                    tuned, leaves = self._route(raw_key, keyed, args, kwargs, raw_args, raw_kwargs)
                    checked = leaves
                    if tuned is not None and tuned.graph.phase is not None:  # a phase call, other nested inputs
                        phase = slow_route_facts(args, kwargs, tuned.graph.phase)
        if tuned is None:
            return self.eager(*given, "graph", "a call whose input structure, constants or dtypes were "
                                                     "never recorded runs eager")
        backend = tuned.backend
        # NOTE [what a backend follows] in aitune/torch/check/baked_state.py: grad mode, the caller's autocast,
        # hooks, submodules' flags and attributes, weights edited through .data.
        # NOTE [module check after launch]: for a graph that changes neither its inputs nor the module, the module's
        # own state (BakedState's kinds `module` and `stale`) is checked after the backend was launched, as the
        # weights are (NOTE [stale check after launch]): on a GPU that overlaps the kernels (~1-1.25 % of a ResNet-50
        # b1 call on the H200). Only for a backend that runs its own artifact or copy (Backend.runs_own_copy: a
        # CUDA-graph capture or a compile of the live module would keep what it saw), and not where eager may not
        # run. A call found differing discards the backend's output and returns eager's; while the module
        # differs, calls check before the launch again (no backend run wasted per call).
        late = (tuned.late_state and self.baked is not None and not self.baked.found
                and self.eager_fallback_error is None)
        differs = self.baked.differs(backend, args, kwargs, flat, not late) if self.baked is not None else None
        if differs is not None:
            if differs[0] == "grad" and self.eager_fallback_error is not None:
                # eager may not run here (weights moved to 'meta', or other weights than the artifacts'): the
                # backend answers as at tuning, without autograd, and says so once
                if ("grad", "served") not in self._warned:
                    self._warned.add(("grad", "served"))
                    logger.warning("%s: %s — but eager may not run here (%s); the tuned backend answers without "
                                   "autograd", self.name, differs[1], self.eager_fallback_error)
            else:
                return self.eager(*given, *differs)
        if tuned.passthrough:  # plain eager: the module itself, on the call as given
            return self.run_eager(*given)
        watch = self.watch if tuned.bakes_weights else None
        if watch is not None and watch.reason is not None:
            return self._stale(*given, backend)
        if self.module.training != tuned.training or tuned.drops_state:  # (what refusal() reads, without a call)
            refusal = tuned.refusal(self.module)
            if refusal is not None:
                return self.eager(*given, *refusal)
        graph = tuned.graph
        if phase is not None and phase.overflows:
            return self.eager(*given, ("values", graph.name), f"{graph.name}: the call adds {phase.query} "
                                                                    f"position(s) to a key/value cache holding "
                                                                    f"{phase.cached} of {phase.capacity}")
        contiguous = True
        for leaf in checked:
            if isinstance(leaf, torch.Tensor):
                if leaf.numel() == 0:
                    # NOTE [zero-size inputs]: compiled kernels and exported graphs mishandle empty batches and
                    # empty spatial dims (microsoft/onnxruntime#13626, pytorch/pytorch#197095); eager gives the
                    # right empty result or the right error.
                    return self.eager(*given, "empty", "zero-size inputs run eager")
                if contiguous and not leaf.is_contiguous():
                    contiguous = False
        if tuned.checks_inputs:
            rejection = backend.rejects(leaves)
            if rejection is not None:
                return self.eager(*given, ("range", graph.name), f"{graph.name}: {rejection} ({backend.name}'s "
                                                                       "accepted inputs); such calls run eager")
        if tuned.values is not None and host_values:
            rejection = tuned.values.rejects(leaves, phase.capacity if phase is not None else None)
            if rejection is not None:
                return self.eager(*given, ("values", graph.name), f"{graph.name}: {rejection}; such calls "
                                                                        f"run eager instead of {backend.name}")
        if not contiguous:
            # NOTE [non-contiguous inputs]: some artifacts assume contiguous strides (pytorch/pytorch#122784).
            if graph.mutated_inputs:
                return self.eager(*given, "strides", "non-contiguous inputs to a module that mutates "
                                                           "its inputs run eager")
            args, kwargs = _contiguous((args, kwargs))
        guard = tuned.guard
        # a cache advances its counters in place: an eager rerun after the backend must start where it started
        cache = kwargs.get(graph.cache_input) if phase is not None and graph.cache_input is not None else None
        rewind = before = None  # where to put the counters back; the first layer's count before the call
        if cache is not None:
            if phase.cached is not None:
                rewind = before = phase.cached
            else:
                rewind = counter_snapshot(cache)
                before = rewind if isinstance(rewind, torch.Tensor) else None
        # NOTE [guard after launch]: whether the guard checks this call against eager (RuntimeGuard.due: its shapes
        # and a count) is asked after the backend's launch, once the weight watch and the module check found
        # nothing; the check then compares the output the call already has. A check that raises (eager, the copy
        # of the output) sends the call to eager, as a check before the launch did. Not for a guard whose serving
        # p50 is noisy (its check times the backend's own run: NOTE [guard cost]), nor for a call that advances a
        # key/value cache (an eager rerun must start where the backend started; guard_for gives such a graph, one
        # that changes its inputs, no guard: kept as a safeguard).
        late_guard = guard is not None and cache is None and not guard.serving_noisy
        try:
            if guard is not None and not late_guard and guard.due(leaves):
                if watch is not None and watch.changed() is not None:
                    return self._stale(*given, backend)
                if late and (differs := self.baked.module_differs(backend)) is not None:
                    guard.undo_due(leaves)  # (no check ran: a shape new to the guard stays new)
                    return self.eager(*given, *differs)  # (eager's module is not the one the backend baked)
                return self._guarded_call(tuned, guard, args, kwargs, leaves)
            output = backend.run(args, kwargs, accepted=True)
        except Exception as exc:  # noqa: BLE001 - a crashing backend never takes the caller down
            if cache is not None:
                self._put_back(graph, backend, cache, rewind, f"raised {type(exc).__name__}: {exc}", exc, before)
            if watch is not None and watch.changed() is not None:
                return self._stale(*given, backend)
            if late and (differs := self.baked.module_differs(backend)) is not None:
                return self.eager(*given, *differs)
            return self.eager(*given, ("error", graph.name),
                              f"backend {backend.name} raised {type(exc).__name__}: {exc}; running eager instead")
        # NOTE [stale check after launch]: a backend that bakes the weights in never reads the user's tensors, so
        # whether they changed since tuning (StateWatch: tens of ns per parameter/buffer, tens of µs for a
        # ResNet-50) is checked after the backend was called: on a GPU that host work then overlaps the
        # kernels just launched instead of delaying them (benchmarks/gpu_wrapper_cost.py). A stale call's output is
        # discarded and eager's returned: the same result as checking first, at the cost of one wasted call.
        if watch is not None and watch.changed() is not None:
            if cache is not None:
                self._put_back(graph, backend, cache, rewind, "served weights that changed since tuning")
            return self._stale(*given, backend)
        if late and (differs := self.baked.module_differs(backend)) is not None:
            return self.eager(*given, *differs)
        if late_guard and guard.due(leaves):
            try:
                return self._guarded_call(tuned, guard, args, kwargs, leaves, (output,))
            except Exception as exc:  # noqa: BLE001 - eager (or the copy) raised in the check: eager, as before
                guard.undo_due(leaves)
                return self.eager(*given, ("error", graph.name), f"the run-time check of {backend.name} against "
                                  f"eager raised {type(exc).__name__}: {exc}; running eager instead")
        self.backend_calls += 1
        return output

    def _put_back(self, graph, backend, cache, rewind, what: str, cause: Exception | None = None,
                  before=None) -> None:
        """Set a key/value cache the backend may have advanced back where the call started (``rewind``: the fill
        read before the call, or a :func:`counter_snapshot`), so eager can rerun the call. A cache
        :func:`rewind_cache` cannot put back is left as it is where the backend raised before its first layer
        counted the step (:func:`cache_advanced` against ``before``), or where that cannot be told: eager then
        reruns the call, as after any failed call.

        Raises:
            BackendRuntimeError: the cache holds state :func:`rewind_cache` cannot put back (:func:`rewindable`)
                and the step reached it (a stale output, or a failed call whose first layer counted it): an eager
                rerun would apply the step twice."""
        if rewindable(cache):
            if rewind is not None:  # (None: layers without counters, positions passed in: a rerun rewrites them)
                rewind_cache(cache, rewind)
            return
        if cause is not None and not cache_advanced(cache, before):
            return
        layers = sorted({type(layer).__name__ for layer in getattr(cache, "layers", ())}) or [type(cache).__name__]
        raise BackendRuntimeError(
            f"{self.name}/{graph.name}: backend {backend.name} {what}, after it may have advanced the key/value "
            f"cache ({', '.join(layers)}), whose state aitune can put back only for {' and '.join(REWINDABLE_LAYERS)}"
            " layers (a sliding window not yet rolled): rerunning the call eagerly would apply this step twice. To "
            f"serve such a cache, tune this phase with eager: "
            f"strategies={{{graph.name!r}: ait.OneBackendStrategy(TorchEagerBackend())}}") from cause

    def _route(self, raw_key, keyed: bool, args, kwargs, raw_args, raw_kwargs) -> tuple[TunedGraph | None, list]:
        """The graph of a normalised call (None: no tuned graph takes it) and the call's flattened leaves. A flat
        call's route (its leaves are its canonical args and kwargs values in order) is kept under ``raw_key``,
        so the next call shaped the same way finds it without flattening, and normalises it with the plan made
        from this call (``raw_args``/``raw_kwargs``: the call as given). ``keyed``: ``raw_key`` is the extension's
        (NOTE [native call key]), which tells a contiguous tensor with elements from others: such a route's calls
        skip the loop over their tensors."""
        fast_key = flat_call_key(args, kwargs)
        tuned = self._by_flat_key.get(fast_key) if fast_key is not None else None
        if tuned is None:
            leaves, spec = tree_flatten((args, kwargs))
            return self._by_key.get(make_graph_key(leaves, spec, llm_phase(args, kwargs) if self.phases else None)), \
                leaves
        plan = self.signature.plan(raw_args, raw_kwargs) if raw_key is not None else None
        if plan is not None:  # (None: positional-only parameters or *args: such calls take the general path)
            leaves = (*args, *kwargs.values())
            quiet = keyed and all(leaf.numel() != 0 and leaf.is_contiguous() for leaf in leaves
                                  if isinstance(leaf, torch.Tensor))
            self._routes[raw_key] = (tuned, plan, on_host(leaves), quiet)
        return tuned, [*args, *kwargs.values()]

    def _phase_route(self, phase: PhaseCall, args, kwargs) -> tuple[TunedGraph | None, list, list, PhaseCall, bool]:
        """The graph of a decoder call with a key/value cache, found by :attr:`PhaseCall.route` (the cache is
        flattened once per route, not per call); the call's leaves with only its top-level tensors filled in
        (None elsewhere), which the value gate reads by index; those top-level tensors alone, which the
        per-call checks walk; the call's :class:`PhaseCall`, read from the device where the phase assumed
        without reading it finds no graph (NOTE [decode without a device read] in aitune/torch/record/llm.py); and
        whether any top-level tensor is on the CPU: the value gate reads only those, so a route with none (a
        decode step on the GPU; the route's key holds each tensor's device index) skips it. The cache's own tensors are
        the artifact's business and its fill is checked from :class:`PhaseCall` (NOTE [caches as inputs])."""
        entry = self._phase_routes.get(phase.route)
        if entry is None:
            leaves, spec = tree_flatten((args, kwargs))
            tuned = self._by_key.get(make_graph_key(leaves, spec, phase.phase))
            offsets, offset = {}, 0
            for name, child in zip(spec.children[1].context, spec.children[1].children):
                if child.kind == LEAF:
                    offsets[name] = offset
                offset += child.num_leaves
            entry = self._phase_routes[phase.route] = (tuned, offsets, offset, on_host(map(kwargs.get, offsets)))
        tuned, offsets, count, host = entry
        if tuned is None and phase.assumed:  # no graph for the phase assumed: read it
            read = phase_call(args, kwargs)
            if read is not None and read.phase != phase.phase:
                return self._phase_route(read, args, kwargs)
        leaves = [None] * count
        top = []
        for name, index in offsets.items():
            leaves[index] = value = kwargs[name]
            top.append(value)
        return tuned, leaves, top, phase, host

    def _stale(self, args, kwargs, backend):
        return self.eager(args, kwargs, "stale", f"{self.watch.reason}: {backend.name} baked the old weights "
                                                 "in, so calls run eager until the module is re-tuned "
                                                 "(module.enable_recording(force=True), then ait.tune)")

    def _guarded_call(self, tuned: TunedGraph, guard, args, kwargs, leaves, served: tuple | None = None):
        """One call checked against eager (NOTE [guard cost] in aitune/torch/check/guard.py); ``served``: the
        backend's output for it in a one-item tuple, where it already ran (NOTE [guard after launch])."""
        backend = tuned.backend
        output, replacement = guard.check(backend, lambda chosen: chosen.run(args, kwargs),
                                          lambda: self.run_eager(args, kwargs), leaves, served)
        if replacement is backend:
            self.backend_calls += 1
        else:
            event = guard.events[-1]
            logger.warning("%s/%s: %s disagreed with eager on an input of shapes %s (%s); this call returned eager's "
                           "result and %s serves the graph from now on", self.name, tuned.graph.name, backend.name,
                           event.input_shapes, event.reason, event.replaced_by)
            self.replace_backend(tuned, replacement)
        return output

    def eager(self, args, kwargs, key, message: str):
        """Run eager for a call a backend cannot take; warn once per ``key``, count every such call by kind.
        When eager may not run (``ait.load`` found the module's weights are not the artifacts'), nothing is
        logged and the call raises, naming why the backend could not take it (``message``, which describes the
        eager fallback that was refused) and why eager may not run."""
        if self.eager_fallback_error is not None:
            raise BackendRuntimeError(f"{self.name}: {message} — but eager may not run here: "
                                      f"{self.eager_fallback_error}")
        kind = key[0] if isinstance(key, tuple) else key
        self.fallbacks[kind] = self.fallbacks.get(kind, 0) + 1
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("%s: %s", self.name, message)
        return self.run_eager(args, kwargs)

    def run_eager(self, args, kwargs):
        """The original module on a call (as given; normalised for the guard's comparisons), in the caller's grad
        mode: a call that needs autograd gets eager's ``grad_fn`` (:class:`~aitune.torch.check.baked_state.BakedState`
        routes such calls here)."""
        if self.eager_fallback_error is not None:
            raise BackendRuntimeError(self.eager_fallback_error)
        return self.module(*args, **kwargs)


def _contiguous(value):
    leaves, spec = tree_flatten(value)
    return tree_unflatten(spec, [leaf.contiguous() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves])
