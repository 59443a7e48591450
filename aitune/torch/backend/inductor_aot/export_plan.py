"""The ``torch.export`` plan of the AOTInductor backend: example inputs (batch >= 2), ``dynamic_shapes``, and
the input ranges export kept (NOTE [batch 1 and export] in :mod:`aitune.torch.backend.inductor_aot`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from aitune.torch.backend.accepted import batch_axes
from aitune.torch.backend.flat import FlatIO
from aitune.torch.record.samples import BATCH, STATIC


@dataclasses.dataclass
class ExportPlan:
    """Example inputs and ``dynamic_shapes`` for ``torch.export`` of the flat module."""

    example: list[torch.Tensor]
    dynamic_shapes: list[dict]
    repeated_batch: int | None  # a batch-1 sample repeated to this batch (pytorch/pytorch#133653), else None
    batch_range: tuple[int, int] | None


def _batch_range(graph, batch_axes) -> tuple[int, int] | None:
    if not batch_axes:
        return None
    low, high = 0, math.inf
    for index, axis, multiplier in batch_axes:
        spec_low, _, spec_high = graph.shape_range(graph.tensor_specs[index])
        low = max(low, math.ceil(spec_low[axis] / multiplier))
        high = min(high, spec_high[axis] // multiplier)
    return int(low), int(high)


def export_plan(graph, flat_io: FlatIO, use_auto: bool) -> ExportPlan:
    """Choose the export example (batch >= 2, NOTE [batch 1 and export]) and build ``dynamic_shapes``."""
    from torch.export import Dim

    graph_batch_axes = batch_axes(graph)
    batch_range = _batch_range(graph, graph_batch_axes)
    batch_dim = None
    if batch_range is not None and not use_auto:
        # NOTE [export max 2]: with torch 2.13, a program exported with Dim(min=1, max=2), saved and loaded
        # (the child compiles the saved program) compiled into a package that indexes out of bounds or returns
        # batch 2 at batch 1 (an Embedding model at the reference's default batch_sizes [1, 2]). max=3 does
        # not; the artifact still accepts only the recorded range
        # (_accepted_ranges), so the wider export bound changes no routing.
        export_max = 3 if batch_range[1] == 2 and batch_range[0] < 2 else batch_range[1]
        batch_dim = Dim("batch", min=batch_range[0], max=export_max)

    def sizes_ok(sample) -> bool:  # every dynamic axis >= 2, so export does not specialise it
        inputs = flat_io.sample_inputs(sample)
        return all(inputs[index].shape[axis] >= 2 for index, spec in enumerate(graph.tensor_specs)
                   for axis in spec.dynamic_axes)

    candidates = [s for s in graph.samples if sizes_ok(s)]
    sample = min(candidates, key=lambda s: s.batch_size or 0) if candidates else graph.samples[0]
    example = [tensor.detach().clone() for tensor in flat_io.sample_inputs(sample.clone())]
    repeated_batch = None
    if not candidates and graph_batch_axes and batch_range[1] >= 2:
        index, axis, multiplier = graph_batch_axes[0]
        batch = example[index].shape[axis] // multiplier
        if batch == 1:  # NOTE [batch 1 and export]: repeat the sample along its batch axes to batch 2
            repeated_batch = 2
            for index, axis, multiplier in graph_batch_axes:
                example[index] = torch.cat([example[index]] * 2, dim=axis)

    named_dims: dict[str, Any] = {}
    dynamic_shapes: list[dict] = []
    for index, spec in enumerate(graph.tensor_specs):
        low, _, high = graph.shape_range(spec)
        axes: dict[int, Any] = {}
        for axis, kind in enumerate(spec.axes):
            if kind == STATIC:
                continue
            declared = spec.dims[axis]
            if kind == BATCH and batch_dim is not None:
                multiplier = 1 if math.isnan(spec.multipliers[axis]) else int(spec.multipliers[axis])
                axes[axis] = batch_dim if multiplier == 1 else multiplier * batch_dim
            elif declared is not None and not use_auto:
                if declared.name not in named_dims:
                    named_dims[declared.name] = Dim(_identifier(declared.name), min=declared.min, max=declared.max)
                axes[axis] = named_dims[declared.name]
            else:
                axes[axis] = Dim.AUTO(min=low[axis], max=high[axis])
        dynamic_shapes.append(axes)
    return ExportPlan(example, dynamic_shapes, repeated_batch, batch_range)


def _identifier(name: str) -> str:
    text = "".join(ch if ch.isalnum() else "_" for ch in name)
    return text if text and not text[0].isdigit() else f"d_{text}"


def export_with_plan(flat_module: torch.nn.Module, plan: ExportPlan):
    return torch.export.export(flat_module, tuple(plan.example), dynamic_shapes=(tuple(plan.dynamic_shapes),))


def accepted_ranges(exported, graph) -> tuple[list[dict], list[str]]:
    """Per tensor input: sizes :meth:`accepts` takes (graph range intersected with what export kept).

    Returns ``(ranges, notes)``; ``ranges[i] = {"low": [...], "high": [...]}``, notes name every axis export
    specialised or narrowed.
    """
    user_inputs = list(exported.graph_signature.user_inputs)
    placeholders = {node.name: node for node in exported.graph.nodes if node.op == "placeholder"}
    ranges, notes = [], []
    for index, spec in enumerate(graph.tensor_specs):
        low, _, high = graph.shape_range(spec)
        low, high = list(low), list(high)
        node = placeholders.get(user_inputs[index]) if index < len(user_inputs) else None
        value = node.meta.get("val") if node is not None else None
        if value is not None:
            for axis in spec.dynamic_axes:
                size = value.shape[axis]
                if not isinstance(size, torch.SymInt):
                    low[axis] = high[axis] = int(size)
                    notes.append(f"{spec.path} axis {axis} specialised to {int(size)} by torch.export")
                    continue
                bounds = exported.range_constraints.get(size.node.expr)
                if bounds is None:
                    continue
                new_low = max(low[axis], _bound(bounds.lower, low[axis]))
                new_high = min(high[axis], _bound(bounds.upper, high[axis]))
                if (new_low, new_high) != (low[axis], high[axis]):
                    notes.append(f"{spec.path} axis {axis} limited to [{new_low}, {new_high}] by torch.export "
                                 f"(recorded [{low[axis]}, {high[axis]}])")
                low[axis], high[axis] = new_low, new_high
        ranges.append({"low": low, "high": high})
    return ranges, notes


def _bound(value, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):  # sympy oo / int_oo
        return default


def is_constraint_violation(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}"
    return "Constraints violated" in text or "ConstraintViolation" in text or "constraint violation" in text.lower()
