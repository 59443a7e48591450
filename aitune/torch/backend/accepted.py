"""What a built artifact accepts: the one "is this call inside the range it was built for" check.

Every AOT backend (Inductor AOT, ONNX Runtime, TensorRT, Torch-TensorRT) runs a fixed artifact that takes
tensors of certain dtypes, on one device type, with each axis inside a range (and, for batch axes, sizes
that agree). A call outside that is not given to the artifact: ``ait.Module`` runs it eagerly and says
which input fell outside which range (:meth:`AcceptedInputs.rejects` returns that reason).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch

from aitune.torch.check.native_watch import all_finite_check
from aitune.torch.common.dtypes import dtype_name
from aitune.torch.record.llm import POSITION_INPUTS, find_cache, in_cache
from aitune.torch.record.samples import BATCH, graph_device


@dataclasses.dataclass
class AcceptedInput:
    """One tensor input of an artifact.

    Attributes:
        leaf_index: its position among the call's flattened canonical input leaves.
        dtype: dtype name (``"float32"``). low / high: inclusive size bounds per axis (rank = ``len(low)``).
        path: readable input path for messages (``"attention_mask"``), optional.
    """

    leaf_index: int
    dtype: str
    low: list[int]
    high: list[int]
    path: str = ""

    def to_json(self) -> dict:
        data = {"leaf_index": self.leaf_index, "dtype": self.dtype, "low": list(self.low), "high": list(self.high)}
        if self.path:
            data["path"] = self.path
        return data

    @classmethod
    def from_json(cls, data: dict) -> "AcceptedInput":
        low = data["low"] if "low" in data else data["min"]
        high = data["high"] if "high" in data else data["max"]
        return cls(int(data["leaf_index"]), str(data["dtype"]), [int(v) for v in low], [int(v) for v in high],
                   str(data.get("path", "")))


@dataclasses.dataclass
class AcceptedInputs:
    """The calls an artifact takes.

    Attributes:
        inputs: one :class:`AcceptedInput` per tensor input.
        device_type: ``"cpu"``/``"cuda"`` the artifact runs on (None: any).
        batch_axes: ``(input position in inputs, axis, multiplier)``: ``size / multiplier`` must be a whole
            number, equal across all of them (one batch size per call).
        shapes: for shape-specialized artifacts, the exact input shapes that run (None: any in range).
    """

    inputs: list[AcceptedInput]
    device_type: str | None = None
    batch_axes: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    shapes: set[tuple] | None = None

    @classmethod
    def from_graph(cls, graph, device: torch.device | str | None, ranges: list[tuple[list[int], list[int]]] | None
                   = None, batch_axes: list[tuple[int, int, int]] | None = None) -> "AcceptedInputs":
        """From a graph's tensor specs (recorded/declared ranges, or ``ranges`` per tensor spec when given)."""
        inputs = []
        for position, spec in enumerate(graph.tensor_specs):
            if ranges is not None:
                low, high = ranges[position]
            else:
                low, _, high = graph.shape_range(spec)
            inputs.append(AcceptedInput(spec.leaf_index, dtype_name(spec.dtype), list(low), list(high), spec.path))
        device_type = torch.device(device).type if device is not None else None
        return cls(inputs, device_type, list(batch_axes or []))

    def rejects(self, leaves: list[Any]) -> str | None:
        """Why the artifact cannot take a call with these flattened input leaves, or None when it can.

        The reason names the input and the range, e.g. ``input 'x' has shape [2, 9], outside [2..8, 9]``.
        """
        tensors = []
        for entry in self.inputs:
            if entry.leaf_index >= len(leaves) or not isinstance(leaves[entry.leaf_index], torch.Tensor):
                return f"input {_name(entry)} is not a tensor"
            tensors.append(leaves[entry.leaf_index])
        return self.rejects_tensors(tensors)

    def rejects_tensors(self, tensors: list[torch.Tensor]) -> str | None:
        """As :meth:`rejects`, for the artifact's tensor inputs already picked out, in ``inputs`` order."""
        for entry, tensor in zip(self.inputs, tensors):
            if dtype_name(tensor.dtype) != entry.dtype:
                return f"input {_name(entry)} has dtype {dtype_name(tensor.dtype)}, the artifact takes {entry.dtype}"
            if self.device_type is not None and tensor.device.type != self.device_type:
                return f"input {_name(entry)} is on {tensor.device.type}, the artifact runs on {self.device_type}"
            if tensor.dim() != len(entry.low):
                return f"input {_name(entry)} has rank {tensor.dim()}, the artifact takes rank {len(entry.low)}"
        if self.shapes is not None:
            shapes = tuple(tuple(t.shape) for t in tensors)
            if shapes not in self.shapes:
                return (f"the artifact is shape-specialized to {sorted(self.shapes)}; the call has "
                        f"{[list(s) for s in shapes]}")
            return None
        for entry, tensor in zip(self.inputs, tensors):
            if any(not low <= size <= high for low, size, high in zip(entry.low, tensor.shape, entry.high)):
                return (f"input {_name(entry)} has shape {list(tensor.shape)}, outside "
                        f"{_range_text(entry.low, entry.high)}")
        batches = set()
        for position, axis, multiplier in self.batch_axes:
            size = tensors[position].shape[axis]
            if size % multiplier:
                return (f"batch axis {axis} of input {_name(self.inputs[position])} has size {size}, not a multiple "
                        f"of {multiplier}")
            batches.add(size // multiplier)
        if len(batches) > 1:
            return f"the batch axes disagree ({sorted(batches)}): one batch size per call"
        return None

    def to_json(self) -> dict:
        return {"inputs": [entry.to_json() for entry in self.inputs], "device_type": self.device_type,
                "batch_axes": [list(axis) for axis in self.batch_axes],
                "shapes": sorted([list(map(list, shapes)) for shapes in self.shapes]) if self.shapes is not None
                else None}

    @classmethod
    def from_json(cls, data: dict) -> "AcceptedInputs":
        shapes = data.get("shapes")
        return cls([AcceptedInput.from_json(entry) for entry in data["inputs"]], data.get("device_type"),
                   [tuple(int(v) for v in axis) for axis in data.get("batch_axes", [])],
                   None if shapes is None else {tuple(tuple(s) for s in entry) for entry in shapes})


def batch_axes(graph) -> list[tuple[int, int, int]]:
    """``(tensor spec position, axis, multiplier)`` of every batch axis of a graph (multiplier: the axis' size
    per batch item, 1 for a plain batch axis)."""
    axes = []
    for position, spec in enumerate(graph.tensor_specs):
        for axis, kind in enumerate(spec.axes):
            if kind == BATCH:
                multiplier = spec.multipliers[axis]
                axes.append((position, axis, 1 if math.isnan(multiplier) else int(multiplier)))
    return axes


def _name(entry: AcceptedInput) -> str:
    return f"'{entry.path}'" if entry.path else f"#{entry.leaf_index}"


def _range_text(low: list[int], high: list[int]) -> str:
    return "[" + ", ".join(str(lo) if lo == hi else f"{lo}..{hi}" for lo, hi in zip(low, high)) + "]"


# NOTE [value gate]: a built artifact was checked on the recorded calls' values only. Three kinds of value it
# never saw go to eager instead, which gives eager's answer or raises eager's error:
# - integer inputs outside the recorded range (widened to a whole embedding table for an input the recorded
#   calls passed straight to one: ValueGate.for_graph): an out-of-range index makes Inductor's bounds check abort the
#   whole process (pytorch/pytorch#126691) and ONNX Runtime's Gather wrap a negative index around
#   (microsoft/onnxruntime#1533) where eager raises IndexError;
# - nan/inf in a floating input whose recorded calls were all finite: compiled and exported kernels may
#   handle them differently (max/min/relu fusions, clamps);
# - for a quantizing candidate, a floating input whose largest magnitude exceeds QUANTIZED_RANGE_FACTOR times
#   the recorded one: dynamic int8 activation scales fitted to an outlier lose the other values' precision
#   (pytorch/ao PR#3089).
# Each check reads the whole tensor once and waits for the result, so only CPU tensors are checked: on CUDA the
# wait would synchronize the device on every call (tens of µs of host time, and the launch queue drained),
# and an out-of-range index there is a device-side assert in eager too. The cost per call is measured by
# benchmarks/value_gate_cost.py and stated in docs/promises.md.
QUANTIZED_RANGE_FACTOR = 2.0
_SUM_AS_IS = (torch.float32, torch.float64)  # dtypes summed in their own precision by the finite check


@dataclasses.dataclass
class ValueGate:
    """Which values of a call a tuned backend takes (NOTE [value gate]).

    Attributes:
        integers: ``(leaf index, path, lowest, highest)`` per integer input: values outside run eager.
        finite: ``(leaf index, path)`` per floating input recorded finite: nan/inf run eager.
        magnitudes: ``(leaf index, path, limit)`` per floating input of a quantizing backend: a largest
            ``|x|`` above ``limit`` runs eager.
    """

    integers: list[tuple[int, str, int, int]] = dataclasses.field(default_factory=list)
    finite: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    magnitudes: list[tuple[int, str, float]] = dataclasses.field(default_factory=list)
    # (leaf index, path, recorded bound) per position into a key/value cache: [0, the call's cache capacity)
    positions: list[tuple[int, str, int]] = dataclasses.field(default_factory=list)
    leaf_indices: list[int] = dataclasses.field(init=False)  # the leaves any check reads
    finite_only: bool = dataclasses.field(init=False)  # only the finite check (a float model's gate): a fast path
    # the native all_finite (NOTE [native watch]), set by for_graph for a graph recorded on the CPU; None: torch's
    native_finite: Callable | None = dataclasses.field(init=False, default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.leaf_indices = sorted({entry[0] for entry in (*self.integers, *self.finite, *self.magnitudes,
                                                           *self.positions)})
        self.finite_only = not (self.integers or self.magnitudes or self.positions)

    @classmethod
    def for_graph(cls, graph, quantizing: bool) -> "ValueGate | None":
        """The gate of a graph's recorded value ranges (``TensorSpec.value_range``/``finite``); None when there is
        nothing to check. An integer input that the recorded calls passed straight to an embedding table
        (``TensorSpec.table_rows``) accepts every row of it, ``[0, rows)``, not only the ids the samples held.

        Args:
            graph: a :class:`~aitune.torch.record.samples.GraphSpec`.
            quantizing: the backend quantizes activations or weights (``Backend.is_quantizing``).
        """
        integers, finite, magnitudes, positions = [], [], [], []
        for spec in graph.tensor_specs:
            value_range = getattr(spec, "value_range", None)
            if spec.dtype == torch.bool or spec.dtype.is_complex:
                continue
            if in_cache(spec.path, getattr(graph, "cache_input", None)):
                continue  # a key/value cache's own tensors and counters: the dispatch checks the fill (llm.py)
            if not spec.dtype.is_floating_point:
                rows = getattr(spec, "table_rows", None)
                if getattr(graph, "phase", None) is not None and spec.path in POSITION_INPUTS and rows is not None:
                    positions.append((spec.leaf_index, spec.path, int(rows)))
                    continue
                if getattr(graph, "phase", None) is not None and spec.path in POSITION_INPUTS and _rolls(graph):
                    continue  # every position is one the model takes, as in eager: not only the recorded range
                if value_range is not None:
                    low, high = int(value_range[0]), int(value_range[1])
                    if rows is not None and 0 <= low and high < rows:
                        low, high = 0, rows - 1
                    integers.append((spec.leaf_index, spec.path, low, high))
                continue
            if quantizing and value_range is not None:
                limit = QUANTIZED_RANGE_FACTOR * max(abs(value_range[0]), abs(value_range[1]))
                magnitudes.append((spec.leaf_index, spec.path, limit))
            elif getattr(spec, "finite", True):
                finite.append((spec.leaf_index, spec.path))
        gate = cls(integers=integers, finite=finite, magnitudes=magnitudes, positions=positions)
        # the gate reads CPU inputs only; resolved here, at tuning or loading (it may build the extension once)
        if finite and graph_device(graph).type == "cpu":
            gate.native_finite = all_finite_check()
        return gate if gate.leaf_indices else None

    def rejects(self, leaves: list[Any], capacity: int | None = None) -> str | None:
        """Why a call with these flattened input leaves runs eager, or None when the backend takes its values.
        Tensors on other devices than the CPU are not read (NOTE [value gate]).

        Args:
            leaves: the call's flattened canonical input leaves (None where a leaf is not to be read).
            capacity: positions the call's key/value cache holds (``max_cache_len``), for a phase graph's
                position inputs; None: the smallest capacity recorded.
        """
        if not self.finite_only:  # (a float model's gate skips this part: ~1 µs per call on this project's CPU)
            for index in self.leaf_indices:  # (Tensor.is_cpu: no torch.device built per access)
                leaf = leaves[index]
                if leaf is not None and not leaf.is_cpu:  # only the indices read below, not every leaf of a cache
                    leaves = {index: leaf if isinstance(leaf := leaves[index], torch.Tensor) and leaf.is_cpu
                              else None for index in self.leaf_indices}
                    if all(leaf is None for leaf in leaves.values()):  # a call on the device: nothing here is read
                        return None
                    break
            reason = self._integer_rejection(leaves, capacity)
            if reason is not None:
                return reason
        for index, path in self.finite:  # (is_cpu: a finite-only gate has not dropped the device's tensors above)
            tensor = leaves[index]
            if tensor is not None and tensor.is_cpu and _non_finite(tensor, self.native_finite):
                return f"input '{path}' holds nan/inf, which no recorded call had"
        for index, path, limit in self.magnitudes:
            tensor = leaves[index]
            if tensor is None:
                continue
            largest = float(tensor.detach().abs().amax()) if tensor.numel() else 0.0
            if not largest <= limit:  # nan fails too
                return (f"input '{path}' reaches |x| = {largest:.4g}, beyond {QUANTIZED_RANGE_FACTOR:g}x the "
                        f"recorded largest ({limit / QUANTIZED_RANGE_FACTOR:.4g}) the quantized candidate was "
                        "checked on")
        return None

    def _integer_rejection(self, leaves, capacity: int | None) -> str | None:
        for index, path, recorded in self.positions:
            if leaves[index] is None or not leaves[index].numel():
                continue
            bound = recorded if capacity is None else capacity
            found_low, found_high = _int_bounds(leaves[index])
            if found_low < 0 or found_high >= bound:
                return (f"input '{path}' holds positions in [{found_low}, {found_high}], outside the "
                        f"key/value cache's [0, {bound})")
        for index, path, low, high in self.integers:
            if leaves[index] is None:
                continue
            found_low, found_high = _int_bounds(leaves[index])
            if found_low < low or found_high > high:
                return (f"input '{path}' holds values in [{found_low}, {found_high}], outside the "
                        f"accepted [{low}, {high}] (the recorded ids, or the embedding table they index)")
        return None


def _non_finite(tensor: torch.Tensor, native: Callable | None = None) -> bool:
    """Does a floating tensor hold nan or inf? ``native`` (the extension's ``all_finite``) answers for a contiguous
    CPU tensor in one C call; otherwise one reduction and one read: a finite sum means every element is finite (nan
    and inf propagate); a sum that overflowed is told apart by the full check."""
    if native is not None:
        finite = native(tensor)
        if finite is not None:
            return not finite
    total = tensor.sum() if tensor.dtype in _SUM_AS_IS else tensor.sum(dtype=torch.float32)
    return not math.isfinite(total.item()) and not bool(torch.isfinite(tensor).all())


def _rolls(graph) -> bool:
    """Is a phase graph's cache made of sliding-window layers only (it rolls and never fills: no capacity bounds
    its positions, :func:`~aitune.torch.record.llm.cache_capacity`)?"""
    sample = graph.samples[0] if graph.samples else None
    layers = getattr(find_cache(sample.kwargs, sample.args), "layers", None) if sample is not None else None
    return bool(layers) and all("Sliding" in type(layer).__name__ for layer in layers)


def _int_bounds(tensor: torch.Tensor) -> tuple[int, int]:
    """Smallest and largest value of a non-empty integer tensor: one read for a single element (a decode step's
    token or position: ~1 µs less than a reduction and two reads), else ``aminmax`` and two reads."""
    if tensor.numel() == 1:
        value = int(tensor.item())
        return value, value
    low, high = torch.aminmax(tensor)
    return int(low), int(high)
