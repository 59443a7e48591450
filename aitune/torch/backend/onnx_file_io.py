"""The ONNX file an ONNX-based backend builds from: exported from the module, or an
:class:`~aitune.torch.OnnxModule`'s own file taken as it is.

:func:`onnx_for_backend` is the one place the ONNX Runtime and TensorRT backends get their ``.onnx`` file from.
For an ``OnnxModule`` nothing is exported and nothing is written: the result describes the user's file, its
inputs matched to the graph's recorded tensor inputs through the module's own binding of a call (positional in
the file's order, keywords by ONNX name), its outputs named and typed as the file declares them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from aitune.errors import ConfigError
from aitune.torch.backend.flat import FlatIO
from aitune.torch.backend.onnx_export import OnnxExport, export_onnx
from aitune.torch.record.onnx_module import OnnxModule
from aitune.torch.record.pytree import tree_unflatten

FILE_EXPORTER = "file"  # OnnxExport.exporter of a file taken as it is


def onnx_for_backend(module: torch.nn.Module, graph, path: Path | str, *, use_dynamo: bool,
                     opset_version: int | None, device: torch.device | str) -> OnnxExport:
    """The ONNX file for ``module``'s ``graph``: an :class:`OnnxModule`'s file as it is (:func:`file_as_export`),
    else :func:`~aitune.torch.backend.onnx_export.export_onnx` to ``path`` (with ``use_dynamo``,
    ``opset_version``, ``device``)."""
    if isinstance(module, OnnxModule):
        return file_as_export(module, graph)
    return export_onnx(module, graph, path, use_dynamo=use_dynamo, opset_version=opset_version, device=device)


def file_as_export(module: OnnxModule, graph) -> OnnxExport:
    """An :class:`OnnxExport` that describes ``module``'s own file (``path`` is the user's file; read only).

    Args:
        module: the :class:`OnnxModule`. graph: its :class:`~aitune.torch.record.samples.GraphSpec`, with samples.

    Raises:
        ConfigError: the graph has no samples, or a recorded ONNX input is not one of the graph's tensor inputs.
    """
    if not graph.samples:
        raise ConfigError(f"{graph.name} has no recorded samples; record at least one call before building")
    tensor_indices = [spec.leaf_index for spec in graph.tensor_specs]
    markers = tree_unflatten(graph.input_spec, [_Leaf(index) for index in range(len(graph.samples[0].leaves()))])
    bound = module.bind(*markers)  # each ONNX input -> the leaf of the canonical call it takes
    input_indices = []
    for name, marker in zip(module.input_names, bound):
        if not isinstance(marker, _Leaf) or marker.index not in tensor_indices:
            raise ConfigError(f"ONNX input {name!r} of {module.path} is not a tensor input of the recorded calls")
        input_indices.append(tensor_indices.index(marker.index))
    template = [torch.empty(0, dtype=value.dtype) for value in module.outputs]
    flat_io = FlatIO(graph, template[0] if len(template) == 1 else tuple(template))
    path = Path(module.path)
    return OnnxExport(path=path, input_names=list(module.input_names), output_names=list(module.output_names),
                      exporter=FILE_EXPORTER, dynamic_axes={}, notes=[f"the ONNX file {path} as it is (not exported)"],
                      flat_io=flat_io, input_indices=input_indices,
                      example_shapes=[list(tensor.shape) for tensor in flat_io.sample_inputs(graph.samples[0])],
                      external_data_files=list(module.external_data))


class _Leaf:
    """Stands in for the call's leaf ``index`` when the module binds a call (any object is a pytree leaf)."""

    def __init__(self, index: int):
        self.index = index
