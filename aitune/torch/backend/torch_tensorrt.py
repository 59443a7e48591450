"""Torch-TensorRT backends: JIT (``torch.compile(backend="torch_tensorrt")``) and AOT (export -> compile -> save).

:class:`TorchTensorRTConfig` mirrors the commonly used fields of ``torch_tensorrt.dynamo.CompilationSettings``
as plain data, so it is built, validated and serialised without ``torch_tensorrt`` installed; at build time
it is turned into keyword arguments checked against the installed version's ``CompilationSettings``.

API facts used (Torch-TensorRT docs): ``torch.compile(module, backend="torch_tensorrt", options=...)``;
``torch_tensorrt.Input(min_shape=, opt_shape=, max_shape=, dtype=, name=)``;
``torch_tensorrt.dynamo.compile(exported_program, arg_inputs=[Input...], **settings)``;
``torch_tensorrt.save(module, path, output_format="exported_program", arg_inputs=..., retrace=...,
pickle_protocol=...)``; ``torch_tensorrt.load(path)`` -> ``ExportedProgram``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import shutil
from pathlib import Path
from typing import Any, ClassVar

import torch

from aitune.errors import CheckpointError, ConfigError
from aitune.torch.backend.accepted import AcceptedInput, AcceptedInputs
from aitune.torch.backend.base import (
    Backend,
    BackendConfig,
    BuildMode,
    Check,
    Requirement,
    parse_dtype,
)
from aitune.torch.common.requirements import validate_flags
from aitune.torch.backend.eager import AutocastMixin
from aitune.torch.backend.flat import FlatIO, eager_output
from aitune.torch.common.dtypes import dtype_from_name, dtype_name
from aitune.torch.common.files import checkpoint_path
from aitune.torch.record.samples import BATCH
from aitune.torch.backend.isolation import run_isolated
from aitune.torch.backend.onnx_export import export_example
from aitune.torch.backend.tensorrt.backend import StoredGraph, StoredTensorSpec
from aitune.torch.backend.tensorrt.config import describe_nested
from aitune.torch.record.serialization import output_template_from_json, outputs_to_json

logger = logging.getLogger(__name__)

TORCH_TENSORRT_REQUIREMENT = Requirement("torch_tensorrt", ("torch-tensorrt", "torch_tensorrt"), "torch-tensorrt",
                                         "2.8")
ARTIFACT_FILE = "exported_model.pt"

#: Kernel precisions Torch-TensorRT accepts in ``enabled_precisions`` (its SUPPORTED_KERNEL_PRECISIONS).
SUPPORTED_PRECISIONS = (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(kw_only=True)
class TorchTensorRTConfig(BackendConfig):
    """Torch-TensorRT compilation settings (``torch_tensorrt.dynamo.CompilationSettings``, common fields).

    None means "Torch-TensorRT's own default". Defaults follow the reference's fallback config: no fp16
    by default (the engine follows the model's dtypes, ``use_explicit_typing=True``); for fp16 kernels on
    an fp32 model set ``enabled_precisions={torch.float16}`` and ``use_explicit_typing=False`` (weak
    typing, deprecated by TensorRT since 10.12).

    Args:
        enabled_precisions: kernel precisions TensorRT may use (subset of fp32, fp16, bf16, int8, fp8 e4m3).
        use_explicit_typing: layer precisions follow the graph's dtypes (strongly typed network). None (the
            default) resolves to True, or to False when ``enabled_precisions`` names more than float32 — the
            weak-typing request of scripts written as ``TorchTensorRTConfig(enabled_precisions={torch.float16})``
            (logged as deprecated by TensorRT since 10.12).
        workspace_size: TensorRT workspace limit, bytes (0 = TensorRT default).
        min_block_size: fewest consecutive convertible ops that form a TensorRT engine (Torch-TensorRT: 5).
        optimization_level: builder optimization level 0-5 (None = TensorRT default 3).
        truncate_double: run float64 ops as float32.
        require_full_compilation: fail instead of leaving unsupported ops to PyTorch.
        torch_executed_ops: ops forced to run in PyTorch, by name (e.g. ``"torch.ops.aten.add.Tensor"``).
        pass_through_build_failures: raise engine build errors instead of falling back to PyTorch.
        max_aux_streams: auxiliary CUDA streams TensorRT may use per engine (None = its heuristic).
        version_compatible / hardware_compatible: build engines that load on newer TensorRT / other GPUs.
        sparse_weights: allow structured-sparsity kernels.
        immutable_weights: non-refittable engines (faster to build and run).
        use_python_runtime: Python (True) or C++ (False) runtime; None = Torch-TensorRT's choice.
        use_fp32_acc: fp32 accumulation for matmuls in fp16 graphs.
        disable_tf32: no TF32 for fp32 matmuls/convolutions.
        cache_built_engines / reuse_cached_engines: Torch-TensorRT's on-disk engine cache.
        timing_cache_path: TensorRT tactic timing cache file (None = Torch-TensorRT's default location).
        extra_settings: any other ``CompilationSettings`` field by name (JSON-able values).

    Raises:
        ConfigError: on a wrong type or value, an unsupported precision, or enabled_precisions beyond fp32
            together with an explicit ``use_explicit_typing=True``.
    """

    enabled_precisions: set | list | tuple | None = None
    use_explicit_typing: bool | None = None
    workspace_size: int = 0
    min_block_size: int = 5
    optimization_level: int | None = None
    truncate_double: bool = False
    require_full_compilation: bool = False
    torch_executed_ops: list[str] = dataclasses.field(default_factory=list)
    pass_through_build_failures: bool = False
    max_aux_streams: int | None = None
    version_compatible: bool = False
    hardware_compatible: bool = False
    sparse_weights: bool = False
    immutable_weights: bool = True
    use_python_runtime: bool | None = None
    use_fp32_acc: bool = False
    disable_tf32: bool = False
    cache_built_engines: bool = False
    reuse_cached_engines: bool = False
    timing_cache_path: str | None = None
    extra_settings: dict = dataclasses.field(default_factory=dict)

    _BOOLS: ClassVar[tuple[str, ...]] = (
        "use_explicit_typing", "truncate_double", "require_full_compilation", "pass_through_build_failures",
        "version_compatible", "hardware_compatible", "sparse_weights", "immutable_weights", "use_fp32_acc",
        "disable_tf32", "cache_built_engines", "reuse_cached_engines")

    def validate(self) -> None:
        if self.use_explicit_typing is None:
            beyond_fp32 = self.enabled_precisions is not None and any(
                parse_dtype(value, "enabled_precisions") != torch.float32 for value in (
                    [self.enabled_precisions] if isinstance(self.enabled_precisions, (str, torch.dtype))
                    else self.enabled_precisions))
            self.use_explicit_typing = not beyond_fp32
            if beyond_fp32:
                logger.warning("TorchTensorRTConfig: enabled_precisions %s without use_explicit_typing: weak typing "
                               "(use_explicit_typing=False) is used, deprecated by TensorRT since 10.12; cast the "
                               "model to the precision instead", sorted(map(str, self.enabled_precisions)))
        for name in self._BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"TorchTensorRTConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.use_python_runtime is not None and not isinstance(self.use_python_runtime, bool):
            raise ConfigError(f"use_python_runtime must be True, False or None, got {self.use_python_runtime!r}")
        if self.enabled_precisions is not None:
            if isinstance(self.enabled_precisions, (str, torch.dtype)):
                self.enabled_precisions = [self.enabled_precisions]
            if not isinstance(self.enabled_precisions, (set, frozenset, list, tuple)) or not self.enabled_precisions:
                raise ConfigError("enabled_precisions must be a non-empty set of torch dtypes or None, got "
                                  f"{self.enabled_precisions!r}")
            precisions = {parse_dtype(value, "enabled_precisions") for value in self.enabled_precisions}
            unsupported = [str(p) for p in precisions if p not in SUPPORTED_PRECISIONS]
            if unsupported:
                raise ConfigError(f"enabled_precisions {unsupported} are not TensorRT kernel precisions; use "
                                  f"{[str(p) for p in SUPPORTED_PRECISIONS]}")
            self.enabled_precisions = precisions
            if self.use_explicit_typing and precisions - {torch.float32}:
                raise ConfigError("enabled_precisions beyond float32 need use_explicit_typing=False (weak typing); "
                                  "with explicit typing the engine follows the model's dtypes: cast the model "
                                  "instead, or set use_explicit_typing=False")
        if not _is_int(self.workspace_size) or self.workspace_size < 0:
            raise ConfigError(f"workspace_size must be an int >= 0 (bytes), got {self.workspace_size!r}")
        if not _is_int(self.min_block_size) or self.min_block_size < 1:
            raise ConfigError(f"min_block_size must be an int >= 1, got {self.min_block_size!r}")
        if self.optimization_level is not None and (not _is_int(self.optimization_level)
                                                    or not 0 <= self.optimization_level <= 5):
            raise ConfigError(f"optimization_level must be an int in 0..5 or None, got {self.optimization_level!r}")
        if self.max_aux_streams is not None and (not _is_int(self.max_aux_streams) or self.max_aux_streams < 0):
            raise ConfigError(f"max_aux_streams must be an int >= 0 or None, got {self.max_aux_streams!r}")
        if isinstance(self.torch_executed_ops, (set, frozenset, tuple)):
            self.torch_executed_ops = sorted(self.torch_executed_ops)
        ops = self.torch_executed_ops
        if not isinstance(ops, list) or not all(isinstance(op, str) for op in ops):
            raise ConfigError("torch_executed_ops must be a list of op names (str), e.g. ['torch.ops.aten.add.Tensor']")
        if self.timing_cache_path is not None and not isinstance(self.timing_cache_path, (str, Path)):
            raise ConfigError(f"timing_cache_path must be a path or None, got {self.timing_cache_path!r}")
        if self.timing_cache_path is not None:
            self.timing_cache_path = str(self.timing_cache_path)
        if not isinstance(self.extra_settings, dict) or not all(isinstance(k, str) for k in self.extra_settings):
            raise ConfigError("extra_settings must be a dict of CompilationSettings field names to values")
        own = {field.name for field in dataclasses.fields(self)}
        clash = sorted(own & set(self.extra_settings))
        if clash:
            raise ConfigError(f"extra_settings repeats fields of TorchTensorRTConfig: {clash}; set them directly")

    def settings(self, accepted: set[str] | None = None) -> dict[str, Any]:
        """Keyword arguments for ``torch_tensorrt.dynamo.compile`` / ``torch.compile(options=...)``.

        Fields left at None are omitted (Torch-TensorRT's default applies). With ``accepted`` (the field
        names of the installed ``CompilationSettings``), a field this version lacks is dropped when it is
        at its default and refused otherwise.

        Raises:
            ConfigError: a non-default field or an ``extra_settings`` key the installed version lacks.
        """
        defaults = type(self)()
        result: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            if field.name == "extra_settings":
                continue
            value = getattr(self, field.name)
            if value is None:
                continue
            if field.name == "torch_executed_ops":
                value = set(value)
            if accepted is not None and field.name not in accepted:
                if getattr(defaults, field.name) == getattr(self, field.name):
                    continue
                raise ConfigError(f"TorchTensorRTConfig.{field.name}={getattr(self, field.name)!r} is not a setting of "
                                  "the installed torch_tensorrt; leave it at its default or upgrade torch-tensorrt")
            result[field.name] = set(value) if isinstance(value, (set, frozenset)) else value
        for key, value in self.extra_settings.items():
            if accepted is not None and key not in accepted:
                raise ConfigError(f"extra_settings[{key!r}] is not a CompilationSettings field of the installed "
                                  "torch_tensorrt")
            result[key] = value
        return result


def accepted_settings() -> set[str]:
    """Field names of the installed ``torch_tensorrt.dynamo.CompilationSettings``."""
    from torch_tensorrt.dynamo import CompilationSettings

    return {field.name for field in dataclasses.fields(CompilationSettings)}


class _NestedDescribe:
    def describe(self) -> str:
        return describe_nested(self)


def _compile_config(value: Any) -> TorchTensorRTConfig:
    if isinstance(value, TorchTensorRTConfig):
        return value
    if isinstance(value, dict):
        restored = BackendConfig.from_dict(value) if "type" in value else TorchTensorRTConfig(**value)
        if isinstance(restored, TorchTensorRTConfig):
            return restored
    raise ConfigError(f"compile_config must be a TorchTensorRTConfig, got {type(value).__name__}")


@dataclasses.dataclass(kw_only=True)
class TorchTensorRTJitBackendConfig(_NestedDescribe, BackendConfig):
    """Config of :class:`TorchTensorRTJitBackend`.

    Args:
        compile_config: Torch-TensorRT settings (:class:`TorchTensorRTConfig`).
        fullgraph / dynamic: as in ``torch.compile``; ``dynamic=None`` becomes True when the graph has
            dynamic axes.
        autocast_enabled / autocast_dtype: run under ``torch.autocast`` (outputs cast back to eager's dtypes).
    """

    compile_config: TorchTensorRTConfig = dataclasses.field(default_factory=TorchTensorRTConfig)
    fullgraph: bool = False
    dynamic: bool | None = None
    autocast_enabled: bool = False
    autocast_dtype: torch.dtype | str | None = None

    def validate(self) -> None:
        self.compile_config = _compile_config(self.compile_config)
        validate_flags(self, ("fullgraph", "autocast_enabled"))
        self.autocast_dtype = parse_dtype(self.autocast_dtype, "autocast_dtype")


@dataclasses.dataclass(kw_only=True)
class TorchTensorRTAotBackendConfig(_NestedDescribe, BackendConfig):
    """Config of :class:`TorchTensorRTAotBackend`.

    Args:
        compile_config: Torch-TensorRT settings (:class:`TorchTensorRTConfig`).
        pickle_protocol: protocol ``torch_tensorrt.save`` writes the artifact with (2-5).
        build_timeout_s: wall-clock limit of the compile child process, seconds.
    """

    compile_config: TorchTensorRTConfig = dataclasses.field(default_factory=TorchTensorRTConfig)
    pickle_protocol: int = 5
    build_timeout_s: float = 3600.0

    def validate(self) -> None:
        self.compile_config = _compile_config(self.compile_config)
        if not _is_int(self.pickle_protocol) or not 2 <= self.pickle_protocol <= 5:
            raise ConfigError(f"pickle_protocol must be an int in 2..5, got {self.pickle_protocol!r}")
        if isinstance(self.build_timeout_s, bool) or not isinstance(self.build_timeout_s, (int, float)) \
                or not math.isfinite(self.build_timeout_s) or self.build_timeout_s <= 0:
            raise ConfigError(f"build_timeout_s must be a number of seconds > 0, got {self.build_timeout_s!r}")


# --------------------------------------------------------------------------------------------- JIT


class TorchTensorRTJitBackend(AutocastMixin, Backend):
    """``torch.compile(module, backend="torch_tensorrt", options=<TorchTensorRTConfig>)``, warmed up at build.

    Wraps: Torch-TensorRT's dynamo backend (TensorRT engines for the convertible subgraphs, PyTorch for the
    rest). Extra: ``pip install 'aitune[torch-tensorrt]'`` (torch-tensorrt matching the torch version).
    Devices: CUDA only. JIT: nothing compiled is persisted; checkpoints keep weights and samples and
    recompile on load. Known limitations: shapes outside the recorded range recompile; graph breaks split
    the model into several engines.
    """

    name = "torch_tensorrt_jit"
    config_class = TorchTensorRTJitBackendConfig
    build_mode = BuildMode.JIT
    requirements = (TORCH_TENSORRT_REQUIREMENT,)
    device_types = frozenset({"cuda"})
    rank = 45

    @property
    def bakes_weights(self) -> bool:
        """TensorRT engines hold the weights as they were at the build."""
        return True

    def _resolved_dynamic(self, graph) -> bool | None:
        if self.config.dynamic is not None:
            return self.config.dynamic
        return True if graph is not None and graph.is_dynamic else None

    def _build(self, module, graph, device, workdir: Path) -> None:
        import torch_tensorrt  # noqa: F401 - registers the "torch_tensorrt" torch.compile backend

        options = self.config.compile_config.settings(accepted_settings())
        options["device"] = device
        dynamic = self._resolved_dynamic(graph)
        self.build_info["dynamic"] = dynamic
        self._probe_output_dtypes(module, graph)
        self._compiled = torch.compile(module, backend="torch_tensorrt", options=options,
                                       fullgraph=self.config.fullgraph, dynamic=dynamic)
        for sample in graph.samples:  # warm-up: build the engines for every recorded shape now
            sample = sample.clone()
            self._infer(sample.args, sample.kwargs)

    def _infer(self, args, kwargs):
        with torch.no_grad(), self._autocast():
            output = self._compiled(*args, **kwargs)
        return self._restore_output_dtypes(output)

    def _load(self, directory, metadata, module, graph, device) -> None:
        if module is None:
            raise CheckpointError("the torch_tensorrt_jit backend recompiles on load and needs the original module")
        self._build(module, graph, device, directory)


# --------------------------------------------------------------------------------------------- AOT


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


def _settings_to_json(settings: dict) -> dict:
    encoded = dict(settings)
    if "enabled_precisions" in encoded:
        encoded["enabled_precisions"] = sorted(dtype_name(p) for p in encoded["enabled_precisions"])
    if "torch_executed_ops" in encoded:
        encoded["torch_executed_ops"] = sorted(encoded["torch_executed_ops"])
    return encoded


def _settings_from_json(encoded: dict) -> dict:
    settings = dict(encoded)
    if "enabled_precisions" in settings:
        settings["enabled_precisions"] = {dtype_from_name(name) for name in settings["enabled_precisions"]}
    if "torch_executed_ops" in settings:
        settings["torch_executed_ops"] = set(settings["torch_executed_ops"])
    return settings


def compile_exported_program(*, exported_path: str, output_path: str, inputs: list[dict], settings: dict,
                             pickle_protocol: int, check_inputs_path: str, device_index: int = 0) -> dict:
    """Isolated step: load an ExportedProgram, compile it with Torch-TensorRT, save it, load it, run it once.

    Args:
        exported_path: ``torch.export.save``d program. output_path: the Torch-TensorRT artifact to write.
        inputs: ``[{"name", "min", "opt", "max", "dtype"}]`` per flat input.
        settings: JSON form of :meth:`TorchTensorRTConfig.settings`.
        pickle_protocol: passed to ``torch_tensorrt.save``.
        check_inputs_path: ``torch.save``d flat inputs (loaded with ``weights_only=True``) for the check run.
        device_index: CUDA device.

    Returns:
        ``{"output_path", "check_output_shapes"}``.
    """
    import torch_tensorrt

    torch.cuda.set_device(device_index)
    device = torch.device("cuda", device_index)
    exported = torch.export.load(exported_path)
    trt_inputs = [torch_tensorrt.Input(min_shape=tuple(entry["min"]), opt_shape=tuple(entry["opt"]),
                                       max_shape=tuple(entry["max"]), dtype=dtype_from_name(entry["dtype"]),
                                       name=entry["name"]) for entry in inputs]
    options = _settings_from_json(settings)
    options["device"] = device
    compiled = torch_tensorrt.dynamo.compile(exported, arg_inputs=trt_inputs, **options)
    check_inputs = [tensor.to(device) for tensor in torch.load(check_inputs_path, weights_only=True)]
    torch_tensorrt.save(compiled, output_path, output_format="exported_program", arg_inputs=check_inputs,
                        retrace=False, pickle_protocol=pickle_protocol)
    loaded = torch_tensorrt.load(output_path).module()
    with torch.no_grad():
        outputs = loaded(*check_inputs)
    torch.cuda.synchronize(device)
    outputs = outputs if isinstance(outputs, (tuple, list)) else [outputs]
    return {"output_path": output_path, "check_output_shapes": [list(output.shape) for output in outputs]}


class TorchTensorRTAotBackend(Backend):
    """``torch.export`` (explicit Dims) -> ``torch_tensorrt.dynamo.compile`` -> ``torch_tensorrt.save`` artifact.

    Wraps: Torch-TensorRT's AOT path. Extra: ``pip install 'aitune[torch-tensorrt]'``. Devices: CUDA only.
    The export runs in this process (it is plain ``torch.export``); compile, save and one load+run of the
    artifact run in a child process with ``build_timeout_s`` (:mod:`aitune.torch.backend.isolation`), logging to
    ``<workdir>/torch_tensorrt_compile.log``. Checkpoints hold ``exported_model.pt`` and the output
    structure; loading needs neither the module nor its weights. Calls outside the recorded/declared shape
    range are refused by :meth:`accepts` (the Module runs eager).

    Known limitations: data-dependent control flow fails the export; in-place input mutations are not
    reproduced; kernel-selector replacements do not carry into this path (reference G.1).
    """

    name = "torch_tensorrt_aot"
    config_class = TorchTensorRTAotBackendConfig
    build_mode = BuildMode.AOT
    requirements = (TORCH_TENSORRT_REQUIREMENT,)
    device_types = frozenset({"cuda"})
    rank = 42
    compile_step: ClassVar[str] = f"{__name__}:compile_exported_program"

    def __init__(self, config: TorchTensorRTAotBackendConfig | None = None):
        super().__init__(config)
        self._compiled = None
        self._io: FlatIO | None = None
        self._inputs: list[dict] = []
        self._leaf_indices: list[int] = []
        self._accepted: AcceptedInputs | None = None  # built from _inputs on first use
        self._artifact: Path | None = None

    def _supports(self, module, graph, device) -> Check:
        if graph is None or not graph.tensor_specs:
            return Check(False, "the graph has no tensor input")
        return Check(True)

    def _build(self, module, graph, device, workdir: Path) -> None:
        settings = self.config.compile_config.settings(accepted_settings())
        exported, flat_io, example, inputs = export_flat_module(module, graph, device)
        exported_path = workdir / "exported_program.pt2"
        torch.export.save(exported, str(exported_path))
        check_path = workdir / "check_inputs.pt"
        torch.save([t.detach().cpu().contiguous() for t in flat_io.sample_inputs(graph.samples[0])], check_path)
        artifact = workdir / ARTIFACT_FILE
        result = run_isolated(self.compile_step, {
            "exported_path": str(exported_path), "output_path": str(artifact), "inputs": inputs,
            "settings": _settings_to_json(settings), "pickle_protocol": self.config.pickle_protocol,
            "check_inputs_path": str(check_path),
            "device_index": device.index if device.index is not None else torch.cuda.current_device()},
            timeout_s=self.config.build_timeout_s, log_path=workdir / "torch_tensorrt_compile.log")
        self.build_info["check_output_shapes"] = result.get("check_output_shapes")
        self._io = flat_io
        self._inputs = inputs
        self._leaf_indices = list(flat_io.tensor_indices)
        self._artifact = artifact
        self._load_artifact()

    def _load_artifact(self) -> None:
        import torch_tensorrt

        self._compiled = torch_tensorrt.load(str(self._artifact)).module()

    def rejects(self, leaves: list) -> str | None:
        """Why the compiled artifact cannot take the call (dtype, CUDA device, rank, or a size outside the range
        it was compiled for); the Module then runs eager with this reason."""
        if self._accepted is None:
            self._accepted = AcceptedInputs(
                [AcceptedInput.from_json(dict(entry, leaf_index=index, path=entry.get("name", "")))
                 for entry, index in zip(self._inputs, self._leaf_indices)], device_type="cuda")
        return self._accepted.rejects(leaves)

    def _infer(self, args, kwargs):
        tensors = [t.to(self.device).contiguous() for t in self._io.inputs(args, kwargs)]
        with torch.no_grad():
            outputs = self._compiled(*tensors)
        outputs = outputs if isinstance(outputs, (tuple, list)) else [outputs]
        return self._io.outputs(list(outputs))

    def _activate(self) -> None:
        if self._compiled is None:
            self._load_artifact()

    def _deactivate(self) -> None:
        self._compiled = None

    def _save(self, directory: Path) -> dict:
        target = directory / ARTIFACT_FILE
        if self._artifact.resolve() != target.resolve():
            shutil.copyfile(self._artifact, target)
        return {
            "artifact": ARTIFACT_FILE,
            "inputs": [dict(entry, leaf_index=index) for entry, index in zip(self._inputs, self._leaf_indices)],
            "outputs": outputs_to_json(self._io.output_spec, self._io.output_constants, self._io.output_is_tensor,
                                       self._io.output_dtypes),
        }

    def _load(self, directory: Path, metadata: dict, module, graph, device: torch.device) -> None:
        name = metadata.get("artifact", ARTIFACT_FILE)
        artifact = checkpoint_path(directory, name, f"{self.name} metadata 'artifact'", missing=CheckpointError(
            f"{self.name}: {Path(directory) / str(name)} is missing from the checkpoint"))
        self._inputs = [{key: value for key, value in entry.items() if key != "leaf_index"}
                        for entry in metadata["inputs"]]
        self._leaf_indices = [int(entry["leaf_index"]) for entry in metadata["inputs"]]
        template = output_template_from_json(metadata["outputs"], getattr(graph, "output_spec", None))
        io_graph = StoredGraph([StoredTensorSpec(entry["name"], index, entry["name"])
                                 for entry, index in zip(self._inputs, self._leaf_indices)])
        self._io = FlatIO(io_graph, template)
        self._artifact = artifact
        self._load_artifact()
