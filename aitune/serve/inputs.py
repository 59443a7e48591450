"""Requests checked against the tuned module's inputs, as the checkpoint's manifest records them.

Each tuned graph of the served module accepts one set of named tensor inputs (the input paths of its
``forward``: ``input_ids``, ``attention_mask``, ...) with a dtype, a rank, static sizes and, per dynamic axis,
the range it was tuned for (recorded, or declared with ``DynamicDim``/``BatchDim``). A request names its
tensors by those paths; it runs on the graph whose tensor inputs are exactly the ones it gives, with that
graph's recorded constants. Anything else is answered 400/422 with the field at fault, before it reaches a
batch — a bad request never fails the requests batched with it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch

from aitune.errors import ConfigError, RequestError
from aitune.serve.tensors import tensor_from_json
from aitune.torch.checkpoint import tree_spec_from_json
from aitune.torch.common.dtypes import dtype_from_name, dtype_name
from aitune.torch.record.pytree import TreeSpec, tree_unflatten
from aitune.torch.record.serialization import constant_from_json

BATCH, STATIC = "batch", "static"


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """One tensor input of a tuned graph.

    Attributes:
        path: the input's path in the call (``input_ids``, ``inputs.tokens``). leaf_index: its place among the
            graph's flattened inputs. dtype: the tuned dtype. low / high: smallest / largest size per axis
            (equal on static axes). axes: ``"static"``, ``"dynamic"`` or ``"batch"`` per axis. batch_axis: the
            axis that holds the rows (size = batch size), or None.
    """

    path: str
    leaf_index: int
    dtype: torch.dtype
    low: tuple[int, ...]
    high: tuple[int, ...]
    axes: tuple[str, ...]
    batch_axis: int | None

    @classmethod
    def from_manifest(cls, entry: dict) -> "InputSpec":
        """From one ``tensor_specs`` entry of a manifest graph (declared dims win over recorded sizes)."""
        low, high = [int(v) for v in entry["min_shape"]], [int(v) for v in entry["max_shape"]]
        for axis, dim in enumerate(entry.get("dims") or []):
            if dim is not None:
                low[axis], high[axis] = int(dim["min"]), int(dim["max"])
        axes = tuple(entry["axes"])
        multipliers = entry.get("multipliers") or [None] * len(axes)
        batch_axes = [axis for axis, kind in enumerate(axes) if kind == BATCH and multipliers[axis] in (1, 1.0)]
        return cls(path=entry["path"], leaf_index=int(entry["leaf_index"]),
                   dtype=dtype_from_name(entry["dtype"]), low=tuple(low), high=tuple(high), axes=axes,
                   batch_axis=batch_axes[0] if len(batch_axes) == 1 else None)

    def describe(self) -> dict:
        """JSON: dtype, and per axis its kind and tuned range."""
        return {"dtype": dtype_name(self.dtype),
                "shape": [{"axis": kind, "min": low, "max": high} if low != high else high
                          for kind, low, high in zip(self.axes, self.low, self.high)]}


@dataclasses.dataclass
class GraphInputs:
    """The inputs of one tuned graph: its tensors by path, its constants and its batch range.

    Attributes:
        name: ``graph0``. input_spec: structure of the canonical ``(args, kwargs)``. tensors: by path.
        constants: non-tensor leaves by leaf index (passed as recorded). batch_range: (min, max) rows per call
            when every tensor has a batch axis, else None (each request is a call of its own).
        backend: the backend it was tuned to. tuned_latency_ms: p50 of the smallest tuned batch, if measured.
    """

    name: str
    input_spec: TreeSpec
    tensors: dict[str, InputSpec]
    constants: dict[int, Any]
    batch_range: tuple[int, int] | None
    backend: str
    tuned_latency_ms: float | None

    @classmethod
    def from_manifest(cls, graph: dict) -> "GraphInputs":
        tensors = {entry["path"]: InputSpec.from_manifest(entry) for entry in graph["tensor_specs"]}
        constants = {int(c["leaf_index"]): constant_from_json(c["value"]) for c in graph.get("constants") or []}
        batch_range = None
        if tensors and all(spec.batch_axis is not None for spec in tensors.values()):
            lows = [spec.low[spec.batch_axis] for spec in tensors.values()]
            highs = [spec.high[spec.batch_axis] for spec in tensors.values()]
            batch_range = (max(lows), min(highs))
        return cls(name=graph["name"], input_spec=tree_spec_from_json(graph["input_structure"]), tensors=tensors,
                   constants=constants, batch_range=batch_range, backend=str(graph.get("backend")),
                   tuned_latency_ms=_smallest_batch_latency(graph.get("tune_row")))

    @property
    def max_rows(self) -> int:
        return self.batch_range[1] if self.batch_range else 1

    def call_arguments(self, tensors: Mapping[str, torch.Tensor]) -> tuple[tuple, dict]:
        """The canonical ``(args, kwargs)`` of a call with these tensors (by path) and the recorded constants."""
        leaves: list[Any] = [None] * self.input_spec.num_leaves
        for index, value in self.constants.items():
            leaves[index] = value
        for path, spec in self.tensors.items():
            leaves[spec.leaf_index] = tensors[path]
        args, kwargs = tree_unflatten(self.input_spec, leaves)
        return tuple(args), dict(kwargs)

    def describe(self) -> dict:
        return {"inputs": {path: spec.describe() for path, spec in self.tensors.items()},
                "rows_per_call": list(self.batch_range) if self.batch_range else None, "backend": self.backend}


@dataclasses.dataclass
class PreparedRequest:
    """A checked request: its graph, its tensors (cast, padded up to the tuned minimum where allowed) and rows.

    ``in_range``: every size lies in the tuned range (False only with ``out_of_range="eager"``); such calls are
    expected to run on the tuned backend, and count toward the health check.
    """

    graph: GraphInputs
    tensors: dict[str, torch.Tensor]
    rows: int
    in_range: bool = True


class TunedInputs:
    """What requests to the served module may carry, from its manifest entry.

    Args:
        module_entry: the served module's entry in ``manifest.json`` (:func:`~aitune.serve.fit.served_module_entry`).
        pad_values: ``{input path: pad value}`` (see ``ServeConfig.pad_values``).
        out_of_range: ``"reject"`` or ``"eager"`` (see ``ServeConfig.out_of_range``).

    Raises:
        ConfigError / CheckpointError: a pad value for an input no graph has; a malformed manifest entry.
    """

    def __init__(self, module_entry: dict, pad_values: Mapping[str, float] | None = None,
                 out_of_range: str = "reject"):
        self.module_name = module_entry.get("name", "?")
        self.graphs = [GraphInputs.from_manifest(graph) for graph in module_entry.get("graphs") or []]
        self.pad_values = dict(pad_values or {})
        self.out_of_range = out_of_range
        known = {path for graph in self.graphs for path in graph.tensors}
        unknown = sorted(set(self.pad_values) - known)
        if unknown:
            raise ConfigError(f"pad_values names {', '.join(unknown)}, which no tuned graph of {self.module_name!r} "
                              f"takes; its tensor inputs are {', '.join(sorted(known))}")

    @property
    def max_rows(self) -> int:
        """The most rows one call may carry: the largest tuned batch over the graphs (1 without a batch axis)."""
        return max((graph.max_rows for graph in self.graphs), default=1)

    @property
    def tuned_latency_ms(self) -> float | None:
        """p50 latency (ms) of the smallest tuned batch, measured while tuning (None if not measured)."""
        values = [graph.tuned_latency_ms for graph in self.graphs if graph.tuned_latency_ms is not None]
        return min(values) if values else None

    def describe(self) -> dict:
        return {"module": self.module_name, "graphs": {graph.name: graph.describe() for graph in self.graphs},
                "pad_values": self.pad_values, "out_of_range": self.out_of_range}

    def prepare(self, inputs: Any, field: str = "inputs") -> PreparedRequest:
        """Check and decode a request's inputs.

        Args:
            inputs: ``{input path: tensor in the JSON form, or torch.Tensor}``.
            field: the name of ``inputs`` in the request, for messages.

        Returns:
            A :class:`PreparedRequest`.

        Raises:
            RequestError: 400 when ``inputs`` is not an object; 422 naming the field for an unknown or missing
                input, a dtype, rank or static size that differs from the tuned one, a size outside the tuned
                range (with ``out_of_range="reject"``), inputs that disagree on the batch size, or zero rows.
        """
        if not isinstance(inputs, Mapping) or not inputs:
            raise RequestError(f"{field}: must be a non-empty object {{input name: tensor}}; the tuned inputs are "
                               f"{self._input_sets()}", status=400, field=field)
        given = set(inputs)
        graph = next((g for g in self.graphs if set(g.tensors) == given), None)
        if graph is None:
            closest = min(self.graphs, key=lambda g: len(set(g.tensors) ^ given))
            missing, unexpected = sorted(set(closest.tensors) - given), sorted(given - set(closest.tensors))
            parts = ([f"missing {', '.join(missing)}"] if missing else []) + (
                [f"unexpected {', '.join(unexpected)}"] if unexpected else [])
            bad = f"{field}.{(unexpected or missing)[0]}"
            raise RequestError(f"{field}: {'; '.join(parts)} — the tuned inputs are {self._input_sets()}", field=bad)
        tensors = {path: tensor_from_json(inputs[path], spec.dtype, f"{field}.{path}")
                   for path, spec in graph.tensors.items()}
        self._check_padded_sizes(graph, tensors, field)
        in_range = True
        rows: dict[str, int] = {}
        for path, spec in graph.tensors.items():
            where = f"{field}.{path}"
            tensor = tensors[path]
            if tensor.dim() != len(spec.axes):
                raise RequestError(f"{where}: rank {tensor.dim()} (shape {list(tensor.shape)}), the tuned input has rank "
                                   f"{len(spec.axes)} ({self._shape_text(spec)})", field=where)
            if tensor.numel() == 0:
                raise RequestError(f"{where}: shape {list(tensor.shape)} holds no values", field=where)
            tensor = self._pad_to_minimum(path, spec, tensor)
            for axis, size in enumerate(tensor.shape):
                if spec.axes[axis] == STATIC and size != spec.high[axis]:
                    raise RequestError(f"{where}: axis {axis} has size {size}; it must be {spec.high[axis]} "
                                       f"({self._shape_text(spec)})", field=where)
                if not spec.low[axis] <= size <= spec.high[axis]:
                    if self.out_of_range == "reject":
                        raise RequestError(f"{where}: axis {axis} has size {size}, outside the tuned range "
                                           f"{spec.low[axis]}..{spec.high[axis]} ({self._shape_text(spec)})", field=where)
                    in_range = False
            if spec.batch_axis is not None:
                rows[path] = int(tensor.shape[spec.batch_axis])
            tensors[path] = tensor
        if len(set(rows.values())) > 1:
            raise RequestError(f"{field}: the inputs disagree on the batch size ({', '.join(f'{p}: {n}' for p, n in rows.items())})",
                               field=f"{field}.{next(iter(rows))}")
        count = next(iter(rows.values())) if graph.batch_range else 1
        return PreparedRequest(graph, tensors, count, in_range)

    def _pad_to_minimum(self, path: str, spec: InputSpec, tensor: torch.Tensor) -> torch.Tensor:
        if path not in self.pad_values:
            return tensor
        for axis, size in enumerate(tensor.shape):
            if spec.axes[axis] == "dynamic" and size < spec.low[axis]:
                tensor = pad_axis(tensor, axis, spec.low[axis], self.pad_values[path])
        return tensor

    def _check_padded_sizes(self, graph: GraphInputs, tensors: dict[str, torch.Tensor], field: str) -> None:
        """Inputs padded together must agree on each padded axis (as token ids and their mask do)."""
        sizes: dict[int, tuple[str, int]] = {}
        for path in self.pad_values:
            if path not in tensors:
                continue
            spec = graph.tensors[path]
            for axis, kind in enumerate(spec.axes):
                if kind != "dynamic" or axis >= tensors[path].dim():
                    continue
                size = int(tensors[path].shape[axis])
                first = sizes.setdefault(axis, (path, size))
                if first[1] != size:
                    raise RequestError(f"{field}.{path}: axis {axis} has size {size} but {first[0]} has {first[1]}; "
                                       "inputs that are padded together must have equal sizes",
                                       field=f"{field}.{path}")

    def _input_sets(self) -> str:
        return " or ".join("{" + ", ".join(graph.tensors) + "}" for graph in self.graphs)

    @staticmethod
    def _shape_text(spec: InputSpec) -> str:
        dims = [str(high) if low == high else f"{low}..{high}" for low, high in zip(spec.low, spec.high)]
        return f"tuned shape [{', '.join(dims)}], dtype {dtype_name(spec.dtype)}"


def pad_axis(tensor: torch.Tensor, axis: int, size: int, value: float) -> torch.Tensor:
    """``tensor`` grown to ``size`` along ``axis`` with ``value`` at the end (returned as is when long enough)."""
    missing = size - tensor.shape[axis]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[axis] = missing
    return torch.cat([tensor, torch.full(shape, value, dtype=tensor.dtype)], dim=axis)


def _smallest_batch_latency(row: dict | None) -> float | None:
    """p50 (ms) of the smallest batch the chosen backend was measured on while tuning."""
    samples = ((row or {}).get("measurement") or {}).get("samples") or []
    timed = [(s.get("batch_size") or math.inf, s.get("p50_ms")) for s in samples if s.get("p50_ms") is not None]
    return min(timed)[1] if timed else None
