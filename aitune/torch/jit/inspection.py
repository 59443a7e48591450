"""Inspect mode of just-in-time tuning: time and describe every module a run calls; tune nothing.

Switched on by ``import aitune.torch.jit.enable_inspection as inspection`` (or calling it with settings);
``inspection.save_report(path, model_name)`` writes the "Model Inspector" page
(:func:`aitune.torch.report.html.render_jit_inspection`), and a run that never saved one writes
``jit_inspect_<timestamp>.html`` at exit. ``aitune.torch.jit.disable()`` puts every class back.

Discovery is the tuning mode's (NOTE [discovery by global hooks]): a top-level call makes aitune look at its
module once. Inspection then tracks that module *and its children at once*, top down through
``ModuleList``/``ModuleDict`` entries, to ``jit_config.max_depth_level`` (7 here: levels 0..6), with the same
exclusion rules (``skip_modules``, ``patch_exclude``, ``min_parameters`` — 0 unless you set it —, the
built-in exclusions). Each tracked module gets the routing class of NOTE [routing by class swap and a twin],
routed to its :class:`InspectModule`, which calls the original ``__call__`` on the same object: outputs,
hooks and autograd are eager's, bit for bit, in training mode too. No twin is needed (nothing is compiled),
so the records keep no reference to your weights and outlive the model.

Per module: calls, total time, self time (total minus the inspected calls made inside it), the largest
call, the distinct input and output type signatures (tensor dtype, shape range, device; other values by
type), the axes that varied in step with the batch size (batch axes; visible once two batch sizes were
seen), parameters and their dtypes, and where it sits in the hierarchy.

NOTE [inspection timing]: ``time.perf_counter`` around the call; when the module's parameters or any input
tensor are on CUDA, ``torch.cuda.synchronize`` first (so the caller's queued kernels stay the caller's
time) and again after (so the module's own kernels are its time). Recording a call's types happens outside
that window; self times leave this bookkeeping out, total times include that of the modules inside (the
report states how much it was). The discovering call (a top-level module's first) is timed by the discovery
hooks themselves: it counts, but the hook sees only its positional arguments — a signature seen only on
that call is marked so. Module calls that do not go through ``module(...)`` (``child.forward(x)``, modules
held outside the registered children) count as their caller's self time.

States (the reference's ``InspectModule`` states): ``INIT`` tracked, no call yet; ``INSPECT`` its calls are
timed (the tuning mode's RECORDING, without recording samples); ``SKIPPED`` excluded by a rule, the reason
kept (the tuning mode's SKIPPED); ``DETACHED`` its own class is back after ``disable()``: the records stay
for ``save_report`` until :func:`aitune.torch.jit.reset` or the next ``enable_inspection``.
"""

from __future__ import annotations

import atexit
import datetime
import enum
import logging
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import torch

from aitune.torch.common.dtypes import dtype_name
from aitune.torch.jit import patching, state
from aitune.torch.jit.config import jit_config
from aitune.torch.jit.patched_module import child_modules, exclusion
from aitune.torch.record.pytree import tree_flatten
from aitune.torch.record.samples import BATCH, GraphSpec, Sample, infer_batch_size
from aitune.torch.record.signature import CallSignature, positional_parameter_names

logger = logging.getLogger(__name__)

__all__ = ["InspectModule", "InspectState", "TypeSignatures", "describe", "modules", "save_report", "to_dict"]

REPORT_PREFIX = "jit_inspect_"
MAX_SIGNATURES = 16  # distinct signatures kept per module and side; further calls are counted as "other"


class InspectState(str, enum.Enum):
    INIT = "init"
    INSPECT = "inspect"
    SKIPPED = "skipped"
    DETACHED = "detached"


_TIMED = (InspectState.INIT, InspectState.INSPECT)
_INFER = object()


# ============================================================================================ type signatures


class TypeSignatures:
    """The distinct type signatures of one side (inputs or outputs) of a module's calls.

    A signature is a call's structure plus, per leaf, a tensor's dtype, rank and device or another value's
    type (values themselves do not split signatures: a Python float timestep is one signature). Shapes are
    kept as ranges and their axes classified by :class:`aitune.torch.record.samples.GraphSpec`, which is given no
    room for samples (``max_samples=0``): it keeps shapes, not tensors.
    """

    def __init__(self, positional_names: list[str]):
        self._positional_names = positional_names
        self._entries: dict[Any, dict] = {}
        self.other_calls = 0

    def add(self, args: tuple, kwargs: dict, batch_size: Any = _INFER,
            first_call_only: bool = False) -> tuple[list[Any], int | None]:
        """Count one call of ``(args, kwargs)``; ``batch_size``: the call's (default: dim 0 of its first
        tensor). Returns its flattened leaves and that batch size."""
        if kwargs:
            kwargs = dict(sorted(kwargs.items()))
        values = (*args, *kwargs.values()) if kwargs else args
        if all(isinstance(value, torch.Tensor) for value in values):
            # Fast path, tensors only (most module calls): no flattening; the structure is (args, keyword names).
            leaves, spec = list(values), None
            key = (len(args), tuple(kwargs), tuple((leaf.dtype, leaf.dim(), leaf.device.type) for leaf in leaves))
        else:
            leaves, spec = tree_flatten((args, kwargs))
            key = (spec, tuple(("tensor", leaf.dtype, leaf.dim(), leaf.device.type)
                               if isinstance(leaf, torch.Tensor) else ("value", type(leaf).__qualname__)
                               for leaf in leaves))
        if batch_size is _INFER:
            batch_size = infer_batch_size(leaves)
        entry = self._entries.get(key)
        if entry is None:
            if len(self._entries) >= MAX_SIGNATURES:
                self.other_calls += 1
                return leaves, batch_size
            if spec is None:
                spec = tree_flatten((args, kwargs))[1]
            graph = GraphSpec(len(self._entries), key, spec, leaves, max_samples=0,
                              positional_names=self._positional_names)
            graph.constants = {}  # values are not kept (types are, below)
            entry = {"graph": graph, "calls": 0, "hook_calls": 0,
                     "kinds": [leaf.device.type if isinstance(leaf, torch.Tensor) else type(leaf).__qualname__
                               for leaf in leaves]}
            self._entries[key] = entry
        entry["calls"] += 1
        entry["hook_calls"] += first_call_only
        entry["graph"].add(Sample(args, kwargs, batch_size), leaves)  # shapes only (max_samples=0)
        return leaves, batch_size

    def describe(self) -> list[dict]:
        """One dict per signature, most called first: ``text`` (``x: float32[2..8b, 16]``, ``b`` = batch
        axis), ``calls``, ``first_call_only`` (seen only by the discovery hook: positional arguments only),
        ``leaves`` and ``batch_axes`` (``["x: axis 0"]``)."""
        described = []
        for entry in self._entries.values():
            graph = entry["graph"]
            by_leaf = {spec.leaf_index: spec for spec in graph.tensor_specs}
            leaves, parts, batch_axes = [], [], []
            for index, (path, kind) in enumerate(zip(graph.input_paths, entry["kinds"])):
                spec = by_leaf.get(index)
                if spec is None:
                    leaves.append({"path": path, "type": kind})
                    parts.append(f"{path}: {kind}")
                    continue
                dims = [(str(low) if low == high else f"{low}..{high}") + ("b" if axis == BATCH else "")
                        for low, high, axis in zip(spec.min_shape, spec.max_shape, spec.axes)]
                text = f"{path}: {dtype_name(spec.dtype)}[{', '.join(dims)}]" + ("" if kind == "cpu" else f" {kind}")
                parts.append(text)
                batch_axes += [f"{path}: axis {axis}" for axis, name in enumerate(spec.axes) if name == BATCH]
                leaves.append({"path": path, "type": "Tensor", "dtype": dtype_name(spec.dtype), "device": kind,
                               "min_shape": list(spec.min_shape), "max_shape": list(spec.max_shape),
                               "axes": list(spec.axes)})
            described.append({"text": ", ".join(parts) or "()", "calls": entry["calls"],
                              "first_call_only": entry["hook_calls"] == entry["calls"], "leaves": leaves,
                              "batch_axes": batch_axes})
        described.sort(key=lambda item: -item["calls"])
        return described


# ============================================================================================ modules


class InspectModule:
    """One tracked module's records (read its attributes; :func:`to_dict` has them all as JSON).

    Attributes:
        name: ``Class`` for a top-level module, ``Parent.attribute.path`` below it. path: the attribute path
            under its parent (``""`` at the top). level: 0 at the top.
        class_name: qualified class name. num_parameters: parameter elements (its children's included).
            precisions: dtype names of its parameters. device: where its first parameter or buffer lives.
        sync_device: the CUDA device synchronised around its calls (its parameters'; None when they are not
            on CUDA: then a call's first CUDA input's device, if any).
        state: :class:`InspectState`. reason: why it is skipped. note: what was not tracked below it.
        calls: calls timed. total_s / max_s: time in its calls, all / the longest, s.
        inputs / outputs: :class:`TypeSignatures`. children: tracked children, in attribute order.
    """

    part_of_tracked = False  # read by the tuning mode's track(); inspection never marks it

    def __init__(self, module: torch.nn.Module, name: str, path: str, level: int, parent: "InspectModule | None"):
        cls = patching.original_class(module)
        self.name, self.path, self.level, self.parent = name, path, level, parent
        self.class_name = f"{cls.__module__}.{cls.__qualname__}"
        parameters = list(module.parameters())
        self.num_parameters = sum(parameter.numel() for parameter in parameters)
        self.precisions = sorted({dtype_name(parameter.dtype) for parameter in parameters})
        first = next(iter(parameters), None)
        if first is None:
            first = next(module.buffers(), None)
        self.device = str(first.device) if first is not None else None
        self.sync_device = first.device if first is not None and first.device.type == "cuda" else None
        self.state = InspectState.INIT
        self.reason = ""
        self.note = ""
        self.calls = 0
        self.total_s = 0.0
        self.max_s = 0.0
        self.inner_s = 0.0  # in the inspected calls made inside its calls
        self.inner_overhead_s = 0.0  # recording those calls' types
        self.inputs = TypeSignatures(positional_parameter_names(CallSignature(module.forward)))
        self.outputs = TypeSignatures(["output"])
        self.children: list[InspectModule] = []
        self._module = weakref.ref(module)
        self._call = cls.__call__

    @property
    def module(self) -> torch.nn.Module | None:
        """The user's module (None once the user dropped it)."""
        return self._module()

    @property
    def self_s(self) -> float:
        """Total time minus the inspected calls inside it and their bookkeeping, s."""
        return max(self.total_s - self.inner_s - self.inner_overhead_s, 0.0)

    def __repr__(self) -> str:
        return (f"InspectModule({self.name!r}, level={self.level}, state={self.state.value}, calls={self.calls}, "
                f"total={self.total_s * 1e3:.3f} ms, self={self.self_s * 1e3:.3f} ms)")

    def skip(self, reason: str) -> None:
        self.state = InspectState.SKIPPED
        self.reason = reason

    def release(self) -> None:
        """Put the original class back (``disable()``); the records stay."""
        module = self.module
        if module is not None:
            patching.unpatch(module)
        if self.state in _TIMED:
            self.state = InspectState.DETACHED

    def call(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        """One routed call: timed around the original ``__call__`` (NOTE [inspection timing])."""
        timing = _open(self, args, kwargs, first_call_only=False)
        thread = state.thread
        thread.active += 1  # a routed call is not a top-level call to discover
        try:
            output = self._call(module, *args, **kwargs)
        except BaseException:
            thread.active -= 1
            _close(timing, None, raised=True)
            raise
        thread.active -= 1
        _close(timing, output)
        return output

    def to_dict(self) -> dict:
        """JSON-able records of this module and, nested, its children."""
        inputs, outputs = self.inputs.describe(), self.outputs.describe()
        return {"name": self.name, "path": self.path, "level": self.level, "class": self.class_name,
                "state": self.state.value, "reason": self.reason, "note": self.note,
                "num_parameters": self.num_parameters, "precisions": self.precisions, "device": self.device,
                "calls": self.calls, "total_s": self.total_s, "self_s": self.self_s, "max_s": self.max_s,
                "avg_s": self.total_s / self.calls if self.calls else 0.0,
                "inputs": inputs, "other_input_calls": self.inputs.other_calls,
                "outputs": outputs, "other_output_calls": self.outputs.other_calls,
                "batch_axes": sorted({axis for signature in inputs for axis in signature["batch_axes"]}),
                "children": [child.to_dict() for child in self.children]}


# ---- timing (NOTE [inspection timing])
class _Timing:
    """One timed call in progress; also the frame its inner inspected calls add their time to."""

    __slots__ = ("node", "batch_size", "cuda_device", "started", "overhead_s", "inner_s", "inner_overhead_s")

    def __init__(self, node: InspectModule):
        self.node = node
        self.inner_s = 0.0
        self.inner_overhead_s = 0.0


class _ThreadFrames(threading.local):
    def __init__(self):
        self.stack: list[_Timing] = []
        self.discovering: list[tuple[torch.nn.Module, _Timing]] = []


_frames = _ThreadFrames()
_clock = time.perf_counter  # seconds, monotonic; one name, so that tests can put a fake clock in its place
_record_lock = threading.Lock()


def _open(node: InspectModule, args: tuple, kwargs: dict, first_call_only: bool) -> _Timing:
    begin = _clock()
    timing = _Timing(node)
    try:
        with _record_lock:
            leaves, timing.batch_size = node.inputs.add(args, kwargs, first_call_only=first_call_only)
    except Exception:  # noqa: BLE001 - describing a call never breaks it
        leaves, timing.batch_size = [], None
        _recording_failed(node, "inputs")
    cuda_device = node.sync_device
    if cuda_device is None:
        cuda_device = next((leaf.device for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.is_cuda), None)
    timing.cuda_device = cuda_device
    _frames.stack.append(timing)
    timing.overhead_s = _clock() - begin
    if cuda_device is not None:
        torch.cuda.synchronize(cuda_device)
    timing.started = _clock()
    return timing


def _close(timing: _Timing, output: Any, raised: bool = False) -> None:
    if timing.cuda_device is not None:
        try:
            torch.cuda.synchronize(timing.cuda_device)
        except Exception:  # noqa: BLE001 - the call's own error is the one to see
            if not raised:
                raise
    ended = _clock()
    elapsed = ended - timing.started
    stack = _frames.stack
    if stack and stack[-1] is timing:
        stack.pop()
    elif timing in stack:  # a frame left open by a call that never returned to us
        del stack[stack.index(timing):]
    node = timing.node
    if not raised:
        try:
            with _record_lock:
                node.outputs.add((output,), {}, timing.batch_size)
        except Exception:  # noqa: BLE001 - describing a call never breaks it
            _recording_failed(node, "outputs")
    with _record_lock:
        node.calls += 1
        node.total_s += elapsed
        node.max_s = max(node.max_s, elapsed)
        node.inner_s += timing.inner_s
        node.inner_overhead_s += timing.inner_overhead_s
        if node.state is InspectState.INIT:
            node.state = InspectState.INSPECT
    if stack:
        caller = stack[-1]
        caller.inner_s += elapsed
        caller.inner_overhead_s += timing.overhead_s + (_clock() - ended)


def _recording_failed(node: InspectModule, side: str) -> None:
    if f"{side} not described" not in node.note:
        node.note = (node.note + "; " if node.note else "") + f"{side} not described (recording them failed)"
        logger.debug("aitune jit: describing the %s of %s failed", side, node.name, exc_info=True)


def begin_discovering_call(module: torch.nn.Module, node: InspectModule, args: tuple) -> None:
    """The discovery pre-hook saw ``node``'s first call (positional ``args`` only): time it too."""
    if node.state in _TIMED:
        _frames.discovering.append((module, _open(node, args, {}, first_call_only=True)))


def end_discovering_call(module: torch.nn.Module, output: Any) -> None:
    """The discovery post-hook at depth 0: close the discovering call of ``module``, if one is open."""
    discovering = _frames.discovering
    if discovering and discovering[-1][0] is module:
        _close(discovering.pop()[1], output)


# ============================================================================================ tracking


def _route(module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    node = state.seen.get(module)
    if isinstance(node, InspectModule) and node.state in _TIMED:
        return node.call(module, args, kwargs)
    return patching.original_class(module).__call__(module, *args, **kwargs)


def track(module: torch.nn.Module, name: str) -> InspectModule:
    """Track a discovered top-level module and, top down, its children (caller holds discovery's lock)."""
    return _track(module, name, "", 0, None)


def _track(module: torch.nn.Module, name: str, path: str, level: int, parent: InspectModule | None) -> InspectModule:
    node = InspectModule(module, name, path, level, parent)
    state.seen[module] = node
    (parent.children if parent is not None else _session.roots).append(node)
    excluded = exclusion(module, name, node.num_parameters)
    if excluded is not None:
        reason, children_tried = excluded
        node.skip(reason.replace("children are tried", "children are inspected"))
        if children_tried:
            _track_children(node, module)
        return node
    try:
        patching.patch(module, _route)
    except TypeError as exc:  # a class Python will not let us swap
        node.skip(f"its calls cannot be routed ({exc}): its children are inspected")
    _track_children(node, module)
    return node


def _track_children(node: InspectModule, module: torch.nn.Module) -> None:
    children = list(child_modules(module))
    if children and node.level + 1 >= jit_config.max_depth_level:
        node.note = (f"{len(children)} child module(s) not inspected "
                     f"(jit_config.max_depth_level={jit_config.max_depth_level})")
        return
    elsewhere = []
    for path, child in children:
        existing = state.seen.get(child)
        if existing is None:
            _track(child, f"{node.name}.{path}", path, node.level + 1, node)
        elif isinstance(existing, InspectModule) and existing.parent is None and existing in _session.roots:
            _adopt(existing, node, path)  # called on its own first, now found as the child it is
        else:
            elsewhere.append(f"{path} (tracked already as {existing.name})")
    if elsewhere:
        node.note = "not repeated here: " + ", ".join(elsewhere)


def _adopt(node: InspectModule, parent: InspectModule, path: str) -> None:
    _session.roots.remove(node)
    node.parent, node.path = parent, path
    parent.children.append(node)

    def place(item: InspectModule, name: str, level: int) -> None:
        item.name, item.level = name, level
        for child in item.children:
            place(child, f"{name}.{child.path}", level + 1)

    place(node, f"{parent.name}.{path}", parent.level + 1)


# ============================================================================================ session


class _Session:
    def __init__(self):
        self.roots: list[InspectModule] = []
        self.started_at: str | None = None
        self.report_dir: str | None = None
        self.saved_path: str | None = None
        self.previous_settings: dict | None = None
        self.exit_registered = False


_session = _Session()


def begin(previous_settings: dict) -> None:
    """Start an inspection (``enable_inspection``): a new one when none is running."""
    if _session.previous_settings is not None:
        return  # running already
    if _session.roots and _session.saved_path is None:
        logger.warning("aitune jit: a new inspection starts: the records of the previous one (%d module(s), never "
                       "saved) are dropped", len(modules()))
    _session.roots.clear()
    _session.saved_path = None
    _session.started_at = _now()
    _session.report_dir = os.getcwd()
    _session.previous_settings = dict(previous_settings)
    if not _session.exit_registered:
        _session.exit_registered = True
        atexit.register(_at_exit)


def end() -> dict | None:
    """Inspection stops (``disable()``): returns the settings it had replaced (to restore), None if none."""
    previous, _session.previous_settings = _session.previous_settings, None
    for node in modules():
        if node.state in _TIMED:
            node.release()
    _frames.stack.clear()
    _frames.discovering.clear()
    return previous


def clear() -> None:
    """Forget every record (``reset()``)."""
    end()
    _session.roots.clear()
    _session.saved_path = None


def is_running() -> bool:
    return _session.previous_settings is not None


def modules() -> list[InspectModule]:
    """Every tracked module: top-level ones in discovery order, each followed by its subtree (depth first)."""
    ordered: list[InspectModule] = []

    def visit(node: InspectModule) -> None:
        ordered.append(node)
        for child in node.children:
            visit(child)

    for root in list(_session.roots):
        visit(root)
    return ordered


def _timed_total_s() -> float:
    """Time in the top-most timed calls: the roots', or their timed children's where a root was skipped, s."""
    total = 0.0

    def visit(node: InspectModule) -> None:
        nonlocal total
        if node.calls:
            total += node.total_s
        else:
            for child in node.children:
                visit(child)

    for root in _session.roots:
        visit(root)
    return total


def to_dict(model_name: str | None = None) -> dict:
    """The inspection as JSON-able data (what the report page shows).

    Returns:
        ``{"model_name", "started_at", "created_at", "running", "total_s" (s in the top-most timed calls),
        "overhead_s" (bookkeeping of inspected calls made inside others, s), "settings", "modules" (one
        :meth:`InspectModule.to_dict` tree per top-level module), "environment"}``.
    """
    from aitune.torch.common.environment import environment

    nodes = modules()
    with _record_lock:
        trees = [root.to_dict() for root in _session.roots]
    return {"model_name": model_name or ", ".join(root.name for root in _session.roots) or "model",
            "started_at": _session.started_at, "created_at": _now(), "running": is_running(),
            "total_s": _timed_total_s(), "overhead_s": sum(node.inner_overhead_s for node in nodes),
            "settings": {name: jit_config.to_dict()[name] for name in
                         ("mode", "max_depth_level", "min_parameters", "skip_modules", "patch_exclude")},
            "modules": trees, "environment": environment()}


def render() -> str:
    """A text table of the tracked modules (what ``aitune.torch.jit.describe()`` shows in inspect mode)."""
    from tabulate import tabulate

    total = _timed_total_s()
    rows = [["  " * node.level + node.name, node.class_name.rsplit(".", 1)[-1], node.state.value, node.calls,
             f"{node.self_s * 1e3:.3f}", f"{node.total_s * 1e3:.3f}",
             f"{100 * node.self_s / total:.1f}" if total else "", node.num_parameters, node.reason or node.note]
            for node in modules()]
    if not rows:
        return "aitune jit inspection: no module discovered yet"
    table = tabulate(rows, headers=["module", "class", "state", "calls", "self ms", "total ms", "% self", "params",
                                    "reason / note"], tablefmt="github")
    return f"aitune jit inspection ({total * 1e3:.3f} ms in the top-level calls)\n{table}"


def describe() -> str:
    """:func:`render`'s table, also logged at INFO."""
    text = render()
    logger.info("%s", text)
    return text


def save_report(path: str | os.PathLike | None = None, model_name: str | None = None) -> Path:
    """Write the "Model Inspector" page: one self-contained HTML file (NOTE [self-contained pages] in
    :mod:`aitune.torch.report.html`): summary, a figure of the modules' time shares (with matplotlib), the
    collapsible module tree, and every module's times, calls, parameters, input/output types and batch axes.

    Args:
        path: the file to write (folders are created); an existing folder (or None) gets
            ``jit_inspect_<YYYYmmdd-HHMMSS>.html`` inside (None: ``jit_config.inspection_dir``, else the working
            directory of the moment inspection was enabled).
        model_name: the page's title (default: the top-level modules' names).

    Returns:
        The path written. Saving once means nothing is written at exit.

    Raises:
        OSError: the file cannot be written.
    """
    from aitune.torch.report.html import render_jit_inspection

    target = _report_path(path)
    page = render_jit_inspection(to_dict(model_name))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(page, encoding="utf-8")
    _session.saved_path = str(target)
    logger.info("aitune jit: inspection report written to %s", target)
    return target


def _report_path(path: str | os.PathLike | None) -> Path:
    if path is not None and not Path(path).is_dir():
        return Path(path)
    folder = Path(path if path is not None else jit_config.inspection_dir or _session.report_dir or os.getcwd())
    target = folder / f"{REPORT_PREFIX}{time.strftime('%Y%m%d-%H%M%S')}.html"
    if target.exists():
        target = target.with_name(f"{target.stem}-{os.getpid()}.html")
    return target


def _at_exit() -> None:
    """Write the report of an inspection that was never saved."""
    if _session.saved_path is not None or not _session.roots:
        if is_running() and not _session.roots:
            logger.info("aitune jit: inspection was enabled, but no module was called in this process")
        return
    try:
        path = save_report()
    except Exception:  # noqa: BLE001 - exit must go on
        logger.warning("aitune jit: writing the inspection report at exit failed", exc_info=True)
        return
    logger.warning("aitune jit: inspection report (save_report() was never called) written to %s", path)


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")
