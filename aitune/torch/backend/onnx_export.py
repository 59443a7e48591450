"""Export one graph of a module to ONNX (shared by the ONNX Runtime and TensorRT backends).

:func:`export_onnx` exports a :class:`~aitune.torch.backend.flat.FlatModule` (flat tensor inputs, flat
tensor outputs, names from :class:`~aitune.torch.backend.flat.FlatIO`) so nested inputs, keyword-only
parameters and structured outputs never reach the exporter (cases C04, C05). The graph's dynamic and batch
axes are exported as dynamic; afterwards the ONNX graph inputs are checked for symbolic dims on every such
axis (case C03) and the result says whether the export came out shape-specialized.

Optional packages (``onnx``, ``onnxscript`` through ``torch.onnx``) are imported inside functions only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import logging
import math
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

from aitune.errors import CheckpointError, ConfigError
from aitune.torch.backend.flat import FlatIO
from aitune.torch.pytree import LEAF, TreeSpec, hashable_constant, tree_flatten, tree_unflatten
from aitune.torch.samples import BATCH, STATIC
from aitune.torch.serialization import output_template_from_json, outputs_to_json
from aitune.torch.serialization import tree_spec_from_json as spec_from_json
from aitune.torch.serialization import tree_spec_to_json as spec_to_json

logger = logging.getLogger(__name__)

DYNAMO, TORCHSCRIPT = "dynamo", "torchscript"


@dataclasses.dataclass
class OnnxExport:
    """Result of :func:`export_onnx`.

    Attributes:
        path: the ``.onnx`` file. External weights, if any, lie beside it (``external_data_files``).
        input_names: names of the ONNX graph inputs, in flat-input order. An input the exporter dropped
            because the graph does not use it is absent (see ``input_indices``).
        input_indices: for each name in ``input_names``, its position among ``flat_io``'s tensor inputs.
        output_names: names of the ONNX graph outputs, one per tensor output of eager, in flat order.
        exporter: ``"dynamo"`` (``torch.onnx.export(dynamo=True)``) or ``"torchscript"`` (the legacy
            tracer) — the one that produced the file.
        dynamic_axes: ``{input name: {axis: dim name}}`` that were declared dynamic.
        notes: what happened on the way (fallbacks, repeated export samples, specialized axes).
        flat_io: maps calls to the flat inputs and flat outputs back to eager's structure.
        shape_specialized: True when an axis declared dynamic came out as a fixed size in the ONNX graph
            inputs; the graph then only runs the exact shapes it was exported with (case C03).
        specialized_axes: ``"<input name>[<axis>]=<size>"`` for every such axis.
        example_shapes: shapes of the flat tensor inputs the graph was exported with.
        external_data_files: file names (relative to ``path``'s folder) of external tensor data.
        log_path: the export log (exporter output, warnings, tracebacks of failed exporters).
    """

    path: Path
    input_names: list[str]
    output_names: list[str]
    exporter: str
    dynamic_axes: dict[str, dict[int, str]]
    notes: list[str]
    flat_io: FlatIO
    input_indices: list[int] = dataclasses.field(default_factory=list)
    shape_specialized: bool = False
    specialized_axes: list[str] = dataclasses.field(default_factory=list)
    example_shapes: list[list[int]] = dataclasses.field(default_factory=list)
    external_data_files: list[str] = dataclasses.field(default_factory=list)
    log_path: Path | None = None


def training_submodules(module: torch.nn.Module) -> list[str]:
    """Names of the (sub)modules of ``module`` that are in training mode (``""`` is the module itself)."""
    return [name or "<root>" for name, submodule in module.named_modules() if submodule.training]


def training_mode_reason(module: torch.nn.Module) -> str | None:
    """The refusal reason for a module in training mode, or None when it is fully in eval mode."""
    names = training_submodules(module)
    if not names:
        return None
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"module is in training mode ({shown}); call .eval() (ONNX export has eval semantics only)"


def export_onnx(module: torch.nn.Module, graph, path: Path | str, *, use_dynamo: bool = True,
                opset_version: int | None = None, device: torch.device | str) -> OnnxExport:
    """Export one graph of ``module`` to an ONNX file with flat, named tensor inputs and outputs.

    The dynamo exporter (``torch.onnx.export(dynamo=True)``, which runs ``torch.export``) gets
    ``Dim.DYNAMIC`` for every dynamic/batch axis of ``graph.tensor_specs``; it exports at a sample whose
    dynamic axes are all >= 2, repeating a recorded sample along such axes when every sample has size 1
    there (``torch.export`` specialises sizes 0 and 1, case C02). If it fails, the TorchScript exporter
    runs with ``dynamic_axes`` and a note records the fallback. The file is checked with
    ``onnx.checker`` (by path, so models over 2 GiB work) and its graph inputs are checked for symbolic
    dims on every dynamic axis (case C03).

    NOTE [Dim.DYNAMIC, not Dim.AUTO or named Dims]: measured with torch 2.13 on a module that calls
    ``int(x.shape[0])``: ``Dim.AUTO`` kept symbolic graph inputs but baked the sizes into ``Reshape``
    constants (a silently static graph), named ``Dim(min, max)`` silently produced fixed-size inputs, and
    ``Dim.DYNAMIC`` gave a graph that ran correctly at other batch and sequence sizes.

    Args:
        module: the user's module, in eval mode; not modified (parameters, buffers, training flags).
        graph: a :class:`~aitune.torch.samples.GraphSpec` with at least one recorded sample.
        path: the ``.onnx`` file to write (its folder is created); external data goes beside it, and the
            exporters' output, warnings and tracebacks go to ``<stem>_export.log`` beside it.
        use_dynamo: try the dynamo exporter first (True) or use only the TorchScript exporter (False).
        opset_version: ONNX opset; None lets the exporter choose.
        device: device the module and the export sample live on.

    Returns:
        An :class:`OnnxExport` describing the file.

    Raises:
        ConfigError: the module (or a submodule) is in training mode, the graph has no samples, or the
            module returns no tensor.
        RuntimeError: every exporter failed (the message holds each exporter's error), or the exported
            graph's inputs/outputs cannot be matched to the module's.
        onnx.checker.ValidationError: the exported file is not valid ONNX.
    """
    import onnx

    reason = training_mode_reason(module)
    if reason is not None:
        raise ConfigError(reason)
    if not graph.samples:
        raise ConfigError(f"{graph.name} has no recorded samples; record at least one call before exporting")
    device = torch.device(device)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    log_path = path.with_name(path.stem + "_export.log")

    reference_output = _eager_output(module, graph, device)
    flat_io = FlatIO(graph, reference_output)
    if not flat_io.output_names:
        raise ConfigError("the module's output holds no tensor; there is nothing to export to ONNX")
    notes: list[str] = []
    example, example_notes = export_example(graph, flat_io, device)
    notes.extend(example_notes)
    dynamic_axes = declared_dynamic_axes(graph)

    flat_module = flat_io.flat_module(module)
    training_flags = {name: sub.training for name, sub in module.named_modules()}
    flat_module.eval()  # a FlatModule starts in training mode; exporters restore the mode they found
    log: list[str] = [f"export sample shapes: {[list(t.shape) for t in example]}", *notes]
    dynamo_error = ""
    try:
        exporter = TORCHSCRIPT
        if use_dynamo:
            try:
                _export_dynamo(flat_module, example, path, flat_io, graph, opset_version, log)
                exporter = DYNAMO
            except Exception as exc:  # noqa: BLE001 - any dynamo failure falls back, recorded in the notes
                log.append("dynamo exporter failed:\n" + traceback.format_exc())
                dynamo_error = _short(exc, 160)
                notes.append(f"dynamo exporter failed ({_short(exc)}); fell back to TorchScript exporter")
                _remove_outputs(path)
        if exporter == TORCHSCRIPT:
            output_ranks = [leaf.dim() for leaf in tree_flatten(reference_output)[0] if isinstance(leaf, torch.Tensor)]
            try:
                _export_torchscript(flat_module, example, path, flat_io, dynamic_axes, opset_version, output_ranks,
                                    log)
                _check_trace_warnings(log, notes)
            except Exception as exc:
                log.append("TorchScript exporter failed:\n" + traceback.format_exc())
                if use_dynamo:
                    raise RuntimeError(f"both ONNX exporters failed; TorchScript: {_short(exc, 160)}; dynamo: "
                                       f"{dynamo_error} (log: {log_path})") from exc
                raise
    finally:
        for name, submodule in module.named_modules():
            submodule.training = training_flags.get(name, submodule.training)
        log_path.write_text("\n".join(log) + "\n")

    onnx.checker.check_model(str(path))
    model = onnx.load(str(path), load_external_data=False)
    input_names, input_indices, output_names = _match_io(model, flat_io, notes)
    produced_opset = next((entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx")), None)
    if opset_version is not None and produced_opset != opset_version:
        notes.append(f"requested opset {opset_version}; the {exporter} exporter produced opset {produced_opset}")
    specialized = specialized_axes(model, dynamic_axes)
    if specialized:
        notes.append(f"ONNX graph inputs have fixed sizes on axes declared dynamic ({', '.join(specialized)}); "
                     "the graph is shape-specialized and only runs its export shapes")
    result = OnnxExport(path=path, input_names=input_names, output_names=output_names, exporter=exporter,
                        dynamic_axes=dynamic_axes, notes=notes, flat_io=flat_io, input_indices=input_indices,
                        shape_specialized=bool(specialized), specialized_axes=specialized,
                        example_shapes=[list(t.shape) for t in example],
                        external_data_files=external_data_files(path), log_path=log_path)
    for note in notes:
        logger.info("onnx export: %s", note)
    logger.debug("exported %s with the %s exporter: inputs %s outputs %s", path, exporter, input_names, output_names)
    return result


# --------------------------------------------------------------------------------------------- helpers


def _eager_output(module: torch.nn.Module, graph, device: torch.device) -> Any:
    sample = graph.samples[0].clone()
    args, kwargs = _to_device((sample.args, sample.kwargs), device)
    with torch.no_grad():
        return module(*args, **kwargs)


def _to_device(value: Any, device: torch.device) -> Any:
    leaves, spec = tree_flatten(value)
    return tree_unflatten(spec, [leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves])


def export_example(graph, flat_io: FlatIO, device: torch.device) -> tuple[list[torch.Tensor], list[str]]:
    """Flat input tensors to export with, and notes on how they were made.

    Picks the recorded sample with the fewest dynamic axes of size < 2; if some remain, repeats the
    tensor along those axes (all batch axes together when the sample's batch is 1) so that
    ``torch.export`` does not specialise them (sizes 0 and 1 are special to it, case C02). A size the
    user-declared maximum does not allow is left as is.
    """
    def small_axes(sample) -> int:
        leaves = sample.leaves()
        return sum(1 for spec in graph.tensor_specs for axis in spec.dynamic_axes
                   if leaves[spec.leaf_index].shape[axis] < 2)

    sample = min(graph.samples, key=small_axes)
    tensors = [t.detach().to(device) for t in flat_io.sample_inputs(sample.clone())]
    notes: list[str] = []
    repeat_batch = sample.batch_size == 1
    for position, spec in enumerate(graph.tensor_specs):
        tensor = tensors[position]
        _, _, high = graph.shape_range(spec)
        for axis, kind in enumerate(spec.axes):
            size = tensor.shape[axis]
            if kind == STATIC or size == 0:
                continue
            if (kind == BATCH and repeat_batch) or size == 1:
                if 2 * size > high[axis]:
                    continue
                tensor = torch.cat([tensor, tensor], dim=axis)
                notes.append(f"export sample of {spec.name} repeated along axis {axis} ({size} -> {2 * size}) "
                             "to avoid 0/1 specialisation")
        tensors[position] = tensor.contiguous()
    for spec, tensor in zip(graph.tensor_specs, tensors):
        for axis in spec.dynamic_axes:
            if tensor.shape[axis] < 2:
                notes.append(f"{spec.name} axis {axis} is exported at size {tensor.shape[axis]}; the exporter "
                             "may specialise it")
    return tensors, notes


def declared_dynamic_axes(graph) -> dict[str, dict[int, str]]:
    """``{input name: {axis: dim name}}`` for every dynamic/batch axis of the graph.

    Batch axes with multiplier 1 share the name ``batch``; other axes get ``<input name>_dim<axis>``.
    """
    axes: dict[str, dict[int, str]] = {}
    for spec in graph.tensor_specs:
        for axis in spec.dynamic_axes:
            shared = spec.axes[axis] == BATCH and (spec.multipliers[axis] == 1.0 or math.isnan(spec.multipliers[axis]))
            axes.setdefault(spec.name, {})[axis] = "batch" if shared else f"{spec.name}_dim{axis}"
    return axes


@contextlib.contextmanager
def _quiet_exporter(log: list[str]):
    """Capture the exporters' stdout banners and warnings into ``log`` (written to the export log)."""
    stdout = io.StringIO()
    try:
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(stdout):
            warnings.simplefilter("always")
            yield
    finally:
        text = stdout.getvalue().strip()
        if text:
            log.append(text)
        log.extend(f"warning: {warning.category.__name__}: {warning.message}" for warning in caught)


def _export_dynamo(flat_module, example, path: Path, flat_io: FlatIO, graph, opset_version, log: list[str]) -> None:
    from torch.export import Dim

    dynamic_shapes = None
    if any(spec.dynamic_axes for spec in graph.tensor_specs):
        # FlatModule.forward(*tensors): torch.export wants the var-positional's specs under its name.
        dynamic_shapes = {"tensors": tuple({axis: Dim.DYNAMIC for axis in spec.dynamic_axes} or None
                                           for spec in graph.tensor_specs)}
    options: dict[str, Any] = dict(input_names=flat_io.input_names, output_names=flat_io.output_names,
                                   dynamo=True, dynamic_shapes=dynamic_shapes, external_data=True)
    if opset_version is not None:
        options["opset_version"] = opset_version
    # torch < 2.11 silently fell back to the TorchScript exporter unless fallback=False; the argument is
    # gone in newer versions, so feature-detect it (reference_aitune C.3).
    if "fallback" in inspect.signature(torch.onnx.export).parameters:
        options["fallback"] = False
    log.append(f"== dynamo exporter: dynamic_shapes={dynamic_shapes}, opset_version={opset_version}")
    with _quiet_exporter(log):
        torch.onnx.export(flat_module, tuple(example), str(path), **options)
    if not path.exists():
        raise RuntimeError(f"the dynamo exporter wrote no file at {path}")


def _export_torchscript(flat_module, example, path: Path, flat_io: FlatIO, dynamic_axes, opset_version,
                        output_ranks: list[int], log: list[str]) -> None:
    axes = {name: dict(value) for name, value in dynamic_axes.items()}
    if dynamic_axes:
        # Output sizes follow the inputs; declare every output axis dynamic so the ONNX output types do not
        # carry the export sample's sizes.
        for name, rank in zip(flat_io.output_names, output_ranks):
            axes[name] = {axis: f"{name}_dim{axis}" for axis in range(rank)}
    options: dict[str, Any] = dict(input_names=flat_io.input_names, output_names=flat_io.output_names,
                                   dynamic_axes=axes or None, do_constant_folding=True)
    if opset_version is not None:
        options["opset_version"] = opset_version
    if "dynamo" in inspect.signature(torch.onnx.export).parameters:
        options["dynamo"] = False
    log.append(f"== TorchScript exporter: dynamic_axes={axes or None}, opset_version={opset_version}")
    with _quiet_exporter(log):
        torch.onnx.export(flat_module, tuple(example), str(path), **options)


def _check_trace_warnings(log: list[str], notes: list[str]) -> None:
    """Refuse a TorchScript trace that baked a branch; note other tracer warnings.

    NOTE [baked branches]: the tracer records one path through ``if tensor:`` (tensor values or traced
    sizes, e.g. ``if x.shape[0] == 4``). The graph then runs at every shape and silently gives the traced
    branch's result for inputs that would take the other one, which no shape check catches (measured with
    torch 2.13). Conversions to Python numbers are only noted: when they turn sizes into constants, the
    backend's run at the other recorded shapes fails and restricts the graph (case C03).
    """
    tracer = [line for line in log if "TracerWarning" in line]
    if any("Python boolean" in line for line in tracer):
        raise RuntimeError("the TorchScript trace baked a data-dependent branch (TracerWarning: converting a "
                           "tensor to a Python boolean); its ONNX graph would be wrong for inputs that take the "
                           "other branch")
    if tracer:
        notes.append(f"the TorchScript tracer warned {len(tracer)} time(s) that the trace might not generalise "
                     "to other inputs; see the export log")


def _remove_outputs(path: Path) -> None:
    for candidate in path.parent.glob(path.name + "*"):
        if candidate.is_file():
            candidate.unlink()


def _short(exc: BaseException, limit: int = 240) -> str:
    text = str(exc)
    marker = "## Exception summary"
    if marker in text:  # torch.onnx wraps the real error under this heading
        text = text.split(marker, 1)[1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else ""
    message = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return message if len(message) <= limit else message[: limit - 1] + "…"


def _match_io(model, flat_io: FlatIO, notes: list[str]) -> tuple[list[str], list[int], list[str]]:
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
    from onnx.external_data_helper import uses_external_data

    model = onnx.load(str(path), load_external_data=False)
    files: set[str] = set()
    tensors = list(model.graph.initializer)
    for node in model.graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                tensors.append(attribute.t)
            tensors.extend(attribute.tensors)
    for tensor in tensors:
        if uses_external_data(tensor):
            for entry in tensor.external_data:
                if entry.key == "location":
                    files.add(entry.value)
    return sorted(files)





def constant_key(value: Any) -> str:
    """A string that is equal for equal constants (used to check that a call's constants are the baked ones)."""
    return repr(hashable_constant(value))


# --------------------------------------------------------------------------------------------- calls <-> flat I/O


_PLAIN_LEAF_TYPES = (torch.Tensor, int, float, bool, str, type(None))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass
class OnnxCallIO:
    """Maps a module call to the ONNX graph's named inputs and its outputs back to eager's structure.

    Built from an :class:`OnnxExport` at build time, stored as JSON in checkpoints, and rebuilt without the
    module or the graph (types of structured outputs are then imported by name, see
    :func:`spec_from_json`).

    Attributes:
        input_spec: structure of the canonical ``(args, kwargs)`` of the graph.
        num_leaves: number of input leaves; tensor_indices: leaf index of each flat tensor input.
        input_dtypes / input_low / input_high: dtype and accepted size range per flat tensor input.
        constant_keys: ``{leaf index: key}`` of the non-tensor inputs baked into the graph (case C06).
        input_names / input_positions: ONNX input names and the flat tensor position each takes.
        output_names / output_dtypes: ONNX output names and eager's dtype of each.
        output_spec / output_constants: eager's output structure and its non-tensor leaves (None in tensor
            slots). output_is_tensor: which output leaves are tensors (a None output leaf is a constant).
        accepted_shapes: when not None, the only flat input shapes the graph may run (shape-specialized).
        parameters: ``[name, kind, has_default]`` per parameter of the module's ``forward``, so a loaded
            graph normalises calls like :class:`~aitune.torch.samples.CallSignature` without the module.
    """

    input_spec: TreeSpec
    num_leaves: int
    tensor_indices: list[int]
    input_dtypes: list[torch.dtype]
    input_low: list[list[int]]
    input_high: list[list[int]]
    constant_keys: dict[int, str]
    input_names: list[str]
    input_positions: list[int]
    output_names: list[str]
    output_dtypes: list[torch.dtype]
    output_spec: TreeSpec
    output_constants: list[Any]
    accepted_shapes: set[tuple] | None = None
    parameters: list[list] | None = None
    output_is_tensor: list[bool] | None = None

    def __post_init__(self):
        if self.output_is_tensor is None:
            self.output_is_tensor = [constant is None for constant in self.output_constants]
        self._signature = _signature_from_parameters(self.parameters) if self.parameters is not None else None
        # Canonical calls are usually keyword-only and flat: ((), {name: leaf, ...}); such a call's leaves
        # are its values (checked without flattening).
        spec = self.input_spec
        flat = (spec.kind == "tuple" and len(spec.children) == 2 and not spec.children[0].children
                and spec.children[1].kind == "dict" and spec.children[1].node_type is None
                and all(child.kind == LEAF for child in spec.children[1].children))
        self._flat_keys = tuple(spec.children[1].context) if flat else None

    @classmethod
    def from_export(cls, export: OnnxExport, graph, module: torch.nn.Module | None = None) -> "OnnxCallIO":
        leaves = graph.samples[0].leaves()
        low, high = [], []
        for spec in graph.tensor_specs:
            spec_low, _, spec_high = graph.shape_range(spec)
            low.append(list(spec_low))
            high.append(list(spec_high))
        tensor_indices = [spec.leaf_index for spec in graph.tensor_specs]
        constant_keys = {index: constant_key(leaf) for index, leaf in enumerate(leaves) if index not in tensor_indices}
        flat_io = export.flat_io
        return cls(input_spec=graph.input_spec, num_leaves=len(leaves), tensor_indices=tensor_indices,
                   input_dtypes=[spec.dtype for spec in graph.tensor_specs], input_low=low, input_high=high,
                   constant_keys=constant_keys, input_names=list(export.input_names),
                   input_positions=list(export.input_indices), output_names=list(export.output_names),
                   output_dtypes=list(flat_io.output_dtypes), output_spec=flat_io.output_spec,
                   output_constants=list(flat_io.output_constants),
                   accepted_shapes={tuple(map(tuple, export.example_shapes))} if export.shape_specialized else None,
                   parameters=recorded_parameters(graph, module),
                   output_is_tensor=list(flat_io.output_is_tensor))

    # ---- calls
    def leaves_of(self, args: tuple, kwargs: dict, signature=None) -> list[Any]:
        """Input leaves of a call, in the graph's order.

        Args:
            args / kwargs: the call. signature: a :class:`~aitune.torch.samples.CallSignature` of the
                module's ``forward`` to normalise the call first; default: the one stored at build.

        Raises:
            ValueError: the call does not fit ``forward``'s signature, or its structure is not the graph's
                (other arguments, other nesting).
        """
        if not args and self._flat_keys is not None and tuple(kwargs) == self._flat_keys:
            leaves = list(kwargs.values())
            if all(type(leaf) in _PLAIN_LEAF_TYPES for leaf in leaves):
                return leaves
        signature = signature or self._signature
        if signature is not None:
            try:
                args, kwargs = signature.normalize(tuple(args), dict(kwargs))
            except TypeError as exc:
                raise ValueError(f"the call does not fit the module's forward signature: {exc}") from exc
        leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
        if self._same_structure(spec):
            return leaves
        expected_keys = self.input_spec.children[1].context if len(self.input_spec.children) == 2 else ()
        if set(kwargs) == set(expected_keys):  # same keyword arguments in another order
            leaves, spec = tree_flatten((tuple(args), {key: kwargs[key] for key in expected_keys}))
            if self._same_structure(spec):
                return leaves
        raise ValueError("the call's arguments do not have the structure this ONNX graph was exported for; "
                         "call it like the recorded samples (or through aitune.Module, which routes other calls)")

    def _same_structure(self, spec: TreeSpec) -> bool:
        try:
            return spec == self.input_spec or spec_to_json(spec) == spec_to_json(self.input_spec)
        except ConfigError:
            return False

    def check(self, leaves: list[Any]) -> str | None:
        """Why this graph cannot run the call with these input leaves, or None when it can."""
        if len(leaves) != self.num_leaves:
            return f"the call has {len(leaves)} input leaves, the graph {self.num_leaves}"
        for index, key in self.constant_keys.items():
            if isinstance(leaves[index], torch.Tensor) or constant_key(leaves[index]) != key:
                return f"non-tensor input #{index} differs from the value the graph was exported with ({key})"
        shapes = []
        for position, index in enumerate(self.tensor_indices):
            leaf = leaves[index]
            if not isinstance(leaf, torch.Tensor):
                return f"input #{index} must be a tensor"
            if leaf.dtype != self.input_dtypes[position]:
                return f"input #{index} has dtype {leaf.dtype}, the graph takes {self.input_dtypes[position]}"
            if leaf.dim() != len(self.input_low[position]):
                return f"input #{index} has rank {leaf.dim()}, the graph takes {len(self.input_low[position])}"
            shapes.append(tuple(leaf.shape))
        if self.accepted_shapes is not None:
            if tuple(shapes) not in self.accepted_shapes:
                return (f"the graph is shape-specialized: it runs only the shapes {sorted(self.accepted_shapes)}, "
                        f"not {shapes}")
            return None
        for position, shape in enumerate(shapes):
            low, high = self.input_low[position], self.input_high[position]
            if any(not (lo <= size <= hi) for lo, size, hi in zip(low, shape, high)):
                return f"input #{self.tensor_indices[position]} shape {list(shape)} is outside [{low}, {high}]"
        return None

    def flat_inputs(self, leaves: list[Any]) -> list[torch.Tensor]:
        """Tensors for the ONNX graph inputs, in ``input_names`` order."""
        tensors = [leaves[index] for index in self.tensor_indices]
        return [tensors[position] for position in self.input_positions]

    def outputs(self, tensors: list[torch.Tensor]) -> Any:
        """Eager's output structure rebuilt around the output tensors (flat order)."""
        iterator = iter(tensors)
        leaves = [next(iterator) if is_tensor else constant
                  for constant, is_tensor in zip(self.output_constants, self.output_is_tensor)]
        return tree_unflatten(self.output_spec, leaves)

    # ---- JSON
    def to_json(self) -> dict:
        """JSON-able form. Raises ConfigError for output constants or keys JSON cannot hold."""
        return {
            "input_spec": spec_to_json(self.input_spec),
            "num_leaves": self.num_leaves,
            "tensor_indices": self.tensor_indices,
            "input_dtypes": [_dtype_name(d) for d in self.input_dtypes],
            "input_low": self.input_low,
            "input_high": self.input_high,
            "constant_keys": {str(k): v for k, v in self.constant_keys.items()},
            "input_names": self.input_names,
            "input_positions": self.input_positions,
            "output_names": self.output_names,
            "output_dtypes": [_dtype_name(d) for d in self.output_dtypes],
            "outputs": outputs_to_json(self.output_spec, self.output_constants, self.output_is_tensor,
                                       self.output_dtypes),
            "accepted_shapes": None if self.accepted_shapes is None else sorted(
                [list(map(list, shapes)) for shapes in self.accepted_shapes]),
            "parameters": self.parameters,
        }

    @classmethod
    def from_json(cls, data: dict, graph=None) -> "OnnxCallIO":
        """Inverse of :meth:`to_json`; the graph's structures are used when they match (no imports then)."""
        input_spec = _spec_or_graph(data["input_spec"], getattr(graph, "input_spec", None))
        template = output_template_from_json(data["outputs"], getattr(graph, "output_spec", None))
        output_leaves, output_spec = tree_flatten(template)
        output_is_tensor = ["tensor" in slot for slot in data["outputs"]["slots"]]
        accepted = data.get("accepted_shapes")
        return cls(
            input_spec=input_spec, num_leaves=int(data["num_leaves"]), tensor_indices=list(data["tensor_indices"]),
            input_dtypes=[getattr(torch, name) for name in data["input_dtypes"]],
            input_low=[list(x) for x in data["input_low"]], input_high=[list(x) for x in data["input_high"]],
            constant_keys={int(k): v for k, v in data["constant_keys"].items()},
            input_names=list(data["input_names"]), input_positions=list(data["input_positions"]),
            output_names=list(data["output_names"]),
            output_dtypes=[getattr(torch, name) for name in data["output_dtypes"]], output_spec=output_spec,
            output_constants=[None if tensor else leaf for leaf, tensor in zip(output_leaves, output_is_tensor)],
            output_is_tensor=output_is_tensor,
            accepted_shapes=None if accepted is None else {tuple(tuple(s) for s in shapes) for shapes in accepted},
            parameters=data.get("parameters"))


def _spec_or_graph(data: dict, graph_spec: TreeSpec | None) -> TreeSpec:
    if graph_spec is not None:
        try:
            if spec_to_json(graph_spec) == data:
                return graph_spec
        except CheckpointError:
            pass
    return spec_from_json(data)


def forward_parameters(module: torch.nn.Module) -> list[list] | None:
    """``[name, kind name, has_default]`` for each parameter of ``module.forward`` (None without a signature)."""
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None
    return _parameters_of(signature)


def recorded_parameters(graph, module: torch.nn.Module | None) -> list[list] | None:
    """The parameters of the ``forward`` that ``graph``'s samples were recorded (so normalised) against.

    The exported module may be a wrapper with ``forward(*args, **kwargs)`` (the kernel selector's
    PlannedModule); its own signature would not normalise calls into the graph's input structure. Falls
    back to ``module.forward`` when the graph has no signature.
    """
    call_signature = getattr(graph, "signature", None)
    if call_signature is not None and call_signature.signature is not None:
        return _parameters_of(call_signature.signature)
    return forward_parameters(module) if module is not None else None


def _parameters_of(signature: inspect.Signature) -> list[list]:
    return [[p.name, p.kind.name, p.default is not inspect.Parameter.empty] for p in signature.parameters.values()]


_HAS_DEFAULT = object()  # stands in for a default value: canonical calls never fill defaults in


def _signature_from_parameters(parameters: list[list]):
    from aitune.torch.samples import CallSignature

    def forward(*args, **kwargs):  # pragma: no cover - only its __signature__ is used
        raise NotImplementedError

    forward.__signature__ = inspect.Signature([
        inspect.Parameter(name, getattr(inspect.Parameter, kind), default=_HAS_DEFAULT if has_default
                          else inspect.Parameter.empty) for name, kind, has_default in parameters])
    return CallSignature(forward)
