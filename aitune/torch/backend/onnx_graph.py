"""What an exported ONNX file holds: its inputs and outputs matched to the module's, the axes that came out
fixed, the files of its external data.

:func:`specialized_axes` checks that the export kept every dynamic axis (pytorch/pytorch#99613): an axis
declared dynamic must be a symbolic dim in the graph inputs, or the graph silently runs only its export
shapes. ``onnx`` is imported by the caller or
inside functions only.
"""

from __future__ import annotations

from pathlib import Path

from aitune.torch.backend.flat import FlatIO
from aitune.torch.record.onnx_file import external_tensors


def match_io(model, flat_io: FlatIO, notes: list[str]) -> tuple[list[str], list[int], list[str]]:
    """Match the ONNX graph's inputs/outputs to the flat inputs/outputs (by name, else by position)."""
    initializers = {init.name for init in model.graph.initializer}
    graph_inputs = [value.name for value in model.graph.input if value.name not in initializers]
    graph_outputs = [value.name for value in model.graph.output]
    expected = flat_io.input_names
    if all(name in expected for name in graph_inputs):
        input_names = [name for name in expected if name in graph_inputs]
        input_indices = [expected.index(name) for name in input_names]
        dropped = [name for name in expected if name not in graph_inputs]
        if dropped:
            notes.append(f"inputs not used by the graph were dropped by the exporter: {', '.join(dropped)}")
    elif len(graph_inputs) == len(expected):
        notes.append(f"the exporter renamed the inputs {expected} to {graph_inputs}; matched by position")
        input_names, input_indices = graph_inputs, list(range(len(expected)))
    else:
        raise RuntimeError(f"cannot match the ONNX graph inputs {graph_inputs} to the module's tensor inputs "
                           f"{expected}")
    if len(graph_outputs) != len(flat_io.output_names):
        raise RuntimeError(f"the ONNX graph has {len(graph_outputs)} outputs ({graph_outputs}) but the module "
                           f"returns {len(flat_io.output_names)} tensors ({flat_io.output_names})")
    if graph_outputs != flat_io.output_names:
        notes.append(f"the exporter renamed the outputs {flat_io.output_names} to {graph_outputs}; matched by "
                     "position")
    return input_names, input_indices, graph_outputs


def specialized_axes(model, dynamic_axes: dict[str, dict[int, str]]) -> list[str]:
    """Axes declared dynamic that carry a fixed size (or no dim at all) in the ONNX graph inputs.

    Args:
        model: an ``onnx.ModelProto`` (loaded without external data is enough).
        dynamic_axes: ``{input name: {axis: dim name}}`` as declared.

    Returns:
        ``"<input name>[<axis>]=<size>"`` entries; empty when every declared axis is symbolic.
    """
    by_name = {value.name: value for value in model.graph.input}
    found: list[str] = []
    for name, axes in dynamic_axes.items():
        value = by_name.get(name)
        if value is None:
            continue  # dropped input: nothing to specialise
        dims = value.type.tensor_type.shape.dim
        for axis in axes:
            if axis >= len(dims):
                found.append(f"{name}[{axis}]=<missing>")
                continue
            dim = dims[axis]
            if dim.HasField("dim_value") or not dim.dim_param:
                found.append(f"{name}[{axis}]={dim.dim_value if dim.HasField('dim_value') else '?'}")
    return found


def external_data_files(path: Path | str) -> list[str]:
    """File names (relative to the model's folder) holding the model's external tensor data."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return sorted({location for _, location in external_tensors(model) if location})
