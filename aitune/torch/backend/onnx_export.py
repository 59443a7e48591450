"""Export one graph of a module to ONNX (shared by the ONNX Runtime and TensorRT backends).

:func:`export_onnx` exports a :class:`~aitune.torch.backend.flat.FlatModule` (flat tensor inputs, flat
tensor outputs, names from :class:`~aitune.torch.backend.flat.FlatIO`) so nested inputs, keyword-only
parameters and structured outputs never reach the exporter (:mod:`aitune.torch.backend.flat`). The graph's
dynamic and batch axes are exported as dynamic; afterwards the ONNX graph inputs are checked for symbolic dims
on every such axis (pytorch/pytorch#99613, :mod:`aitune.torch.backend.onnx_graph`) and the result says whether
the export came out shape-specialized. When the dynamo exporter fails, the TorchScript exporter runs instead
(a note says so) and a trace that baked a data-dependent branch is refused. Calling the exported graph:
:mod:`aitune.torch.backend.onnx_call_io`.

Optional packages (``onnx``, ``onnxscript`` through ``torch.onnx``) are imported inside functions only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import linecache
import logging
import math
import re
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

from aitune.errors import ConfigError
from aitune.torch.backend.flat import FlatIO
from aitune.torch.backend.onnx_graph import external_data_files, match_io, specialized_axes
from aitune.torch.record.pytree import tree_flatten, tree_unflatten
from aitune.torch.record.samples import BATCH, STATIC

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
            inputs; the graph then only runs the exact shapes it was exported with.
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
                opset_version: int | None = None, device: torch.device | str,
                shape_only_branches: frozenset[tuple[str, str]] = frozenset()) -> OnnxExport:
    """Export one graph of ``module`` to an ONNX file with flat, named tensor inputs and outputs.

    The dynamo exporter (``torch.onnx.export(dynamo=True)``, which runs ``torch.export``) gets
    ``Dim.DYNAMIC`` for every dynamic/batch axis of ``graph.tensor_specs``; it exports at a sample whose
    dynamic axes are all >= 2, repeating a recorded sample along such axes when every sample has size 1
    there (``torch.export`` specialises sizes 0 and 1, pytorch/pytorch#133653). If it fails, the TorchScript exporter
    runs with ``dynamic_axes`` and a note records the fallback. The file is checked with
    ``onnx.checker`` (by path, so models over 2 GiB work) and its graph inputs are checked for symbolic
    dims on every dynamic axis (a fixed size there runs only the export shapes).

    NOTE [Dim.DYNAMIC, not Dim.AUTO or named Dims]: measured with torch 2.13 on a module that calls
    ``int(x.shape[0])``: ``Dim.AUTO`` kept symbolic graph inputs but baked the sizes into ``Reshape``
    constants (a silently static graph), named ``Dim(min, max)`` silently produced fixed-size inputs, and
    ``Dim.DYNAMIC`` gave a graph that ran correctly at other batch and sequence sizes.

    Args:
        module: the user's module, in eval mode; not modified (parameters, buffers, training flags).
        graph: a :class:`~aitune.torch.record.samples.GraphSpec` with at least one recorded sample.
        path: the ``.onnx`` file to write (its folder is created); external data goes beside it, and the
            exporters' output, warnings and tracebacks go to ``<stem>_export.log`` beside it.
        use_dynamo: try the dynamo exporter first (True) or use only the TorchScript exporter (False).
        opset_version: ONNX opset; None lets the exporter choose.
        device: device the module and the export sample live on.
        shape_only_branches: ``(file path suffix, stripped source line)`` of ``if`` statements the TorchScript trace
            may bake because the caller knows they compare sizes that are equal in every valid call (NOTE [baked
            branches]); noted instead of refused.

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
                _check_trace_warnings(log, notes, shape_only_branches)
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
    input_names, input_indices, output_names = match_io(model, flat_io, notes)
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
    ``torch.export`` does not specialise them (sizes 0 and 1 are special to it, pytorch/pytorch#133653). A size the
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
        log.extend(f"warning: {warning.category.__name__}: {warning.message} (at {warning.filename}:{warning.lineno})"
                   for warning in caught)


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


def _check_trace_warnings(log: list[str], notes: list[str],
                          shape_only_branches: frozenset[tuple[str, str]] = frozenset()) -> None:
    """Refuse a TorchScript trace that baked a branch; note other tracer warnings.

    NOTE [baked branches]: the tracer records one path through ``if tensor:`` (tensor values or traced
    sizes, e.g. ``if x.shape[0] == 4``). The graph then runs at every shape and silently gives the traced
    branch's result for inputs that would take the other one, which no shape check catches (measured with
    torch 2.13). Conversions to Python numbers are only noted: when they turn sizes into constants, the
    backend's run at the other recorded shapes fails and restricts the graph. A branch at one of
    ``shape_only_branches`` (its file and source line, read back from the warning's location) is only noted.
    """
    tracer = [line for line in log if "TracerWarning" in line]
    baked = [line for line in tracer if "Python boolean" in line]
    allowed = [line for line in baked if _branch_at(line) in shape_only_branches]
    if allowed:
        notes.append(f"the TorchScript trace baked {len(allowed)} branch(es) on sizes equal in every valid call "
                     f"({', '.join(sorted({_branch_at(line)[0] for line in allowed}))})")
        tracer = [line for line in tracer if line not in allowed]
    if any("Python boolean" in line for line in tracer):
        raise RuntimeError("the TorchScript trace baked a data-dependent branch (TracerWarning: converting a "
                           "tensor to a Python boolean); its ONNX graph would be wrong for inputs that take the "
                           "other branch")
    if tracer:
        notes.append(f"the TorchScript tracer warned {len(tracer)} time(s) that the trace might not generalise "
                     "to other inputs; see the export log")


def _branch_at(line: str) -> tuple[str, str] | None:
    """``(path suffix, stripped source line)`` of a logged warning's ``(at FILE:LINE)`` location: the suffix is the
    path from its ``site-packages``/``dist-packages`` folder on (the whole path elsewhere)."""
    match = re.search(r"\(at (.+):(\d+)\)$", line)
    if match is None:
        return None
    filename = match.group(1)
    suffix = re.split(r"[/\\](?:site|dist)-packages[/\\]", filename)[-1].replace("\\", "/")
    return suffix, linecache.getline(filename, int(match.group(2))).strip()


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
