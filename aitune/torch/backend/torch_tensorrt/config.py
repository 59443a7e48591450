"""The configs of the Torch-TensorRT backends: :class:`TorchTensorRTConfig` (the compile settings as plain data,
checked against the installed ``CompilationSettings`` at build time) and the JIT and AOT backend configs."""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any, ClassVar

import torch

from aitune.errors import ConfigError
from aitune.torch.backend.base import BackendConfig, parse_dtype
from aitune.torch.common.requirements import validate_flags
from aitune.torch.backend.tensorrt.config import describe_nested

logger = logging.getLogger(__name__)


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
