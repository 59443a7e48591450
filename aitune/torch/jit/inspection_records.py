"""Inspect mode's records: one :class:`InspectModule` per tracked module, its input/output
:class:`TypeSignatures`, and the timing of its calls (NOTE [inspection timing] in
:mod:`aitune.torch.jit.inspection`)."""

from __future__ import annotations

import enum
import logging
import threading
import time
import weakref
from typing import Any

import torch

from aitune.torch.common.dtypes import dtype_name
from aitune.torch.jit import patching, state
from aitune.torch.record.pytree import tree_flatten
from aitune.torch.record.samples import BATCH, GraphSpec, Sample, infer_batch_size
from aitune.torch.record.signature import CallSignature, positional_parameter_names

logger = logging.getLogger(__name__)


MAX_SIGNATURES = 16  # distinct signatures kept per module and side; further calls are counted as "other"


class InspectState(str, enum.Enum):
    INIT = "init"
    INSPECT = "inspect"
    SKIPPED = "skipped"
    DETACHED = "detached"


TIMED = (InspectState.INIT, InspectState.INSPECT)
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
            # shapes only: no value read, which would wait for the device inside the timed window's bookkeeping
            # and move the caller's queued kernels out of its time (NOTE [inspection timing])
            graph = GraphSpec(len(self._entries), key, spec, leaves, max_samples=0,
                              positional_names=self._positional_names, keeps_value_ranges=False)
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
        if self.state in TIMED:
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


frames = _ThreadFrames()
_clock = time.perf_counter  # seconds, monotonic; one name, so that tests can put a fake clock in its place
record_lock = threading.Lock()  # guards the records: calls may come from several threads


def _open(node: InspectModule, args: tuple, kwargs: dict, first_call_only: bool) -> _Timing:
    begin = _clock()
    timing = _Timing(node)
    try:
        with record_lock:
            leaves, timing.batch_size = node.inputs.add(args, kwargs, first_call_only=first_call_only)
    except Exception:  # noqa: BLE001 - describing a call never breaks it
        leaves, timing.batch_size = [], None
        _recording_failed(node, "inputs")
    cuda_device = node.sync_device
    if cuda_device is None:
        cuda_device = next((leaf.device for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.is_cuda), None)
    timing.cuda_device = cuda_device
    frames.stack.append(timing)
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
    stack = frames.stack
    if stack and stack[-1] is timing:
        stack.pop()
    elif timing in stack:  # a frame left open by a call that never returned to us
        del stack[stack.index(timing):]
    node = timing.node
    if not raised:
        try:
            with record_lock:
                node.outputs.add((output,), {}, timing.batch_size)
        except Exception:  # noqa: BLE001 - describing a call never breaks it
            _recording_failed(node, "outputs")
    with record_lock:
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
    if node.state in TIMED:
        frames.discovering.append((module, _open(node, args, {}, first_call_only=True)))


def end_discovering_call(module: torch.nn.Module, output: Any) -> None:
    """The discovery post-hook at depth 0: close the discovering call of ``module``, if one is open."""
    discovering = frames.discovering
    if discovering and discovering[-1][0] is module:
        _close(discovering.pop()[1], output)


# ============================================================================================ tracking
