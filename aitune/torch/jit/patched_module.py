"""``PatchedModule``: one discovered module, its calls, its tuning, and the top-down descent to its children.

States: RECORDING (calls recorded by an :class:`aitune.torch.Module` around the module's twin, outputs are
eager's) → TUNING → TUNED (calls go to the chosen backends, the run-time guard applies) or EAGER (could not
be tuned: the reason is kept, calls run the original module, and its children are tried). SKIPPED modules
are never tuned by configuration (the reason says which rule); some rules let their children be tried.
"""

from __future__ import annotations

import enum
import logging
import time
import weakref
from typing import Any, Iterator

import torch

from aitune.errors import AITuneError
from aitune.torch.jit import patching, state
from aitune.torch.jit.config import JITMode, jit_config
from aitune.torch.module import Module, ModuleState, registered_modules, unregister
from aitune.torch.record.pytree import tree_flatten
from aitune.torch.record.samples import make_graph_key
from aitune.torch.tuning import tune_modules

logger = logging.getLogger(__name__)

# NOTE [built-in exclusions]: modules from these packages are never patched, nor anything below them:
# torch.compile'd (OptimizedModule) and scripted modules already belong to a compiler, FX/export graph
# modules are what backends produce, and aitune's own modules are its business.
BUILTIN_EXCLUDED_PACKAGES = ("torch.jit", "torch._dynamo", "torch._inductor", "torch.fx", "torch.export",
                             "torch.ao.quantization", "torch_tensorrt", "aitune.torch")
RECORDED_ENOUGH = 16  # NOTE [recording stops paying]
# Containers are never called: their entries are the children tried.
_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)


class JitState(str, enum.Enum):
    """A patched module's state; the transitions are described in this module's docstring."""

    RECORDING = "recording"
    TUNING = "tuning"
    TUNED = "tuned"
    EAGER = "eager"
    SKIPPED = "skipped"


def matches(entry: str, module: torch.nn.Module, name: str) -> bool:
    """Does a ``skip_modules`` / ``patch_exclude`` entry name this module? By class name, qualified class
    name, package (prefix of the class's module) or module path (``"SentenceEncoder.bert.pooler"``)."""
    cls = patching.original_class(module)
    package = cls.__module__
    return entry in (cls.__name__, cls.__qualname__, f"{package}.{cls.__qualname__}", name) or (
        package == entry or package.startswith(entry + "."))


def exclusion(module: torch.nn.Module, name: str, num_parameters: int) -> tuple[str, bool] | None:
    """Why ``module`` is not tuned, and whether its children may be tried instead; None when it may be.

    Returns:
        ``(reason, children_tried)`` or None.
    """
    cls = patching.original_class(module)
    package = cls.__module__
    for excluded in BUILTIN_EXCLUDED_PACKAGES:
        if package == excluded or package.startswith(excluded + "."):
            return f"{cls.__qualname__} from {excluded} is left alone (built-in exclusion)", False
    if any(wrapper.module is module for wrapper in registered_modules()):
        return "wrapped by aitune.torch.Module already: ait.tune tunes it", False
    for entry in jit_config.skip_modules:
        if matches(entry, module, name):
            return f"in jit_config.skip_modules ({entry!r})", False
    if num_parameters < jit_config.min_parameters:
        return f"{num_parameters} parameter(s) < jit_config.min_parameters={jit_config.min_parameters}", False
    for entry in jit_config.patch_exclude:
        if matches(entry, module, name):
            return f"in jit_config.patch_exclude ({entry!r}): its children are tried", True
    return None


def child_modules(module: torch.nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.nn.Module]]:
    """Direct children by attribute path, looking through ModuleList/ModuleDict (``layer.0``, ``layer.1``)."""
    for name, child in module.named_children():
        if isinstance(child, _CONTAINERS):
            yield from child_modules(child, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", child


def route(module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    """What a patched module's ``__call__`` does: hand the call to its PatchedModule."""
    node = state.seen.get(module)
    if node is None or node.twin is None:
        return patching.original_class(module).__call__(module, *args, **kwargs)
    return node.call(args, kwargs)


class PatchedModule:
    """A module discovered by just-in-time tuning (read its attributes; :func:`aitune.torch.jit.describe`
    renders them all).

    Attributes:
        name: ``Class`` for a top-level module, ``Parent.attribute.path`` for a child.
        level: 0 for a top-level module, parent's level + 1 for a child.
        class_name: qualified class name. num_parameters: parameter elements.
        state: :class:`JitState`. reason: why it was skipped or could not be tuned ("" otherwise).
        calls: calls routed through it. eager_calls: calls that ran eager without being recorded, by reason
            (training mode, autograd needed, tuning in progress on another thread).
        backends: chosen backend description per graph name (TUNED only).
        report_path: the tune report (JSON) of its tuning. tuning_s: how long the tuning paused the run, s.
        graphs: recorded input specs (``GraphSpec.describe()``), kept after tuning.
        children: the children tried after it could not be tuned (top-down), in attribute order.
        note: what happened below it (children not tried, samples not replayed).
    """

    def __init__(self, module: torch.nn.Module, name: str, level: int, parent: "PatchedModule | None" = None):
        cls = patching.original_class(module)
        self.name = name
        self.level = level
        self.class_name = f"{cls.__module__}.{cls.__qualname__}"
        self.num_parameters = sum(parameter.numel() for parameter in module.parameters())
        self.state = JitState.RECORDING
        self.reason = ""
        self.note = ""
        self.calls = 0
        self.eager_calls: dict[str, int] = {}
        self.backends: dict[str, str] = {}
        self.report_path: str | None = None
        self.tuning_s: float | None = None
        self.graphs: list[dict] = []
        self.children: list[PatchedModule] = []
        self.twin: torch.nn.Module | None = None
        self.wrapper: Module | None = None
        self._module = weakref.ref(module)
        self._parent = weakref.ref(parent) if parent is not None else None
        self._warned: set[str] = set()
        self.part_of_tracked = False  # a top-level call of a module inside a tracked one (see track())

    # ---- accessors
    @property
    def module(self) -> torch.nn.Module | None:
        """The user's module (None once the user dropped it)."""
        return self._module()

    @property
    def parent(self) -> "PatchedModule | None":
        return self._parent() if self._parent is not None else None

    @property
    def recorded_calls(self) -> int:
        """Calls recorded so far (0 when not recording)."""
        return sum(graph.num_calls for graph in self.wrapper.graphs) if self.wrapper is not None else 0

    def stats(self) -> dict | None:
        """The tuned wrapper's run-time stats (guard checks, eager fallbacks; see ``aitune.torch.Module.stats``)."""
        return self.wrapper.stats if self.wrapper is not None and self.state is JitState.TUNED else None

    def waiting_for(self) -> str | None:
        """What a RECORDING module still waits for before eager-mode tuning (None: ready)."""
        if self.state is not JitState.RECORDING or self.wrapper is None:
            return f"not recording ({self.state.value})"
        calls = self.recorded_calls
        if calls < jit_config.min_samples:
            return f"{calls}/{jit_config.min_samples} recorded calls (jit_config.min_samples)"
        if jit_config.batch_axis_required and not any(graph.is_dynamic for graph in self.wrapper.graphs
                                                      if graph.samples):
            return (f"an input axis that varies: {calls} recorded calls had one shape each time "
                    "(jit_config.batch_axis_required; set it False to tune fixed shapes)")
        return None

    def __repr__(self) -> str:
        detail = ", ".join(self.backends.values()) if self.state is JitState.TUNED else self.reason
        return f"PatchedModule({self.name!r}, level={self.level}, state={self.state.value}" + (
            f", {detail}" if detail else "") + ")"

    # ---- life cycle
    def start_recording(self) -> None:
        """Route the module's calls here and record them (the module gets its routing class)."""
        module = self.module
        twin = patching.make_twin(module)
        wrapper = Module(twin, name=self.name, strategy=jit_config.resolve_strategy(),
                         max_samples=jit_config.max_samples, guard=jit_config.guard)
        unregister(wrapper)  # ait.tune()/ait.save() must not pick up JIT's internal wrappers
        patching.patch(module, route)
        self.twin, self.wrapper = twin, wrapper
        self.state = JitState.RECORDING

    def skip(self, reason: str) -> None:
        self.state = JitState.SKIPPED
        self.reason = reason

    def release(self) -> None:
        """Put the original class back and release the backends (``disable()``)."""
        module = self.module
        if module is not None:
            patching.unpatch(module)
        if self.wrapper is not None:
            self.wrapper.mark_failed("just-in-time tuning was disabled")
        self.wrapper = None
        self.twin = None

    # ---- calls
    def call(self, args: tuple, kwargs: dict) -> Any:
        """One call of the user's module (see the module docstring for what each state does)."""
        thread = state.thread
        thread.active += 1
        try:
            self.calls += 1
            twin = self.twin
            status = self.state
            if thread.suspended or status not in (JitState.RECORDING, JitState.TUNED):
                if status is JitState.TUNING:
                    self._count_eager("tuning in progress")
                return twin(*args, **kwargs)
            why = self._not_for_tuning(twin, args, kwargs)
            if why is not None:
                self._count_eager(why)
                return twin(*args, **kwargs)
            if status is JitState.TUNED:
                return self.wrapper(*args, **kwargs)
            if self._adds_nothing(args, kwargs):
                output = twin(*args, **kwargs)
            else:
                try:
                    output = self.wrapper(*args, **kwargs)
                except AITuneError as exc:  # the recorder's own failure, never the module's
                    self._give_up(f"recording its calls failed: {exc}")
                    return twin(*args, **kwargs)
            if (not thread.replaying and jit_config.mode is JITMode.TUNE_EAGER
                    and self.waiting_for() is None):
                self.tune()
            return output
        finally:
            thread.active -= 1

    def _not_for_tuning(self, twin: torch.nn.Module, args: tuple, kwargs: dict) -> str | None:
        # NOTE [inference calls only]: backends run under no_grad and checks need deterministic outputs, so
        # calls in training mode (dropout, batch statistics) or that build an autograd graph run eager and
        # are not recorded: tuning must never take gradients away from the caller.
        if twin.training:
            return "training mode"
        if torch.is_grad_enabled():
            if any(parameter.requires_grad for parameter in twin.parameters()):
                return "autograd needed (grad enabled and parameters require grad: use torch.no_grad())"
            if any(isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in tree_flatten((args, kwargs))[0]):
                return "autograd needed (inputs require grad)"
        return None

    def _adds_nothing(self, args: tuple, kwargs: dict) -> bool:
        # NOTE [recording stops paying]: recording clones every call's inputs. A module still waiting after
        # RECORDED_ENOUGH calls (fixed shapes with batch_axis_required, or deferred mode) records only calls
        # that bring a new input structure or a size outside the recorded ranges; the others run eager.
        if self.recorded_calls < max(RECORDED_ENOUGH, jit_config.min_samples):
            return False
        graphs = [graph for graph in self.wrapper.graphs if graph.samples and graph.signature is not None]
        if not graphs:
            return False
        try:
            leaves, spec = tree_flatten(graphs[0].signature.normalize(args, kwargs))
        except TypeError:  # a call Python would refuse: let the recorder (and the module) say so
            return False
        key = make_graph_key(leaves, spec)
        return any(graph.key == key and graph.covers(leaves) for graph in graphs)

    def _count_eager(self, why: str) -> None:
        self.eager_calls[why] = self.eager_calls.get(why, 0) + 1
        if why not in self._warned and why != "tuning in progress":
            self._warned.add(why)
            logger.warning("aitune jit: %s: calls in %s run eager and are not recorded", self.name, why)

    # ---- tuning
    def tune(self, force: bool = False) -> None:
        """Tune now (the caller's thread pauses); when that fails, try the children, top down.

        Args:
            force: tune children as soon as they recorded a call (``tune_now()``), instead of waiting for
                ``min_samples`` and a varying axis.
        """
        if not state.lock.acquire(blocking=False):
            return  # another thread is tuning: this module is tuned at a later call
        try:
            if self.state is JitState.RECORDING:
                self._tune(force)
        finally:
            state.lock.release()

    def _tune(self, force: bool) -> None:
        self.state = JitState.TUNING
        wrapper = self.wrapper
        started = time.perf_counter()
        logger.info("aitune jit: tuning %s after %d recorded call(s); the run pauses until it is done",
                    self.name, self.recorded_calls)
        report = None
        with state.suspended():
            try:
                report = tune_modules([wrapper], device=jit_config.device,
                                      cache_dir_path=jit_config.resolved_cache_dir())
            except Exception as exc:  # noqa: BLE001 - tuning never takes the user's run down
                wrapper.mark_failed(f"{type(exc).__name__}: {exc}")
        self.tuning_s = time.perf_counter() - started
        self.report_path = report.path if report is not None else None
        self.graphs = [graph.describe() for graph in wrapper.graphs]
        why_not = _why_not_tuned(wrapper, report)
        if why_not is None:
            self.state = JitState.TUNED
            self.backends = {graph.name: backend.describe() for graph, backend in wrapper.tuned_graphs()}
            logger.info("aitune jit: %s is tuned (%s) in %.1f s", self.name,
                        ", ".join(f"{graph}: {backend}" for graph, backend in self.backends.items()), self.tuning_s)
            return
        self._give_up(why_not)
        self.descend(force)

    def _give_up(self, reason: str) -> None:
        self.state = JitState.EAGER
        self.reason = reason
        if self.wrapper is not None and self.wrapper.state is not ModuleState.PASSTHROUGH:
            self.wrapper.mark_failed(reason)  # releases any backend it still holds
        logger.info("aitune jit: %s runs eager: %s", self.name, reason)

    def descend(self, force: bool = False) -> None:
        """Try the children (after this module could not be tuned, or was excluded with children tried)."""
        module = self.module
        if module is None:
            return
        if self.level + 1 >= jit_config.max_depth_level:
            self.note = f"children not tried (jit_config.max_depth_level={jit_config.max_depth_level})"
            self._drop_recording()
            return
        for path, child in child_modules(module):
            track(child, f"{self.name}.{path}", self.level + 1, parent=self)
        self._replay()
        self._drop_recording()
        for child in self.children:
            child.tune_pending(force)

    def tune_pending(self, force: bool = False) -> None:
        """Tune this module if it is ready (``force``: if it recorded anything); else look below it."""
        if self.state is JitState.RECORDING:
            if (self.recorded_calls > 0) if force else (self.waiting_for() is None):
                self.tune(force)
        elif self.state in (JitState.EAGER, JitState.SKIPPED):
            for child in self.children:
                child.tune_pending(force)

    def _replay(self) -> None:
        """Run the recorded samples through the module once more so its (now patched) children record."""
        wrapper = self.wrapper
        if wrapper is None or not self.children or not jit_config.replay_samples:
            return
        graphs = wrapper.graphs
        if any(graph.stateful or graph.mutated_inputs for graph in graphs):
            self.note = "samples not replayed (it changes its own state or its inputs): children record on later calls"
            return
        try:
            with torch.no_grad(), state.replaying():
                for graph in graphs:
                    for sample in graph.samples:
                        sample = sample.clone()
                        self.twin(*sample.args, **sample.kwargs)
        except Exception as exc:  # noqa: BLE001 - replaying is an optimisation
            self.note = f"replaying samples failed ({type(exc).__name__}: {exc}): children record on later calls"
            logger.debug("aitune jit: replaying %s failed", self.name, exc_info=True)

    def _drop_recording(self) -> None:
        """Release the samples of a module that will not be tuned (its calls go straight to the twin)."""
        if self.wrapper is not None:
            self.graphs = self.graphs or [graph.describe() for graph in self.wrapper.graphs]
        self.wrapper = None

    # ---- reporting
    def to_dict(self) -> dict:
        """JSON-able summary of this module and, nested, its children (what :func:`hierarchy` returns)."""
        return {"name": self.name, "level": self.level, "class": self.class_name,
                "num_parameters": self.num_parameters, "state": self.state.value, "reason": self.reason,
                "note": self.note, "calls": self.calls, "recorded_calls": self.recorded_calls,
                "eager_calls": dict(self.eager_calls), "waiting_for": self.waiting_for()
                if self.state is JitState.RECORDING else None, "backends": dict(self.backends),
                "tuning_s": self.tuning_s, "report_path": self.report_path, "graphs": self.graphs,
                "runtime": self.stats(), "children": [child.to_dict() for child in self.children]}


def _why_not_tuned(wrapper: Module, report) -> str | None:
    """None when some graph got a backend other than plain eager; else the reason, from the report."""
    if wrapper.state is not ModuleState.TUNED:
        return f"tuning failed: {wrapper.tuning_error}"
    chosen = [backend for _, backend in wrapper.tuned_graphs()]
    if not chosen:
        return "no recorded call completed (every one raised), so there was nothing to tune"
    if any(not getattr(backend, "passthrough", False) for backend in chosen):
        return None
    reasons = []
    for entry in report.graphs if report is not None else []:
        rejected = "; ".join(f"{row.backend} {row.status}: {row.reason}" for row in entry.candidates
                             if row.backend != "eager" and row.reason)
        reasons.append(f"{entry.graph}: {entry.selection_reason}" + (f" ({rejected})" if rejected else ""))
    return "no backend passed the checks and beat eager" + (" — " + " | ".join(reasons) if reasons else "")


def track(module: torch.nn.Module, name: str, level: int, parent: PatchedModule | None = None) -> PatchedModule | None:
    """Look at ``module`` once: patch it for recording, or mark it skipped (trying its children when the
    rule allows). Returns its PatchedModule (None for a module tracked elsewhere already)."""
    existing = state.seen.get(module)
    if existing is not None:
        if not (parent is not None and existing.part_of_tracked):
            return None
        del state.seen[module]  # called on its own earlier, now tried as the child it is
    node = PatchedModule(module, name, level, parent)
    conflict = _conflict(module) if parent is None else None
    excluded = exclusion(module, name, node.num_parameters)
    state.seen[module] = node
    if parent is not None:
        parent.children.append(node)
    if conflict is not None:
        node.skip(conflict)
        node.part_of_tracked = conflict.startswith("part of")
    elif excluded is not None:
        reason, children_tried = excluded
        node.skip(reason)
        if children_tried:
            node.descend()
    else:
        try:
            node.start_recording()
        except TypeError as exc:  # a class Python will not let us swap
            node.skip(f"its calls cannot be routed ({exc}): its children are tried")
            node.descend()
    return node


def _conflict(module: torch.nn.Module) -> str | None:
    """A top-level module that holds, or is held by, a module tracked already is left alone: tuning both
    would compile one inside the other."""
    for sub in module.modules():
        node = state.seen.get(sub)
        if node is not None and node.state is not JitState.SKIPPED and sub is not module:
            return f"contains {node.name}, which is tracked on its own"
    for node in list(state.seen.values()):
        owner = node.module
        if node.level == 0 and owner is not None and owner is not module and any(
                sub is module for sub in owner.modules()):
            return f"part of {node.name}, which is tracked already"
    return None
