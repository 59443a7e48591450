"""``ait.Module``: a transparent wrapper that records calls, and after tuning dispatches them to backends.

States: INIT → (first call) RECORDING → (:func:`aitune.torch.tune`) TUNED; PASSTHROUGH runs the original.
The wrapper is a ``wrapt.ObjectProxy``: attribute access, ``isinstance`` checks, ``state_dict`` and
assignment into a parent module all behave as for the wrapped module.
"""

from __future__ import annotations

import enum
import logging
import tempfile
import weakref
from pathlib import Path
from typing import Any

import torch
import wrapt

from aitune.errors import BackendRuntimeError, ConfigError
from aitune.torch.config import config
from aitune.torch.check.baked_state import BakedState
from aitune.torch.check.guard import GuardConfig, StateWatch
from aitune.torch.record.module_arguments import validate_dynamic_shapes, validate_strategies
from aitune.torch.record.pytree import tree_flatten
from aitune.torch.record.samples import Recorder, make_graph_key

logger = logging.getLogger(__name__)


class ModuleState(str, enum.Enum):
    """Where a wrapper is in its life: INIT (never called), RECORDING (calls run eager and are recorded),
    TUNED (calls go to the selected backends), PASSTHROUGH (calls run the original module, nothing recorded)."""

    INIT = "init"
    RECORDING = "recording"
    TUNED = "tuned"
    PASSTHROUGH = "passthrough"


# Every live wrapper, in creation order (weak: a wrapper the user dropped is not tuned).
_REGISTRY: "weakref.WeakValueDictionary[int, Module]" = weakref.WeakValueDictionary()
_counter = 0
_recording_context: dict[str, Any] = {"batch_size": None}


def set_recording_batch_size(batch_size: int | None) -> None:
    """The batch size ``ait.tune`` is recording now (each wrapper records its calls under it); None after."""
    _recording_context["batch_size"] = batch_size


def registered_modules() -> list["Module"]:
    """Live :class:`Module` wrappers in creation order."""
    return [module for _, module in sorted(_REGISTRY.items())]


def unregister(module: "Module") -> None:
    """Drop a wrapper from :func:`registered_modules`: ``ait.tune()`` and ``ait.save()`` no longer see it
    (just-in-time tuning keeps its internal wrappers to itself this way)."""
    _REGISTRY.pop(module._self_id, None)


class Module(wrapt.ObjectProxy):
    """Wrap ``module`` so :func:`aitune.torch.tune` can tune it.

    Args:
        module: the ``torch.nn.Module`` to tune (not copied, never modified).
        name: report/checkpoint name (default: the class's qualified name); ``/`` becomes ``_``.
        strategy: a :class:`~aitune.torch.tune_strategy.TuneStrategy` (default: ``MaxThroughputStrategy()``
            over the backends available here).
        strategies: instead of ``strategy``, one strategy per graph, for a module whose graphs need different
            treatment (an LLM's prefill and decode): a list in graph order (``strategies[i]`` tunes
            ``graph<i>``; it must be at least as long as the number of graphs recorded), or a dict keyed by graph
            name (``"graph0"``) or index.
        dynamic_shapes: explicit axes per input path, e.g. ``{"x": (BatchDim("batch", 1, 32), 3, 224, 224)}``.
        max_samples: distinct input shapes kept per graph for building/checking (range extremes always kept);
            default ``aitune.torch.config.max_num_samples_stored`` (8).
        guard: run-time checks against eager after tuning (:class:`~aitune.torch.check.guard.GuardConfig`; default:
            the first call of every unseen input signature, and one call in N keeping eager re-runs within
            2 % of serving time). ``GuardConfig(enabled=False)`` turns them off.

    Raises:
        ConfigError: for a non-Module, a bad strategy or a malformed ``dynamic_shapes``.
    """

    def __init__(self, module: torch.nn.Module, name: str | None = None, strategy=None, strategies=None,
                 dynamic_shapes: dict | None = None, max_samples: int | None = None, guard: GuardConfig | None = None):
        if isinstance(module, Module):
            raise ConfigError("this module is already wrapped by aitune.torch.Module; wrap it once")
        if not isinstance(module, torch.nn.Module):
            raise ConfigError(f"aitune.torch.Module wraps a torch.nn.Module, got {type(module).__name__}; "
                              "wrap the model (or the submodule) that does the work")
        from aitune.torch.tune_strategy import TuneStrategy

        if strategy is not None and not isinstance(strategy, TuneStrategy):
            raise ConfigError(f"strategy must be a TuneStrategy such as MaxThroughputStrategy(), got {strategy!r}")
        strategies = validate_strategies(strategy, strategies, TuneStrategy)
        if name is not None and (not isinstance(name, str) or not name):
            raise ConfigError(f"name must be a non-empty string, got {name!r}")
        validate_dynamic_shapes(dynamic_shapes)
        if max_samples is None:
            max_samples = config.samples_per_graph()
        if not isinstance(max_samples, int) or max_samples < 1:
            raise ConfigError(f"max_samples must be an int >= 1, got {max_samples!r}")
        if guard is not None and not isinstance(guard, GuardConfig):
            raise ConfigError(f"guard must be an aitune.torch.GuardConfig, got {guard!r}")
        super().__init__(module)
        global _counter
        _counter += 1
        self._self_id = _counter
        self._self_name = (name or f"{type(module).__module__}.{type(module).__qualname__}").replace("/", "_")
        self._self_strategy = strategy
        self._self_strategies = strategies
        self._self_strategy_override = None  # set while Module.tune(strategy=...) runs
        self._self_dynamic_shapes = dynamic_shapes or {}
        self._self_recorder = Recorder(module, max_samples=max_samples, dynamic_shapes=dynamic_shapes)
        self._self_state = ModuleState.INIT
        self._self_dispatch: dict = {}
        self._self_fast_dispatch: dict = {}
        self._self_routes: dict = {}  # raw call key -> _Route (NOTE [dispatch fast path]); cleared on every change
        self._self_warned: set = set()
        self._self_error: str | None = None
        self._self_eager_fallback_error: str | None = None  # set by ait.load when eager would be wrong
        self._self_guard_config = guard or GuardConfig()
        self._self_guards: dict = {}  # id(graph) -> RuntimeGuard
        self._self_watch: StateWatch | None = None  # set when a dispatched backend bakes weights in
        self._self_baked: BakedState | None = None  # what the backends took for granted (set with watch_state)
        self._self_fallbacks: dict = {}  # reason key -> calls that ran eager for it
        self._self_backend_calls = 0  # calls answered by a tuned (non-eager) backend
        self._self_tune_rows: dict[str, dict] = {}
        _REGISTRY[self._self_id] = self

    # ---- properties (on the proxy, not forwarded)
    @property
    def name(self) -> str:
        return self._self_name

    @property
    def state(self) -> ModuleState:
        return self._self_state

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped (original) module."""
        return self.__wrapped__

    @property
    def strategy(self):
        return self._self_strategy

    @property
    def strategies(self) -> list | dict | None:
        """The per-graph strategies given to the constructor (None when one ``strategy`` serves every graph)."""
        return self._self_strategies

    def strategy_for(self, graph):
        """The strategy that tunes ``graph``: ``Module.tune(strategy=...)``'s, else the graph's entry of
        ``strategies``, else ``strategy`` (None: the default of ``ait.tune``).

        Raises:
            ConfigError: a ``strategies`` list shorter than the recorded graphs, or a dict without this graph.
        """
        if self._self_strategy_override is not None:
            return self._self_strategy_override
        chosen = self._self_strategies
        if chosen is None:
            return self._self_strategy
        if isinstance(chosen, list):
            if graph.index >= len(chosen):
                raise ConfigError(f"{self._self_name}: strategies has {len(chosen)} entr{'y' if len(chosen) == 1 else 'ies'} "
                                  f"but {graph.name} was recorded (graphs: {', '.join(g.name for g in self.graphs)}); "
                                  "give one strategy per graph")
            return chosen[graph.index]
        for key in (graph.name, graph.index):
            if key in chosen:
                return chosen[key]
        raise ConfigError(f"{self._self_name}: strategies has no entry for {graph.name} (keys: "
                          f"{', '.join(map(repr, chosen))}); key the dict by graph name or index")

    @property
    def graphs(self) -> list:
        """Recorded graphs (:class:`~aitune.torch.record.samples.GraphSpec`) in order."""
        return list(self._self_recorder.graphs.values())

    @property
    def graph_specs(self) -> list:
        """The reference system's name for :attr:`graphs`."""
        return self.graphs

    @property
    def device(self) -> torch.device:
        """Where the tuned backends run (the device of a graph's recorded inputs), else where the wrapped
        module's parameters are. Pipelines that ask their modules for ``.device`` keep working after
        ``config.device_after_tuning`` moved the original module away."""
        for graph, backend in self._self_dispatch.values():
            if getattr(backend, "device", None) is not None:
                return torch.device(backend.device)
        own = getattr(self.__wrapped__, "device", None)
        if isinstance(own, (torch.device, str)):
            return torch.device(own)
        parameter = next(iter(self.__wrapped__.parameters()), None)
        return parameter.device if parameter is not None else torch.device("cpu")

    def tune(self, device: str | torch.device | None = None, strategy=None, dry_run: bool = False):
        """Tune this module's recorded graphs now (what :func:`aitune.torch.tune` does after recording).

        Args:
            device: where to build and measure (default: the device of the module's parameters).
            strategy: overrides ``strategy``/``strategies`` for this call.
            dry_run: plan only (see :func:`aitune.torch.planning.plan_modules`).

        Returns:
            The :class:`~aitune.torch.report.rows.TuneReport`.

        Raises:
            ConfigError: already tuned (``enable_recording(force=True)`` first), nothing recorded, or a
                ``strategy`` that is not a TuneStrategy.
        """
        # NOTE [Module.tune]: the orchestrator (aitune.torch.tuning) depends on Module, not the other way
        # round; this public entry point reaches it at call time.
        from aitune.torch import tuning
        from aitune.torch.tune_strategy import TuneStrategy

        if self._self_state is ModuleState.TUNED:
            raise ConfigError(f"{self._self_name} is already tuned; call enable_recording(force=True) and record "
                              "again to tune it anew")
        if not any(graph.samples for graph in self.graphs):
            raise ConfigError(f"{self._self_name} recorded nothing: call it on real inputs (or run ait.tune) first")
        if strategy is not None and not isinstance(strategy, TuneStrategy):
            raise ConfigError(f"strategy must be a TuneStrategy, got {strategy!r}")
        self._self_strategy_override = strategy
        try:
            if dry_run:
                return tuning.plan([self], device=device)
            return tuning.tune_modules([self], device=device)
        finally:
            self._self_strategy_override = None

    def offload(self, device: str | torch.device) -> bool:
        """Move the original module to ``device`` when no tuned graph needs it (every backend runs an AOT
        artifact); what ``config.device_after_tuning`` does after tuning.

        On ``meta`` the module keeps no weights: calls the artifacts do not take (inputs outside the tuned
        ranges, untuned structures) then raise :class:`~aitune.errors.BackendRuntimeError` instead of running
        eagerly, and the run-time guard (which compares with eager) is disarmed.

        Returns:
            True when moved; False when a tuned graph runs the module itself (JIT backend, eager) or the
            module is not tuned.
        """
        entries = list(self._self_dispatch.values())
        if self._self_state is not ModuleState.TUNED or not entries or any(
                getattr(backend, "passthrough", False) or backend.is_jit for _, backend in entries):
            return False
        device = torch.device(device)
        self.__wrapped__.to(device)
        if device.type == "meta":
            self._self_eager_fallback_error = (
                f"{self._self_name}'s original module was moved to 'meta' after tuning "
                "(aitune.torch.config.device_after_tuning), so calls its tuned artifacts do not take cannot run "
                "eagerly; set config.device_after_tuning = None (the default) to keep it")
            for graph, _ in entries:
                self.arm_guard(graph, None)
        self.watch_state()  # the move is not a weight change: watch from the new state
        return True

    @property
    def backends(self) -> dict[str, Any]:
        """Chosen backend per graph name (after tuning)."""
        return {graph.name: backend for graph, backend in self._self_dispatch.values()}

    @property
    def tuning_error(self) -> str | None:
        return self._self_error

    @property
    def guard_config(self) -> GuardConfig:
        """The run-time guard's settings (see :class:`~aitune.torch.check.guard.GuardConfig`)."""
        return self._self_guard_config

    @property
    def needs_retune(self) -> str | None:
        """Why the tuned backends no longer fit the module (weights changed after tuning), or None."""
        watch, baked = self._self_watch, self._self_baked
        return (watch.changed() if watch is not None else None) or (baked.stale if baked is not None else None)

    @property
    def backend_calls(self) -> int:
        """Calls a tuned (non-eager) backend answered since tuning or loading (see :attr:`stats`); cheap to read
        per call, unlike ``stats``."""
        return self._self_backend_calls

    @property
    def stats(self) -> dict:
        """What happened at run time: calls a tuned (non-eager) backend answered (``backend_calls``; a checked
        call counts when the check kept the backend's answer), calls that ran eager by reason (``eager_fallbacks``: ``graph`` untuned
        structure, ``range`` outside an artifact's accepted inputs, ``stale`` weights changed, ``error`` the
        backend raised, ``grad``/``autocast``/``hooks``/``module`` what a backend baked in differs: see
        :mod:`aitune.torch.check.baked_state`, ...), the guard's checks and events per graph, and whether the module needs a re-tune.
        JSON-able; counts since tuning (or loading)."""
        return {
            "state": self._self_state.value,
            "backend_calls": self._self_backend_calls,
            "eager_fallbacks": dict(self._self_fallbacks),
            "guard": {graph.name: self._self_guards[id(graph)].stats() for graph, _ in self._self_dispatch.values()
                      if id(graph) in self._self_guards},
            "needs_retune": self.needs_retune,
        }

    def arm_guard(self, graph, guard) -> None:
        """Install the run-time guard of one tuned graph (``ait.tune`` and ``ait.load`` call this).

        Args:
            graph: a tuned :class:`~aitune.torch.record.samples.GraphSpec` of this module.
            guard: a :class:`~aitune.torch.check.guard.RuntimeGuard`, or None for no checks on that graph.
        """
        if guard is None:
            self._self_guards.pop(id(graph), None)
        else:
            self._self_guards[id(graph)] = guard
        self._self_routes = {}

    def watch_state(self, stale: str | None = None) -> None:
        """Start noticing weights changed after tuning when a dispatched backend baked them in.

        Args:
            stale: the baked-in weights are not the module's from the start, for this reason (``ait.load(...,
                weights="module")`` into a module whose weights differ from the checkpoint's): such calls run
                eagerly and :attr:`needs_retune` reports it. A module already stale stays stale.
        """
        bakes = any(backend.bakes_weights and not graph.stateful for graph, backend in self._self_dispatch.values())
        previous = self._self_watch.reason if self._self_watch is not None else None
        self._self_watch = StateWatch(self.__wrapped__) if bakes or stale else None
        if self._self_watch is not None:
            self._self_watch.reason = stale or previous
        self._self_baked = BakedState(self.__wrapped__) if self._self_dispatch else None

    @property
    def max_samples(self) -> int:
        """Distinct input shapes kept per graph (the ``max_samples`` the wrapper was made with)."""
        return self._self_recorder.max_samples

    @property
    def tune_rows(self) -> dict[str, dict]:
        """The chosen backend's tune-report row (``CandidateResult.to_dict``) per graph name; empty before tuning."""
        return dict(self._self_tune_rows)

    def tuned_graphs(self) -> list[tuple[Any, Any]]:
        """The tuned graphs and their backends.

        Returns:
            ``[(GraphSpec, Backend), ...]`` in graph order (by ``graph.index``); empty unless TUNED.
        """
        return sorted(self._self_dispatch.values(), key=lambda entry: entry[0].index)

    def install_tuned(self, entries: list[tuple[Any, Any]], *, tune_rows: dict[str, dict] | None = None,
                      eager_fallback_error: str | None = None) -> None:
        """Make the module TUNED with these backends (what :func:`aitune.torch.tune` and ``ait.load`` do).

        The previous backends are released. The entries' graphs become the module's graphs; recorded graphs
        without samples (calls that raised while recording, never tuned) are kept so graph names stay unique.

        Args:
            entries: ``(GraphSpec, Backend)`` per tuned graph, each backend built (or restored) for its graph.
            tune_rows: the chosen backend's report row per graph name (kept by ``ait.save``).
            eager_fallback_error: when set, calls the backends do not take raise
                :class:`~aitune.errors.BackendRuntimeError` with this reason instead of running the module
                eagerly (``ait.load`` sets it when the module's weights do not reproduce the tuned outputs).
        """
        entries = list(entries)
        tuned_keys = {graph.key for graph, _ in entries}
        untuned = [graph for key, graph in self._self_recorder.graphs.items()
                   if not graph.samples and key not in tuned_keys]
        graphs = sorted([graph for graph, _ in entries] + untuned, key=lambda graph: graph.index)
        self._self_recorder.graphs = {graph.key: graph for graph in graphs}
        self._set_tuned({graph.key: (graph, backend) for graph, backend in entries})
        self._self_tune_rows = dict(tune_rows or {})
        self._self_eager_fallback_error = eager_fallback_error

    def mark_failed(self, reason: str) -> None:
        """Tuning failed: release the backends and run the original module from now on (PASSTHROUGH).

        Args:
            reason: one line, shown as :attr:`tuning_error`.
        """
        self._set_failed(reason)

    def enable_passthrough(self) -> None:
        """Call the original module from now on (recorded samples are kept)."""
        self._self_state = ModuleState.PASSTHROUGH

    def enable_recording(self, force: bool = False) -> None:
        """Record calls again. Leaving TUNED needs ``force=True`` (drops the tuned backends)."""
        if self._self_state is ModuleState.TUNED and not force:
            raise ConfigError("module is tuned; enable_recording(force=True) drops the tuned backends")
        self._drop_backends()
        self._self_state = ModuleState.RECORDING

    def activate(self) -> None:
        """Reacquire what :meth:`deactivate` released (device memory, sessions, CUDA graphs) now.

        Not required before calling: a call to a deactivated module reactivates the backend of the graph it
        runs. Raises whatever a backend's reactivation raises (e.g. BackendRuntimeError).
        """
        for _, backend in self._self_dispatch.values():
            backend.activate()

    def deactivate(self) -> None:
        """Release the tuned backends' device memory, sessions and CUDA graphs (e.g. between pipeline stages).

        The module stays TUNED: its next call reactivates the backend it needs (it never silently switches
        to eager). To run the original module instead, use :meth:`enable_passthrough`.
        """
        for _, backend in self._self_dispatch.values():
            backend.deactivate()

    def _drop_backends(self) -> None:
        """Release the current backends (device memory, CUDA graphs) and per-tuning state."""
        for _, backend in self._self_dispatch.values():
            try:
                backend.deactivate()
            except Exception:  # noqa: BLE001 - releasing must not fail the new state
                logger.debug("deactivating %s failed", backend, exc_info=True)
        self._self_dispatch = {}
        self._self_fast_dispatch = {}
        self._self_routes = {}
        self._self_warned = set()
        self._self_eager_fallback_error = None
        self._self_guards = {}
        self._self_watch = None
        self._self_baked = None
        self._self_fallbacks = {}
        self._self_backend_calls = 0

    def _set_tuned(self, dispatch: dict) -> None:
        self._drop_backends()
        self._self_dispatch = dispatch
        self._self_fast_dispatch = {}
        self._self_routes = {}
        for graph, backend in dispatch.values():
            if graph.samples:
                key = _flat_call_key(graph.samples[0].args, graph.samples[0].kwargs)
                if key is not None:
                    self._self_fast_dispatch[key] = (graph, backend)
        self._self_state = ModuleState.TUNED
        self._self_error = None

    def _set_failed(self, reason: str) -> None:
        self._drop_backends()
        self._self_error = reason
        self._self_state = ModuleState.PASSTHROUGH

    def __repr__(self) -> str:
        stale = self.needs_retune
        state = self._self_state.value + (f" (needs re-tune: {stale})" if stale else "")
        return f"aitune.Module(name={self._self_name!r}, state={state}, module={self.__wrapped__!r})"

    # ---- calls
    def __call__(self, *args, **kwargs):
        state = self._self_state
        if state is ModuleState.TUNED:
            return self._dispatch(args, kwargs)
        if state is ModuleState.PASSTHROUGH:
            return self.__wrapped__(*args, **kwargs)
        self._self_state = ModuleState.RECORDING
        return self._self_recorder.record(self.__wrapped__, args, kwargs, _recording_context["batch_size"])

    def _dispatch(self, args, kwargs):
        # NOTE [dispatch fast path]: a call whose arguments are all tensors or plain constants (no nesting) is keyed
        # as given, before normalisation, by dtype/rank/device and constant values; the key finds a _Route that
        # holds what the checks below need to know about its graph and backend, computed once. The host work
        # before the backend's launch is then a few µs, which counts in the GPU latency of every call (the
        # wrapped module should stay within 3 % of the backend called directly: benchmarks/gpu_wrapper_cost.py).
        raw_key = _flat_call_key(args, kwargs)
        route = self._self_routes.get(raw_key) if raw_key is not None else None
        if route is not None and route.normalize is not None:
            args, kwargs = route.normalize(args, kwargs)  # the call's shape is the route's: its plan normalises
        else:
            raw_args, raw_kwargs = args, kwargs
            args, kwargs = self._self_recorder.signature.normalize(args, kwargs)
        if route is None:
            route = self._route(raw_key, args, kwargs, raw_args, raw_kwargs)
            if route is None:
                return self._eager(args, kwargs, "graph", "a call whose input structure, constants or dtypes were "
                                                          "never recorded runs eager")
        backend = route.backend
        # NOTE [what a backend follows] in aitune/torch/check/baked_state.py: grad mode, the caller's autocast,
        # hooks, submodules' flags and attributes, weights edited through .data.
        differs = self._self_baked.differs(backend, args, kwargs) if self._self_baked is not None else None
        if differs is not None:
            return self._eager(args, kwargs, *differs)
        if route.passthrough:  # plain eager: nothing to route around
            return backend.run(args, kwargs)
        leaves = [*args, *kwargs.values()] if route.flat else tree_flatten((args, kwargs))[0]
        graph = route.graph
        watch = self._self_watch if route.bakes_weights else None
        if watch is not None and watch.reason is not None:
            return self._stale(args, kwargs, backend)
        if self.__wrapped__.training != route.training:
            return self._eager(args, kwargs, "training", f"module.training is {self.__wrapped__.training} but it was "
                                                         f"tuned with {route.training}: eager runs")
        contiguous = True
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if leaf.numel() == 0:
                    # NOTE [zero-size inputs]: compiled kernels and exported graphs mishandle empty batches and
                    # empty spatial dims (microsoft/onnxruntime#13626, pytorch/pytorch#197095); eager gives the
                    # right empty result or the right error.
                    return self._eager(args, kwargs, "empty", "zero-size inputs run eager")
                if contiguous and not leaf.is_contiguous():
                    contiguous = False
        if route.checks_inputs:
            rejection = backend.rejects(leaves)
            if rejection is not None:
                return self._eager(args, kwargs, ("range", graph.name), f"{graph.name}: {rejection} ({backend.name}'s "
                                                                        "accepted inputs); such calls run eager")
        if not contiguous:
            # NOTE [non-contiguous inputs]: some artifacts assume contiguous strides (pytorch/pytorch#122784).
            if graph.mutated_inputs:
                return self._eager(args, kwargs, "strides", "non-contiguous inputs to a module that mutates "
                                                            "its inputs run eager")
            args, kwargs = _contiguous((args, kwargs))
        guard = route.guard
        try:
            if guard is not None and guard.due(leaves):
                if watch is not None and watch.changed() is not None:
                    return self._stale(args, kwargs, backend)
                return self._guarded_call(graph, backend, guard, args, kwargs, leaves)
            output = backend.run(args, kwargs, accepted=True)
        except Exception as exc:  # noqa: BLE001 - a crashing backend never takes the caller down
            if watch is not None and watch.changed() is not None:
                return self._stale(args, kwargs, backend)
            return self._eager(args, kwargs, ("error", graph.name),
                               f"backend {backend.name} raised {type(exc).__name__}: {exc}; running eager instead")
        # NOTE [stale check after launch]: a backend that bakes the weights in never reads the user's tensors, so
        # whether they changed since tuning (StateWatch: tens of ns per parameter/buffer, tens of µs for a
        # ResNet-50) is checked after the backend was called: on a GPU that host work then overlaps the
        # kernels just launched instead of delaying them (benchmarks/gpu_wrapper_cost.py). A stale call's output is
        # discarded and eager's returned: the same result as checking first, at the cost of one wasted call.
        if watch is not None and watch.changed() is not None:
            return self._stale(args, kwargs, backend)
        self._self_backend_calls += 1
        return output

    def _route(self, raw_key, args, kwargs, raw_args, raw_kwargs) -> _Route | None:
        """The route of a normalised call (None: no tuned graph takes it); kept under ``raw_key`` when the call is
        flat, so the next call shaped the same way finds it without flattening, and normalises it with the plan
        made from this call (``raw_args``/``raw_kwargs``: the call as given)."""
        fast_key = _flat_call_key(args, kwargs)
        entry = self._self_fast_dispatch.get(fast_key) if fast_key is not None else None
        flat = entry is not None
        if entry is None:
            leaves, spec = tree_flatten((args, kwargs))
            entry = self._self_dispatch.get(make_graph_key(leaves, spec))
        if entry is None:
            return None
        graph, backend = entry
        route = _Route(graph, backend, self._self_guards.get(id(graph)), flat)
        if flat and raw_key is not None:
            route.normalize = self._self_recorder.signature.plan(raw_args, raw_kwargs)
            self._self_routes[raw_key] = route
        return route

    def _stale(self, args, kwargs, backend):
        return self._eager(args, kwargs, "stale", f"{self._self_watch.reason}: {backend.name} baked the old weights "
                                                  "in, so calls run eager until the module is re-tuned "
                                                  "(module.enable_recording(force=True), then ait.tune)")

    def _guarded_call(self, graph, backend, guard, args, kwargs, leaves):
        """One call checked against eager (NOTE [guard cost] in aitune/torch/check/guard.py)."""
        output, replacement = guard.check(backend, lambda chosen: chosen.run(args, kwargs),
                                          lambda: self._call_eager(args, kwargs), leaves)
        if replacement is backend:
            self._self_backend_calls += 1
        else:
            event = guard.events[-1]
            logger.warning("%s/%s: %s disagreed with eager on an input of shapes %s (%s); this call returned eager's "
                           "result and %s serves the graph from now on", self._self_name, graph.name, backend.name,
                           event.input_shapes, event.reason, event.replaced_by)
            self._replace_backend(graph, replacement)
        return output

    def _replace_backend(self, graph, replacement) -> None:
        """Route ``graph`` to ``replacement`` (None: eager) from now on; the retired backend is released."""
        from aitune.torch.backend.eager import TorchEagerBackend

        if replacement is None:
            replacement = TorchEagerBackend.from_checkpoint(Path(tempfile.gettempdir()), TorchEagerBackend.config_class(),
                                                            {}, self.__wrapped__, graph, graph_device(graph))
        for key, (known, backend) in list(self._self_dispatch.items()):
            if known is graph:
                backend.deactivate()
                self._self_dispatch[key] = (graph, replacement)
        for key, (known, _) in list(self._self_fast_dispatch.items()):
            if known is graph:
                self._self_fast_dispatch[key] = (graph, replacement)
        self._self_routes = {}
        replacement.activate()

    def _eager(self, args, kwargs, key, message: str):
        """Run eager for a call a backend cannot take; warn once per ``key``, count every such call by kind.
        When eager may not run (``ait.load`` found the module's weights are not the artifacts'), nothing is
        logged and the call raises, naming why the backend could not take it (``message``, which describes the
        eager fallback that was refused) and why eager may not run."""
        if self._self_eager_fallback_error is not None:
            raise BackendRuntimeError(f"{self._self_name}: {message} — but eager may not run here: "
                                      f"{self._self_eager_fallback_error}")
        kind = key[0] if isinstance(key, tuple) else key
        self._self_fallbacks[kind] = self._self_fallbacks.get(kind, 0) + 1
        self._warn_once(key, "%s: %s", self._self_name, message)
        return self._call_eager(args, kwargs)

    def _call_eager(self, args, kwargs):
        if self._self_eager_fallback_error is not None:
            raise BackendRuntimeError(self._self_eager_fallback_error)
        # the caller's grad mode: a call that needs autograd gets eager's grad_fn (BakedState routes it here)
        return self.__wrapped__(*args, **kwargs)

    def _warn_once(self, key, message: str, *values) -> None:
        if key not in self._self_warned:
            self._self_warned.add(key)
            logger.warning(message, *values)


_CONSTANT_TYPES = (int, float, bool, str, type(None))


class _Route:
    """What ``Module._dispatch`` needs to know about one tuned graph and its backend, computed once per call shape
    (NOTE [dispatch fast path]). Rebuilt whenever the module's backends or guards change."""

    __slots__ = ("graph", "backend", "guard", "flat", "passthrough", "bakes_weights", "training", "checks_inputs",
                 "normalize")

    def __init__(self, graph, backend, guard, flat: bool) -> None:
        from aitune.torch.backend.base import Backend

        self.graph = graph
        self.backend = backend
        self.guard = guard
        self.flat = flat  # the call's leaves are its canonical args and kwargs values, in order
        self.passthrough = bool(getattr(backend, "passthrough", False))
        self.bakes_weights = bool(backend.bakes_weights)
        self.training = bool(graph.training)
        # Backend.rejects accepts everything; only a backend that overrides it is asked per call.
        self.checks_inputs = getattr(backend.rejects, "__func__", None) is not Backend.rejects
        # CallSignature.plan for calls with this route's raw key (positional count, keyword names in order)
        self.normalize = None


def _flat_call_key(args: tuple, kwargs: dict):
    """Graph key of a call with only tensor / plain-constant arguments; None when anything is nested.

    A tensor's device enters as ``(get_device(), is_cuda)`` (index, -1 on the CPU): ~90 ns against ~290 ns for
    ``tensor.device.type``, which builds a ``torch.device`` per access (torch 2.13)."""
    parts = []
    for value in args:
        if isinstance(value, torch.Tensor):
            parts.append((value.dtype, value.dim(), value.get_device(), value.is_cuda))
        elif type(value) in _CONSTANT_TYPES:
            parts.append((type(value), value))
        else:
            return None
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            parts.append((name, value.dtype, value.dim(), value.get_device(), value.is_cuda))
        elif type(value) in _CONSTANT_TYPES:
            parts.append((name, type(value), value))
        else:
            return None
    return len(args), tuple(parts)


def graph_device(graph) -> torch.device:
    """The device of a graph's first recorded tensor input (CPU when it has none)."""
    for sample in graph.samples[:1]:
        for leaf in sample.leaves():
            if isinstance(leaf, torch.Tensor):
                return leaf.device
    return torch.device("cpu")


def _contiguous(value):
    leaves, spec = tree_flatten(value)
    from aitune.torch.record.pytree import tree_unflatten

    return tree_unflatten(spec, [leaf.contiguous() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves])
