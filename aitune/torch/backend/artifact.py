"""Deployment artifacts: what another runtime needs to serve a tuned graph's built artifact without aitune.

A :class:`DeploymentArtifact` names the file(s) (an ONNX model and its external data, an AOTInductor ``.pt2``
package, a TensorRT engine), the runtime's input and output tensors (name, dtype, shape with its dynamic axes,
min/max bounds, batch axis, and where each value sits in the module's call or return value), the non-tensor
arguments the artifact was built for (constants it assumes) and the runtime options aitune ran it with.

Backends that publish one (:meth:`aitune.torch.backend.base.Backend.artifact`) build it from the same metadata
dict they write into checkpoints (``artifact_from_metadata``), so a live module (files in the build folder)
and a loaded or exported checkpoint (files extracted from the archive) describe it the same way. JIT and
eager backends have none: they compile or run the Python module itself at run time, so there is no file that
runs without it (:func:`no_artifact_reason`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from aitune.errors import BackendStateError, OnnxFileError
from aitune.torch.record.pytree import path_to_name, path_to_str
from aitune.torch.record.serialization import constant_to_json

FORMATS = ("onnx", "pt2", "tensorrt_engine")


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One input or output tensor of a deployment artifact.

    Attributes:
        name: the runtime's name of the tensor (ONNX / TensorRT I/O name; for ``.pt2`` packages, which take
            and return positional lists, aitune's name of that position).
        dtype: dtype name (``"float32"``, ``"int64"``).
        path: where the value sits in the module's call (inputs: ``"x"``, ``"features.tokens"``, ``"[0]"``)
            or in its return value (outputs: ``"pooled"``, ``"[0]"``, ``"<root>"``).
        shape: per axis its size when fixed, else the axis' name (``"batch"``, a declared ``DynamicDim``'s
            name, or ``"<name>_dim<k>"``); None for outputs (their sizes follow from the inputs).
        min_shape / max_shape: the sizes the artifact accepts, per axis, inclusive (None for outputs).
        batch_axis: the axis that holds the batch, or None.
        shapes: for a shape-specialized artifact, the only input shapes that run (None: any within bounds).
    """

    name: str
    dtype: str
    path: str = ""
    shape: tuple | None = None
    min_shape: tuple[int, ...] | None = None
    max_shape: tuple[int, ...] | None = None
    batch_axis: int | None = None
    shapes: tuple[tuple[int, ...], ...] | None = None

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "path": self.path,
                "shape": None if self.shape is None else list(self.shape),
                "min_shape": None if self.min_shape is None else list(self.min_shape),
                "max_shape": None if self.max_shape is None else list(self.max_shape),
                "batch_axis": self.batch_axis,
                "shapes": None if self.shapes is None else [list(shape) for shape in self.shapes]}

    @classmethod
    def from_json(cls, data: dict) -> "TensorInfo":
        def shape(key):
            return None if data.get(key) is None else tuple(data[key])
        return cls(name=str(data["name"]), dtype=str(data["dtype"]), path=str(data.get("path", "")),
                   shape=shape("shape"), min_shape=shape("min_shape"), max_shape=shape("max_shape"),
                   batch_axis=data.get("batch_axis"),
                   shapes=None if data.get("shapes") is None else tuple(tuple(s) for s in data["shapes"]))


@dataclasses.dataclass(frozen=True)
class DeploymentArtifact:
    """What another runtime needs to serve one tuned graph's artifact without aitune.

    Attributes:
        graph: the graph's name (``"graph0"``). backend: the backend's registry name (``"onnxruntime"``).
        format: ``"onnx"``, ``"pt2"`` or ``"tensorrt_engine"``.
        files: the model file first, then the files it needs beside it (ONNX external data, TensorRT
            optimization profiles), as paths. For a live or loaded module they lie in its build or extraction
            folder and live as long as the module: copy them (or use ``aitune export``) to keep them.
        inputs: the runtime's inputs in the order it takes them (:class:`TensorInfo`).
        outputs: its outputs in the order it returns them.
        constants: the non-tensor arguments the artifact was built for, by their path in the call
            (``{"pooling": "mean"}``): calls with other values are not what it computes. Parameters the
            recorded calls left at their default are baked with that default and not listed.
        runtime: how aitune ran it: the loader, execution provider(s), session options, IO binding, CUDA
            graphs, device (JSON; keys depend on ``format``).
    """

    graph: str
    backend: str
    format: str
    files: tuple[Path, ...]
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    constants: dict = dataclasses.field(default_factory=dict)
    runtime: dict = dataclasses.field(default_factory=dict)

    @property
    def model_file(self) -> Path:
        """The file a runtime loads (``files[0]``)."""
        return self.files[0]

    def to_json(self, relative_to: str | os.PathLike | None = None) -> dict:
        """JSON-able form; ``relative_to``: write file paths relative to this folder (posix), else absolute."""
        def file_text(path: Path) -> str:
            return Path(path).relative_to(relative_to).as_posix() if relative_to is not None else str(path)
        return {"graph": self.graph, "backend": self.backend, "format": self.format,
                "files": [file_text(path) for path in self.files],
                "inputs": [tensor.to_json() for tensor in self.inputs],
                "outputs": [tensor.to_json() for tensor in self.outputs],
                "constants": dict(self.constants), "runtime": dict(self.runtime)}

    @classmethod
    def from_json(cls, data: dict, relative_to: str | os.PathLike | None = None) -> "DeploymentArtifact":
        """Inverse of :meth:`to_json`; relative file paths are resolved against ``relative_to`` when given."""
        base = Path(relative_to) if relative_to is not None else None
        return cls(graph=str(data["graph"]), backend=str(data["backend"]), format=str(data["format"]),
                   files=tuple(base / name if base is not None else Path(name) for name in data["files"]),
                   inputs=tuple(TensorInfo.from_json(item) for item in data["inputs"]),
                   outputs=tuple(TensorInfo.from_json(item) for item in data["outputs"]),
                   constants=dict(data.get("constants") or {}), runtime=dict(data.get("runtime") or {}))


# --------------------------------------------------------------------------------------------- graph facts


@dataclasses.dataclass
class GraphFacts:
    """What an artifact description reads from its graph: its name, each input leaf's readable path, the
    constants, per tensor leaf each axis' kind and declared name, and the device the backend runs on. Built from a live
    :class:`~aitune.torch.record.samples.GraphSpec` (:meth:`of`) or from its checkpoint manifest entry
    (:meth:`from_entry`, plain JSON: nothing is imported)."""

    name: str
    input_paths: list[str]
    constants: dict[str, Any]
    axes: dict[int, list[str]]  # leaf index -> "static" | "dynamic" | "batch" per axis
    dim_names: dict[int, list[str | None]]  # leaf index -> declared dim name per axis
    device: str = "cpu"  # where the backend runs it

    @classmethod
    def of(cls, graph, device=None) -> "GraphFacts":
        constants = {}
        for path, value in getattr(graph, "constants", {}).items():
            try:
                constants[path] = constant_to_json(value, path)
            except Exception:  # noqa: BLE001 - a constant without a JSON form is shown as its repr
                constants[path] = repr(value)
        specs = getattr(graph, "tensor_specs", [])
        return cls(name=getattr(graph, "name", "graph"), input_paths=list(getattr(graph, "input_paths", [])),
                   constants=constants, axes={spec.leaf_index: list(spec.axes) for spec in specs},
                   dim_names={spec.leaf_index: [getattr(dim, "name", None) for dim in spec.dims] for spec in specs},
                   device=str(device) if device is not None else "cpu")

    @classmethod
    def from_entry(cls, entry: dict) -> "GraphFacts":
        specs = entry.get("tensor_specs") or []
        return cls(name=str(entry.get("name", "graph")), input_paths=list(entry.get("input_paths") or []),
                   constants={item["path"]: item.get("value") for item in entry.get("constants") or []},
                   axes={int(spec["leaf_index"]): list(spec.get("axes", [])) for spec in specs},
                   dim_names={int(spec["leaf_index"]): [(dim or {}).get("name") for dim in spec.get("dims") or []]
                              for spec in specs}, device=str(entry.get("device") or "cpu"))

    def path(self, leaf_index: int) -> str:
        return self.input_paths[leaf_index] if 0 <= leaf_index < len(self.input_paths) else f"#{leaf_index}"


def input_info(name: str, dtype: str, leaf_index: int, low: list[int], high: list[int], graph: GraphFacts,
               path: str | None = None, shapes: list | None = None) -> TensorInfo:
    """A runtime input: bounds ``low``..``high`` (or the exact ``shapes`` of a shape-specialized artifact),
    axis names and batch axis from ``graph``."""
    if shapes:
        low = [min(shape[axis] for shape in shapes) for axis in range(len(shapes[0]))]
        high = [max(shape[axis] for shape in shapes) for axis in range(len(shapes[0]))]
    kinds = graph.axes.get(leaf_index, [])
    declared = graph.dim_names.get(leaf_index, [])
    shape: list = []
    for axis, (lo, hi) in enumerate(zip(low, high)):
        kind = kinds[axis] if axis < len(kinds) else None
        dim_name = declared[axis] if axis < len(declared) else None
        shape.append(lo if lo == hi else dim_name or ("batch" if kind == "batch" else f"{name}_dim{axis}"))
    batch = next((axis for axis, kind in enumerate(kinds) if kind == "batch"), None)
    return TensorInfo(name=name, dtype=dtype, path=path or graph.path(leaf_index), shape=tuple(shape),
                      min_shape=tuple(int(v) for v in low), max_shape=tuple(int(v) for v in high), batch_axis=batch,
                      shapes=None if not shapes else tuple(tuple(int(v) for v in s) for s in shapes))


def output_infos(outputs_json: dict, names: list[str] | None = None) -> tuple[TensorInfo, ...]:
    """The tensor outputs of an ``outputs_to_json`` structure, in flat order: their dtype, path in the return
    value and ``names`` (the runtime's; default: aitune's ``output_<path>``)."""
    slots = outputs_json.get("slots", [])
    paths = _json_leaf_paths(outputs_json.get("spec") or {})
    if len(paths) != len(slots):
        paths = [(index,) for index in range(len(slots))]
    tensors = [(path, slot["tensor"]) for path, slot in zip(paths, slots) if "tensor" in slot]
    names = list(names) if names is not None and len(names) == len(tensors) else [
        path_to_name(path, "output") for path, _ in tensors]
    return tuple(TensorInfo(name=name, dtype=dtype, path=path_to_str(path))
                 for name, (path, dtype) in zip(names, tensors))


def _json_leaf_paths(spec: dict, prefix: tuple = ()) -> list[tuple]:
    """Leaf paths of a ``tree_spec_to_json`` structure, read from the JSON (no type is looked up)."""
    if spec.get("kind") == "leaf" or "children" not in spec:
        return [prefix]
    keys = spec.get("context") or range(len(spec["children"]))
    paths: list[tuple] = []
    for key, child in zip(keys, spec["children"]):
        paths.extend(_json_leaf_paths(child, prefix + (key,)))
    return paths


def config_data(config: dict) -> dict:
    """The fields of a stored ``BackendConfig.to_dict`` (or of a plain ``{field: value}`` dict)."""
    return dict(config.get("data", config)) if isinstance(config, dict) else {}


def stored_files(directory: Path, names: list[str]) -> tuple[Path, ...]:
    """``directory / name`` per stored file name (names were checked when the backend saved or loaded them)."""
    return tuple(Path(directory) / name for name in names)


def require_built(backend) -> None:
    """Raise BackendStateError for a backend that has no built artifact yet."""
    if backend.state.value in ("init", "building"):
        raise BackendStateError(f"{backend.describe()}: artifact() needs a built backend (state: "
                                f"{backend.state.value}); build it, or call finish_build() first")


# --------------------------------------------------------------------------------------------- per module


def no_artifact_reason(backend) -> str:
    """Why a chosen backend publishes no deployment artifact."""
    if backend.build_mode.value == "jit":
        return (f"{backend.name} is a JIT backend: it compiles or runs the Python module itself at run time, so "
                "there is no file that runs without the module and aitune")
    return f"{backend.name} builds no artifact that another runtime loads on its own (it runs inside aitune only)"


def deployment_artifacts(entries, stale_weights: str | None = None) -> tuple[dict[str, DeploymentArtifact],
                                                                            dict[str, str]]:
    """The artifacts of ``(GraphSpec, Backend)`` entries, by graph name, and why each other graph has none.

    ``stale_weights``: what changed in the module's weights since tuning (None: nothing); a backend that baked
    the old weights in publishes no artifact then, since it would serve other weights than the module's.
    """
    artifacts, reasons = {}, {}
    for graph, backend in entries:
        if stale_weights is not None and backend.bakes_weights and not graph.stateful:
            reasons[graph.name] = (f"{stale_weights}: {backend.name} baked the old weights in, so its artifact "
                                   "would not serve the module's weights; re-tune (module.enable_recording("
                                   "force=True), then ait.tune) for an artifact of the current weights")
            continue
        try:
            artifact = backend.artifact()
        except OnnxFileError as exc:  # the user's file changed under a live module: say so, offer nothing
            reasons[graph.name] = str(exc)
            continue
        if artifact is None:
            reasons[graph.name] = no_artifact_reason(backend)
        else:
            artifacts[graph.name] = artifact
    return artifacts, reasons


def dumps(data: Any) -> str:
    """JSON text of a manifest (indented, no NaN)."""
    return json.dumps(data, indent=2, allow_nan=False) + "\n"
