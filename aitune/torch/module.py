"""``ait.Module``: a transparent wrapper that records calls, and after tuning dispatches them to backends.

States: INIT → (first call) RECORDING → (:func:`aitune.torch.tune`) TUNED; PASSTHROUGH runs the original.
The wrapper is a ``wrapt.ObjectProxy``: attribute access, ``isinstance`` checks, ``state_dict`` and
assignment into a parent module all behave as for the wrapped module.
"""

from __future__ import annotations

import enum
import logging
import weakref
from typing import Any, Protocol

import torch
import wrapt

from aitune.errors import ConfigError, TuningError
from aitune.torch.backend.artifact import deployment_artifacts
from aitune.torch.check.guard import GuardConfig
from aitune.torch.common.own_calls import own_method
from aitune.torch.config import config
from aitune.torch.dispatch import Dispatch
from aitune.torch.record.module_arguments import validate_dynamic_shapes, validate_strategies
from aitune.torch.record.samples import Recorder
from aitune.torch.tune_strategy import TuneStrategy

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
# (per call, globals cost less than attribute lookups; Dynamo knows is_compiling by the function itself)
_TUNED = ModuleState.TUNED
_is_compiling = torch.compiler.is_compiling
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


class Orchestrator(Protocol):
    """What :meth:`Module.tune` hands its module to (:mod:`aitune.torch.tuning`)."""

    def tune_modules(self, modules: list, *, device=None): ...

    def plan(self, modules: list, *, device=None): ...


# NOTE [Module.tune]: the orchestrator (aitune.torch.tuning) sits above this file in the import layers
# (pyproject.toml [tool.importlinter]) and depends on Module, not the other way round: the package
# (aitune/torch/__init__.py) hands it in through set_orchestrator, and Module.tune calls it.
_orchestrator: list[Orchestrator] = []


def set_orchestrator(orchestrator: Orchestrator) -> None:
    """Give :meth:`Module.tune` the orchestrator it runs (``aitune.torch`` passes :mod:`aitune.torch.tuning`)."""
    _orchestrator[:] = [orchestrator]


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
        self._self_error: str | None = None
        self._self_guard_config = guard or GuardConfig()
        self._self_dispatch = self._new_dispatch()  # the tuned graphs and how calls reach them (aitune/torch/dispatch.py)
        self._self_tune_rows: dict[str, dict] = {}
        self._self_view = None  # the module as its own methods see it through this wrapper (NOTE [own calls])
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
        for _, backend in self._self_dispatch.backends():
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
        if self._self_state is ModuleState.TUNED:
            raise ConfigError(f"{self._self_name} is already tuned; call enable_recording(force=True) and record "
                              "again to tune it anew")
        if not any(graph.samples for graph in self.graphs):
            raise ConfigError(f"{self._self_name} recorded nothing: call it on real inputs (or run ait.tune) first")
        if strategy is not None and not isinstance(strategy, TuneStrategy):
            raise ConfigError(f"strategy must be a TuneStrategy, got {strategy!r}")
        if not _orchestrator:
            raise TuningError("Module.tune needs the orchestrator: import aitune.torch (it hands it in)")
        orchestrator = _orchestrator[0]
        self._self_strategy_override = strategy
        try:
            if dry_run:
                return orchestrator.plan([self], device=device)
            return orchestrator.tune_modules([self], device=device)
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
        dispatch = self._self_dispatch
        entries = dispatch.backends()
        if self._self_state is not ModuleState.TUNED or not entries or any(
                getattr(backend, "passthrough", False) or backend.is_jit for _, backend in entries):
            return False
        device = torch.device(device)
        self.__wrapped__.to(device)
        if device.type == "meta":
            dispatch.eager_fallback_error = (
                f"{self._self_name}'s original module was moved to 'meta' after tuning "
                "(aitune.torch.config.device_after_tuning), so calls its tuned artifacts do not take cannot run "
                "eagerly; set config.device_after_tuning = None (the default) to keep it")
            for tuned in dispatch.graphs:
                tuned.guard = None
        self.watch_state()  # the move is not a weight change: watch from the new state
        return True

    @property
    def backends(self) -> dict[str, Any]:
        """Chosen backend per graph name (after tuning)."""
        return {graph.name: backend for graph, backend in self._self_dispatch.backends()}

    @property
    def tuning_error(self) -> str | None:
        return self._self_error

    @property
    def guard_config(self) -> GuardConfig:
        """The run-time guard's settings (see :class:`~aitune.torch.check.guard.GuardConfig`)."""
        return self._self_guard_config

    @property
    def needs_retune(self) -> str | None:
        """Why the tuned backends no longer fit the module (weights changed after tuning, also through
        ``.data``), or None."""
        watch, baked = self._self_dispatch.watch, self._self_dispatch.baked
        return (watch.changed() if watch is not None else None) or (baked.stale if baked is not None else None)

    @property
    def backend_calls(self) -> int:
        """Calls a tuned (non-eager) backend answered since tuning or loading (see :attr:`stats`); cheap to read
        per call, unlike ``stats``."""
        return self._self_dispatch.backend_calls

    @property
    def stats(self) -> dict:
        """What happened at run time: calls a tuned (non-eager) backend answered (``backend_calls``; a checked
        call counts when the check kept the backend's answer), calls that ran eager by reason (``eager_fallbacks``: ``graph`` untuned
        structure, ``range`` outside an artifact's accepted inputs, ``values`` values never recorded (integers
        outside the recorded range, nan/inf, a quantized candidate's input far beyond its checked range),
        ``stale`` weights changed, ``error`` the backend raised, ``grad``/``autocast``/``hooks``/``module`` what a
        backend baked in differs (:mod:`aitune.torch.check.baked_state`), ...), the guard's checks and events per
        graph, and whether the module needs a re-tune.
        JSON-able; counts since tuning (or loading)."""
        dispatch = self._self_dispatch
        return {
            "state": self._self_state.value,
            "backend_calls": dispatch.backend_calls,
            "eager_fallbacks": dict(dispatch.fallbacks),
            "guard": {name: guard.stats() for name, guard in dispatch.guards().items()},
            "needs_retune": self.needs_retune,
        }

    def arm_guard(self, graph, guard) -> None:
        """Install the run-time guard of one tuned graph (``ait.tune`` and ``ait.load`` call this).

        Args:
            graph: a tuned :class:`~aitune.torch.record.samples.GraphSpec` of this module.
            guard: a :class:`~aitune.torch.check.guard.RuntimeGuard`, or None for no checks on that graph.
        """
        tuned = self._self_dispatch.find(graph)
        if tuned is not None:
            tuned.guard = guard

    def watch_state(self, stale: str | None = None) -> None:
        """Start noticing weights changed after tuning when a dispatched backend baked them in.

        Args:
            stale: the baked-in weights are not the module's from the start, for this reason (``ait.load(...,
                weights="module")`` into a module whose weights differ from the checkpoint's): such calls run
                eagerly and :attr:`needs_retune` reports it. A module already stale stays stale.
        """
        self._self_dispatch.watch_state(stale)

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
        return sorted(self._self_dispatch.backends(), key=lambda entry: entry[0].index)

    def deployment_artifacts(self, reasons: dict | None = None) -> dict[str, Any]:
        """What another runtime needs to serve each tuned graph without aitune (README, "Deployment artifacts").

        Args:
            reasons: a dict that receives, per graph name left out, why it has no artifact (a JIT or eager backend,
                or weights changed since the backend baked them in).

        Returns:
            ``{graph name: DeploymentArtifact}`` (:class:`~aitune.torch.backend.artifact.DeploymentArtifact`) for
            the chosen backends that publish one; empty before tuning. Works after ``ait.load`` as well.
        """
        artifacts, left_out = deployment_artifacts(self.tuned_graphs(), self._self_dispatch.stale_weights())
        if reasons is not None:
            reasons.update(left_out)
        return artifacts

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
        self._set_tuned(entries, eager_fallback_error)
        self._self_tune_rows = dict(tune_rows or {})

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
        for _, backend in self._self_dispatch.backends():
            backend.activate()

    def deactivate(self) -> None:
        """Release the tuned backends' device memory, sessions and CUDA graphs (e.g. between pipeline stages).

        The module stays TUNED: its next call reactivates the backend it needs (it never silently switches
        to eager). To run the original module instead, use :meth:`enable_passthrough`.
        """
        for _, backend in self._self_dispatch.backends():
            backend.deactivate()

    def _new_dispatch(self, entries=(), eager_fallback_error: str | None = None) -> Dispatch:
        return Dispatch(self.__wrapped__, self._self_name, self._self_recorder.signature, entries,
                        eager_fallback_error)

    def _drop_backends(self) -> None:
        """Release the current backends (device memory, CUDA graphs) and everything kept about them: the
        routes, guards, weight watch and run-time counters live in the Dispatch, dropped here as a whole."""
        self._self_dispatch.release()
        self._self_dispatch = self._new_dispatch()

    def _set_tuned(self, entries: list, eager_fallback_error: str | None = None) -> None:
        self._self_dispatch.release()
        self._self_dispatch = self._new_dispatch(entries, eager_fallback_error)
        self._self_state = ModuleState.TUNED
        self._self_error = None

    def _set_failed(self, reason: str) -> None:
        self._drop_backends()
        self._self_error = reason
        self._self_state = ModuleState.PASSTHROUGH

    # ---- copies: the wrapped module, untuned (a copy shares no backend, guard or recorded sample with this one)
    def _copyable(self) -> torch.nn.Module:
        reason = self._self_dispatch.eager_fallback_error  # the wrapped module is not the model that answers
        if reason is not None:
            raise TypeError(f"{self._self_name}: a copy or pickle would be the wrapped module, which may not answer "
                            f"for it: {reason}")
        return self.__wrapped__

    def __copy__(self):
        import copy

        return copy.copy(self._copyable())

    def __deepcopy__(self, memo):
        import copy

        return copy.deepcopy(self._copyable(), memo)

    def __reduce_ex__(self, protocol):
        return self._copyable().__reduce_ex__(protocol)

    def __repr__(self) -> str:
        stale = self.needs_retune
        state = self._self_state.value + (f" (needs re-tune: {stale})" if stale else "")
        return f"aitune.Module(name={self._self_name!r}, state={state}, module={self.__wrapped__!r})"

    # ---- calls
    def __getattr__(self, name: str):  # the module's own methods call this wrapper (NOTE [own calls])
        return own_method(name, super().__getattr__(name), self)

    def __call__(self, *args, **kwargs):
        state = self._self_state
        if state is _TUNED and not _is_compiling():  # (a served call: the dispatch, nothing else read first)
            return self._self_dispatch.call(args, kwargs)
        # traced inside the caller's own torch.compile (e.g. transformers' auto-compile of a decode step): their
        # compiler takes the original module, as if it were not wrapped; nothing is recorded
        if _is_compiling() or state is ModuleState.PASSTHROUGH:
            return self.__wrapped__(*args, **kwargs)
        self._self_state = ModuleState.RECORDING
        return self._self_recorder.record(self.__wrapped__, args, kwargs, _recording_context["batch_size"])
