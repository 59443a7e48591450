"""What an existing ``.onnx`` file declares, read once and checked before anything runs it.

:func:`read_onnx_file` validates the file (it exists, parses as an ``onnx.ModelProto``, passes
``onnx.checker.check_model`` by path, so models with external data and models over 2 GiB work) and its external
data (every location is relative, stays inside the model's folder, symbolic links included, and exists), then
reads the names, element types and shapes of the graph's inputs and outputs. The weights are never loaded
(``onnx.load(..., load_external_data=False)``) and the file is only read, never written.

``onnx`` is an optional package: it is imported inside the functions that need it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch

from aitune.errors import OnnxFileError, one_line

# ONNX TensorProto element types (onnx/onnx.proto, ``TensorProto.DataType``) that ONNX Runtime's Python API
# feeds and returns as numpy arrays of a torch dtype.
_ELEMENT_TYPES = {
    1: torch.float32, 2: torch.uint8, 3: torch.int8, 5: torch.int16, 6: torch.int32, 7: torch.int64,
    9: torch.bool, 10: torch.float16, 11: torch.float64,
}


@dataclasses.dataclass(frozen=True)
class OnnxTensorInfo:
    """One graph input or output of an ONNX file.

    Attributes:
        name: the ONNX name.
        dtype: the torch dtype of its element type.
        shape: one entry per axis: an int for a fixed size, the ``dim_param`` name for a named dynamic axis,
            None for an axis without a size or name; None for the whole shape when the file declares no rank.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int | str | None, ...] | None

    @property
    def dynamic_axes(self) -> dict[int, str | None]:
        """``{axis: dim_param name or None}`` of the axes without a fixed size."""
        return {axis: dim for axis, dim in enumerate(self.shape or ()) if not isinstance(dim, int)}

    def describe(self) -> str:
        """``float32[batch, 8]``: the dtype and shape as the file declares them (``?`` for an unnamed axis)."""
        if self.shape is None:
            return f"{str(self.dtype).removeprefix('torch.')}[any rank]"
        dims = ", ".join("?" if dim is None else str(dim) for dim in self.shape)
        return f"{str(self.dtype).removeprefix('torch.')}[{dims}]"


@dataclasses.dataclass(frozen=True)
class OnnxFileInfo:
    """What :func:`read_onnx_file` found.

    Attributes:
        path: the model file, absolute. inputs / outputs: the graph's inputs (initializers excluded) and outputs,
        in the file's order. external_data: the locations (relative to ``path``'s folder) of its external data.
    """

    path: Path
    inputs: tuple[OnnxTensorInfo, ...]
    outputs: tuple[OnnxTensorInfo, ...]
    external_data: tuple[str, ...]


def read_onnx_file(path: str | os.PathLike) -> OnnxFileInfo:
    """Check an existing ONNX file and read its inputs, outputs and external data.

    Args:
        path: the ``.onnx`` file; external data files lie in its folder (or below it).

    Returns:
        An :class:`OnnxFileInfo`.

    Raises:
        OnnxFileError: the file is missing, not a valid ONNX model, declares an input or output of a type ONNX
            Runtime's Python API cannot feed or return as a torch tensor, or has an external data location that
            is absolute, leaves the model's folder (``..`` or a symbolic link) or does not exist. The message
            names the file, what is wrong and how to fix it.
    """
    import onnx

    path = Path(path).expanduser().absolute()
    if not path.is_file():
        raise OnnxFileError(f"ONNX file {path} does not exist{' (it is a folder)' if path.is_dir() else ''}; "
                            "pass the path of an existing .onnx model file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and OSError alike: the file is unusable
        raise OnnxFileError(f"{path} is not a valid ONNX model: it cannot be parsed ({one_line(exc)}); pass a "
                            "complete .onnx file (e.g. written by torch.onnx.export or onnx.save_model)") from exc
    external = _external_data_locations(model, path)
    if not model.HasField("graph") or not model.graph.output:
        raise OnnxFileError(f"{path} is not a valid ONNX model: it has no graph outputs (the file may be truncated "
                            "or not an ONNX model at all); pass a complete .onnx file")
    try:
        onnx.checker.check_model(str(path))  # by path: external data is checked, not loaded, and >2 GiB works
    except Exception as exc:  # noqa: BLE001 - ValidationError and the checker's other failures
        raise OnnxFileError(f"{path} is not a valid ONNX model: onnx.checker.check_model says "
                            f"{one_line(exc, type_name=False)}; fix or re-export the model") from exc
    initializers = {tensor.name for tensor in model.graph.initializer}
    inputs = tuple(_tensor_info(value, path, "input") for value in model.graph.input if value.name not in initializers)
    outputs = tuple(_tensor_info(value, path, "output") for value in model.graph.output)
    return OnnxFileInfo(path=path, inputs=inputs, outputs=outputs, external_data=external)


def _tensor_info(value, path: Path, role: str) -> OnnxTensorInfo:
    kind = value.type.WhichOneof("value")
    if kind != "tensor_type":
        raise OnnxFileError(f"{path}: graph {role} {value.name!r} is a {kind or 'value without a type'}, not a "
                            "tensor; OnnxModule runs models whose inputs and outputs are tensors")
    tensor_type = value.type.tensor_type
    dtype = _ELEMENT_TYPES.get(tensor_type.elem_type)
    if dtype is None:
        import onnx

        type_name = onnx.TensorProto.DataType.Name(tensor_type.elem_type) \
            if tensor_type.elem_type in onnx.TensorProto.DataType.values() else str(tensor_type.elem_type)
        supported = ", ".join(sorted(str(d).removeprefix("torch.") for d in _ELEMENT_TYPES.values()))
        raise OnnxFileError(f"{path}: graph {role} {value.name!r} has element type {type_name}, which ONNX "
                            f"Runtime's Python API does not exchange as a torch tensor (supported: {supported}); "
                            "add a Cast at the graph's boundary")
    shape = None
    if tensor_type.HasField("shape"):
        shape = tuple(dim.dim_value if dim.HasField("dim_value") else (dim.dim_param or None)
                      for dim in tensor_type.shape.dim)
    return OnnxTensorInfo(name=value.name, dtype=dtype, shape=shape)


def model_tensors(model) -> list:
    """Every ``TensorProto`` an ONNX model holds: its graph's initializers (sparse ones' values and indices too)
    and the tensor attributes (sparse ones too) of its nodes and of its local functions' nodes, those inside the
    subgraphs of control-flow nodes (``If``'s branches, ``Loop``/``Scan`` bodies) included, at any depth."""
    tensors = _graph_tensors(model.graph)
    for function in model.functions:
        tensors.extend(_node_tensors(function.node))
    return tensors


def _graph_tensors(graph) -> list:
    tensors = list(graph.initializer)
    for sparse in graph.sparse_initializer:
        tensors.extend((sparse.values, sparse.indices))
    return tensors + _node_tensors(graph.node)


def _node_tensors(nodes) -> list:
    tensors = []
    for node in nodes:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                tensors.append(attribute.t)
            tensors.extend(attribute.tensors)
            sparse = ([attribute.sparse_tensor] if attribute.HasField("sparse_tensor") else []) + list(
                attribute.sparse_tensors)
            for value in sparse:
                tensors.extend((value.values, value.indices))
            if attribute.HasField("g"):
                tensors.extend(_graph_tensors(attribute.g))
            for subgraph in attribute.graphs:
                tensors.extend(_graph_tensors(subgraph))
    return tensors


def external_tensors(model) -> list[tuple[object, str | None]]:
    """``(tensor, location)`` of every tensor of ``model`` (:func:`model_tensors`) stored as external data; the
    location as the file writes it (relative to the model's folder), None when it has none."""
    from onnx.external_data_helper import uses_external_data

    return [(tensor, next((entry.value for entry in tensor.external_data if entry.key == "location"), None))
            for tensor in model_tensors(model) if uses_external_data(tensor)]


def _external_data_locations(model, path: Path) -> tuple[str, ...]:
    """The external data locations of ``model`` (loaded without its data), each checked to lie in its folder."""
    folder = path.parent.resolve()
    locations: dict[str, None] = {}
    for tensor, location in external_tensors(model):
        if not location:
            raise OnnxFileError(f"{path}: tensor {tensor.name!r} is stored as external data without a location; "
                                "re-save the model with onnx.save_model(..., save_as_external_data=True)")
        locations.setdefault(location, None)
    for location in locations:
        _check_location(location, path, folder)
    return tuple(locations)


def _check_location(location: str, path: Path, folder: Path) -> None:
    fix = ("keep the data files in the model's folder and re-save with relative locations "
           "(onnx.save_model(model, path, save_as_external_data=True, location='<name>.data'))")
    if PurePosixPath(location).is_absolute() or PureWindowsPath(location).is_absolute() or \
            PureWindowsPath(location).drive:
        raise OnnxFileError(f"{path}: external data location {location!r} is an absolute path; ONNX Runtime reads "
                            f"external data relative to the model's folder only: {fix}")
    if ".." in PurePosixPath(location.replace("\\", "/")).parts:
        raise OnnxFileError(f"{path}: external data location {location!r} leaves the model's folder ({folder}) "
                            f"through '..'; {fix}")
    target = folder / location
    resolved = target.resolve()
    if not resolved.is_relative_to(folder):
        raise OnnxFileError(f"{path}: external data location {location!r} resolves to {resolved}, outside the "
                            f"model's folder {folder} (a symbolic link); {fix}")
    if not resolved.is_file():
        raise OnnxFileError(f"{path}: external data file {location!r} is missing (looked for {target}); copy it "
                            "beside the model, or pass the model file that belongs to it")
