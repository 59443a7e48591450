"""The export half of the Torch-TensorRT AOT path, in the parent process: ``torch.export`` of the graph's flat
module with explicit ``Dim``s, and the input specs the compile step gets."""

from __future__ import annotations

import logging
from typing import Any

import torch

from aitune.torch.backend.flat import FlatIO, eager_output
from aitune.torch.common.dtypes import dtype_name
from aitune.torch.record.samples import BATCH
from aitune.torch.backend.onnx_export import export_example

logger = logging.getLogger(__name__)


def export_dynamic_shapes(graph) -> tuple[dict | None, list[dict]]:
    """``torch.export`` dynamic shapes with explicit ``Dim(name, min, max)`` per dynamic axis, and input specs.

    Dynamic axes whose sizes were equal in every recorded sample share one Dim (``torch.export`` refuses
    independent Dims for sizes the model ties together, e.g. ``ids`` and ``mask`` sequence lengths); a
    group holding a batch axis is named ``batch``, others ``<input name>_dim<axis>``. Ranges are the
    recorded (or declared) min/max. The dynamic shapes are keyed for :class:`FlatModule` (``forward(*tensors)``).

    Returns:
        ``(dynamic_shapes or None when nothing is dynamic, [{"name", "min", "opt", "max", "dtype"} per input])``.
    """
    from torch.export import Dim

    groups: dict[tuple, dict] = {}
    per_input: list[dict[int, tuple]] = []
    inputs = []
    sample_leaves = [sample.leaves() for sample in graph.samples]
    for spec in graph.tensor_specs:
        low, opt, high = graph.shape_range(spec)
        axes = {}
        for axis in spec.dynamic_axes:
            history = tuple(int(leaves[spec.leaf_index].shape[axis]) for leaves in sample_leaves)
            group = groups.setdefault(history, {"name": f"{spec.name}_dim{axis}", "min": low[axis], "max": high[axis]})
            if spec.axes[axis] == BATCH and spec.multipliers[axis] == 1.0:
                group["name"] = "batch"
            group["min"], group["max"] = min(group["min"], low[axis]), max(group["max"], high[axis])
            axes[axis] = history
        per_input.append(axes)
        inputs.append({"name": spec.name, "min": list(low), "opt": list(opt), "max": list(high),
                       "dtype": dtype_name(spec.dtype)})
    if not any(per_input):
        return None, inputs
    dims = {history: Dim(group["name"], min=group["min"], max=group["max"]) for history, group in groups.items()}
    dynamic = tuple({axis: dims[history] for axis, history in axes.items()} or None for axes in per_input)
    return {"tensors": dynamic}, inputs


def export_flat_module(module, graph, device: torch.device) -> tuple[Any, FlatIO, list[torch.Tensor], list[dict]]:
    """``torch.export.export(strict=False)`` of the graph's :class:`FlatModule` with explicit Dims.

    Returns:
        ``(ExportedProgram, FlatIO, example inputs, input specs)``. Runs anywhere torch.export runs (no TensorRT).
    """
    flat_io = FlatIO(graph, eager_output(module, graph))
    example, notes = export_example(graph, flat_io, device)
    for note in notes:
        logger.info("torch_tensorrt export: %s", note)
    dynamic_shapes, inputs = export_dynamic_shapes(graph)
    flat_module = flat_io.flat_module(module)
    training = {name: sub.training for name, sub in module.named_modules()}
    flat_module.eval()
    try:
        exported = torch.export.export(flat_module, tuple(example), dynamic_shapes=dynamic_shapes, strict=False)
    finally:
        for name, sub in module.named_modules():
            sub.training = training.get(name, sub.training)
    return exported, flat_io, example, inputs
