"""Configs of the TensorRT backend: :class:`TensorRTBackendConfig`, optimization profiles, quantization.

Everything here is plain data (no TensorRT import): configs are built, validated, serialised and
compared on machines without TensorRT. Field names and defaults follow the reference AITune interface
(``reference/aitune_reference.md`` A.6).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from pathlib import Path
from typing import Any, Sequence

import torch

from aitune.errors import ConfigError
from aitune.torch.backend.base import BackendConfig
from aitune.torch.record.pytree import path_to_str

#: Builder optimization levels TensorRT accepts (``IBuilderConfig.builder_optimization_level``; TRT default 3).
OPTIMIZATION_LEVELS = range(0, 6)

#: ``trt.HardwareCompatibilityLevel`` members by value (TensorRT API: kNONE=0, kAMPERE_PLUS=1,
#: kSAME_COMPUTE_CAPABILITY=2).
COMPATIBILITY_LEVELS = {0: "NONE", 1: "AMPERE_PLUS", 2: "SAME_COMPUTE_CAPABILITY"}


class ProfileMode(str, enum.Enum):
    """How optimization profiles are derived from the recorded samples.

    SINGLE: one profile spanning the recorded (or declared) min and max shapes, optimised for the max.
    SAMPLES_USED: one static profile (min = opt = max) per distinct recorded input shape.
    """

    SINGLE = "single"
    SAMPLES_USED = "samples_used"


def _shape(value: Any, what: str) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ConfigError(f"{what} must be a sequence of ints (a shape), got {value!r}")
    shape = []
    for size in value:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ConfigError(f"{what} must hold ints >= 0, got {value!r}")
        shape.append(int(size))
    return tuple(shape)


def profile_path(path: str | Sequence) -> str:
    """Canonical input path of a profile entry: ``"x"``, ``("inputs", "tokens")`` -> ``"inputs.tokens"``.

    Raises:
        ConfigError: if ``path`` is empty or neither a string nor a tuple/list of keys.
    """
    if isinstance(path, str):
        if not path:
            raise ConfigError("a TensorRTProfile input path must not be empty")
        return path
    if isinstance(path, (tuple, list)) and path and all(isinstance(key, (str, int)) for key in path):
        return path_to_str(tuple(path))
    raise ConfigError(f"a TensorRTProfile input path is a parameter name ('x') or a tuple of keys "
                      f"(('inputs', 'tokens')), got {path!r}")


class TensorRTProfile:
    """One TensorRT optimization profile: a (min, opt, max) shape per tensor input.

    Input paths are the forward parameter name (``"x"``), a nested path as a tuple
    (``("inputs", "tokens")``, stored as ``"inputs.tokens"``) or the engine input name (``"input_x"``).
    They are checked against the graph's real tensor inputs when the backend builds.

    Example::

        profile = TensorRTProfile().add_input_shape("x", (1, 3, 224, 224), (8, 3, 224, 224), (16, 3, 224, 224))
    """

    def __init__(self, shapes: dict | None = None):
        self.shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {}
        for path, (low, opt, high) in (shapes or {}).items():
            self.add_input_shape(path, low, opt, high)

    def add_input_shape(self, path: str | Sequence, min_shape: Sequence[int], opt_shape: Sequence[int],
                        max_shape: Sequence[int]) -> "TensorRTProfile":
        """Set the shape range of one input; returns ``self`` so calls chain.

        Raises:
            ConfigError: on an empty path, shapes of different ranks, negative sizes, or an axis where
                ``min <= opt <= max`` does not hold.
        """
        key = profile_path(path)
        low = _shape(min_shape, f"min_shape of {key!r}")
        opt = _shape(opt_shape, f"opt_shape of {key!r}")
        high = _shape(max_shape, f"max_shape of {key!r}")
        if not len(low) == len(opt) == len(high):
            raise ConfigError(f"profile shapes of {key!r} have different ranks: min {low}, opt {opt}, max {high}")
        for axis, (a, b, c) in enumerate(zip(low, opt, high)):
            if not a <= b <= c:
                raise ConfigError(f"profile of {key!r} axis {axis}: need min <= opt <= max, got {a}, {b}, {c}")
        self.shapes[key] = (low, opt, high)
        return self

    def to_dict(self) -> dict[str, list[list[int]]]:
        """``{input path: [min, opt, max]}`` (JSON-able)."""
        return {path: [list(low), list(opt), list(high)] for path, (low, opt, high) in self.shapes.items()}

    profile_to_dict = to_dict

    @classmethod
    def from_dict(cls, data: dict) -> "TensorRTProfile":
        """Inverse of :meth:`to_dict`. Raises ConfigError on a malformed entry."""
        if not isinstance(data, dict):
            raise ConfigError(f"a TensorRTProfile is stored as {{path: [min, opt, max]}}, got {data!r}")
        profile = cls()
        for path, value in data.items():
            if not isinstance(value, (list, tuple)) or len(value) != 3:
                raise ConfigError(f"profile entry {path!r} must be [min, opt, max], got {value!r}")
            profile.add_input_shape(path, *value)
        return profile

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorRTProfile) and self.shapes == other.shapes

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    def __repr__(self) -> str:
        inner = ", ".join(f"{path}: min={list(low)} opt={list(opt)} max={list(high)}"
                          for path, (low, opt, high) in self.shapes.items())
        return f"TensorRTProfile({inner})"


# --------------------------------------------------------------------------------------------- quantization


@dataclasses.dataclass(kw_only=True)
class ONNXAutoCastConfig(BackendConfig):
    """Mixed-precision conversion of the exported ONNX graph with ModelOpt's ONNX autocast.

    Runs ``modelopt.onnx.autocast.convert_to_mixed_precision`` on the exported model before the engine
    build; nodes whose recorded values would overflow the low-precision type stay in fp32 (ModelOpt
    classifies them by running the model on the recorded samples with ONNX Runtime on CPU).

    Args:
        precision: ``"fp16"`` or ``"bf16"``.
        keep_io_types: keep the graph's input/output dtypes (fp32 in, fp32 out).

    Raises:
        ConfigError: on an unknown precision or a non-bool ``keep_io_types``.
    """

    precision: str = "fp16"
    keep_io_types: bool = True

    def validate(self) -> None:
        if self.precision not in ("fp16", "bf16"):
            raise ConfigError(f"ONNXAutoCastConfig.precision must be 'fp16' or 'bf16', got {self.precision!r}")
        if not isinstance(self.keep_io_types, bool):
            raise ConfigError(f"ONNXAutoCastConfig.keep_io_types must be a bool, got {self.keep_io_types!r}")


#: Calibration methods ModelOpt's ONNX PTQ accepts per precision (``modelopt.onnx.quantization.quantize``).
ONNX_CALIBRATION_METHODS = {
    "int8": ("max", "entropy"),
    "fp8": ("max",),
    "int4": ("awq_clip", "awq_lite", "awq_full", "rtn_dq"),
}


@dataclasses.dataclass(kw_only=True)
class ONNXQuantizationConfig(BackendConfig):
    """Post-training quantization of the exported ONNX graph with ModelOpt (Q/DQ nodes for TensorRT).

    Calibration data: every recorded sample, concatenated per input along axis 0 (samples whose other
    axes differ from the largest group are left out).

    Args:
        precision: ``"int8"``, ``"fp8"`` (needs SM >= 8.9) or ``"int4"`` (weight-only).
        calibration_method: ``"max"``/``"entropy"`` (int8), ``"max"`` (fp8), ``"awq_clip"``/``"awq_lite"``/
            ``"awq_full"``/``"rtn_dq"`` (int4); None = ModelOpt's default for the precision.

    Raises:
        ConfigError: on an unknown precision or a calibration method the precision does not support.
    """

    precision: str
    calibration_method: str | None = None

    def validate(self) -> None:
        if self.precision not in ONNX_CALIBRATION_METHODS:
            raise ConfigError(f"ONNXQuantizationConfig.precision must be one of {sorted(ONNX_CALIBRATION_METHODS)}, "
                              f"got {self.precision!r}")
        methods = ONNX_CALIBRATION_METHODS[self.precision]
        if self.calibration_method is not None and self.calibration_method not in methods:
            raise ConfigError(f"calibration_method {self.calibration_method!r} does not apply to {self.precision}; "
                              f"use one of {list(methods)} or None")


def cuda_device_name(value, field: str) -> str:
    """``"cuda"`` / ``"cuda:1"`` / ``torch.device("cuda", 1)`` -> its string; anything else -> ConfigError."""
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"{field} must be a CUDA device such as 'cuda' or 'cuda:0', got {value!r}") from exc
    if device.type != "cuda":
        raise ConfigError(f"{field} must be a CUDA device (TensorRT runs on NVIDIA GPUs only), got {value!r}")
    return str(device)


#: ModelOpt PyTorch PTQ presets (attributes of ``modelopt.torch.quantization``).
TORCH_QUANTIZATION_PRESETS = ("FP8_DEFAULT_CFG", "INT8_DEFAULT_CFG", "INT8_SMOOTHQUANT_CFG", "INT4_AWQ_CFG",
                              "NVFP4_DEFAULT_CFG", "NVFP4_FP8_MHA_CONFIG")


@dataclasses.dataclass(kw_only=True)
class TorchQuantizationConfig(BackendConfig):
    """Post-training quantization in PyTorch with ModelOpt (``mtq.quantize``) before the ONNX export.

    The module is deep-copied (the user's module is never changed), calibrated on the recorded samples,
    then exported with its quantizers as Q/DQ nodes. Not supported yet: ``TensorRTBackend.supports``
    refuses it, because aitune's ONNX export fails on ModelOpt's quantizer modules (measured with ModelOpt
    0.47 and torch 2.13); the config is kept so checkpoints and configs of the reference interface load.

    Args:
        quantization_config: name of a ModelOpt preset, one of :data:`TORCH_QUANTIZATION_PRESETS`.
        calibration_samples: how many recorded samples calibrate (>= 1; default 1, as the reference).
        device: the CUDA device calibration runs on (``"cuda"``, ``"cuda:1"``; as in the reference).

    Raises:
        ConfigError: on an unknown preset, a calibration count < 1 or a device that is not CUDA.
    """

    quantization_config: str = "FP8_DEFAULT_CFG"
    calibration_samples: int = 1
    device: str = "cuda"

    def validate(self) -> None:
        self.device = cuda_device_name(self.device, "TorchQuantizationConfig.device")
        if self.quantization_config not in TORCH_QUANTIZATION_PRESETS:
            raise ConfigError(f"TorchQuantizationConfig.quantization_config must be one of "
                              f"{list(TORCH_QUANTIZATION_PRESETS)}, got {self.quantization_config!r}")
        if not isinstance(self.calibration_samples, int) or isinstance(self.calibration_samples, bool) \
                or self.calibration_samples < 1:
            raise ConfigError(f"calibration_samples must be an int >= 1, got {self.calibration_samples!r}")


QUANTIZATION_CONFIG_TYPES = (ONNXAutoCastConfig, ONNXQuantizationConfig, TorchQuantizationConfig)


# --------------------------------------------------------------------------------------------- backend config


@dataclasses.dataclass(kw_only=True)
class TensorRTBackendConfig(BackendConfig):
    """Config of :class:`~aitune.torch.backend.tensorrt.TensorRTBackend` (ONNX -> TensorRT engine).

    Args:
        use_dynamo: export with ``torch.onnx.export(dynamo=True)`` (falls back to the TorchScript exporter).
        workspace_size: limit of TensorRT's workspace memory pool, bytes; None = TensorRT's default.
        opset_version: ONNX opset of the export; None = the exporter's default.
        optimization_level: builder optimization level 0-5 (TensorRT's default is 3); higher levels build
            longer and may find faster kernels.
        compatibility_level: hardware compatibility level (``trt.HardwareCompatibilityLevel``): 0/"none",
            1/"ampere_plus", 2/"same_compute_capability"; None = engine runs only on the build GPU model.
        timing_cache: file of TensorRT's tactic timing cache; read before and merged after each build.
        profiles: :class:`ProfileMode` (or its value as a string) or a list of :class:`TensorRTProfile`.
        quantization_config: :class:`ONNXAutoCastConfig`, :class:`ONNXQuantizationConfig`,
            :class:`TorchQuantizationConfig` or None (the engine keeps the model's dtypes).
        enable_tf32: let fp32 matmuls/convolutions use TF32 (TensorRT's default; outputs then agree with
            eager to about 1e-3 relative, not 1e-5).
        use_cuda_graphs: capture engine runs into CUDA graphs (one per input shape, recaptured when shapes
            change).
        max_cuda_graphs: most graphs kept (least recently used evicted), >= 1.
        build_timeout_s: wall-clock limit of the engine build child process, seconds.
        device: the CUDA device of the engine (``"cuda"``, ``"cuda:1"``), as in the reference; the build
            runs where ``ait.tune`` tunes (the module's device or its ``device=``), which must be of this
            type — the field is validated and recorded.

    Raises:
        ConfigError: on any invalid field (the message names the field and the accepted values).
    """

    use_dynamo: bool = True
    workspace_size: int | None = None
    opset_version: int | None = None
    optimization_level: int | None = None
    compatibility_level: int | str | None = None
    timing_cache: Path | str | None = None
    profiles: ProfileMode | str | list[TensorRTProfile] = ProfileMode.SINGLE
    quantization_config: ONNXAutoCastConfig | ONNXQuantizationConfig | TorchQuantizationConfig | None = None
    enable_tf32: bool = True
    use_cuda_graphs: bool = False
    max_cuda_graphs: int = 8
    build_timeout_s: float = 3600.0
    device: str = "cuda"

    def validate(self) -> None:
        self.device = cuda_device_name(self.device, "TensorRTBackendConfig.device")
        for name in ("use_dynamo", "enable_tf32", "use_cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.workspace_size is not None and (not _is_int(self.workspace_size) or self.workspace_size <= 0):
            raise ConfigError(f"workspace_size must be a number of bytes > 0 or None, got {self.workspace_size!r}")
        if self.opset_version is not None and (not _is_int(self.opset_version) or self.opset_version < 7):
            raise ConfigError(f"opset_version must be an int >= 7 or None, got {self.opset_version!r}")
        if self.optimization_level is not None and (not _is_int(self.optimization_level)
                                                    or self.optimization_level not in OPTIMIZATION_LEVELS):
            raise ConfigError(f"optimization_level must be an int in 0..5 or None, got {self.optimization_level!r}")
        self.compatibility_level = _compatibility_level(self.compatibility_level)
        if self.timing_cache is not None:
            if not isinstance(self.timing_cache, (str, Path)) or not str(self.timing_cache):
                raise ConfigError(f"timing_cache must be a file path or None, got {self.timing_cache!r}")
            self.timing_cache = Path(self.timing_cache)
        self.profiles = _profiles(self.profiles)
        if self.quantization_config is not None and not isinstance(self.quantization_config,
                                                                   QUANTIZATION_CONFIG_TYPES):
            raise ConfigError("quantization_config must be an ONNXAutoCastConfig, ONNXQuantizationConfig, "
                              f"TorchQuantizationConfig or None, got {type(self.quantization_config).__name__}")
        if not _is_int(self.max_cuda_graphs) or self.max_cuda_graphs < 1:
            raise ConfigError(f"max_cuda_graphs must be an int >= 1, got {self.max_cuda_graphs!r}")
        if isinstance(self.build_timeout_s, bool) or not isinstance(self.build_timeout_s, (int, float)) \
                or not math.isfinite(self.build_timeout_s) or self.build_timeout_s <= 0:
            raise ConfigError(f"build_timeout_s must be a number of seconds > 0, got {self.build_timeout_s!r}")

    def describe(self) -> str:
        return describe_nested(self)

    @property
    def user_profiles(self) -> list[TensorRTProfile] | None:
        """The user's profiles, or None when profiles come from a :class:`ProfileMode`."""
        return None if isinstance(self.profiles, ProfileMode) else list(self.profiles)

    def data(self) -> dict:
        data = super().data()
        data["profiles"] = (self.profiles.value if isinstance(self.profiles, ProfileMode)
                            else [profile.to_dict() for profile in self.profiles])
        return data

    @classmethod
    def _from_data(cls, data: dict) -> "TensorRTBackendConfig":
        data = dict(data)
        quantization = data.get("quantization_config")
        if isinstance(quantization, dict):
            restored = BackendConfig.from_dict(quantization)
            if not isinstance(restored, QUANTIZATION_CONFIG_TYPES):
                raise ConfigError(f"quantization_config of type {quantization.get('type')!r} is not a "
                                  "TensorRT quantization config")
            data["quantization_config"] = restored
        return super()._from_data(data)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def describe_nested(config: BackendConfig) -> str:
    """Like :meth:`BackendConfig.describe`, with nested configs shown as ``Name(changed fields)``."""
    try:
        default = type(config)()
    except Exception:  # noqa: BLE001 - a config with required fields has no default instance
        default = None
    parts = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if default is not None and value == getattr(default, field.name):
            continue
        if isinstance(value, BackendConfig):
            text = f"{type(value).__name__}({describe_nested(value)})"
        elif isinstance(value, enum.Enum):
            text = str(value.value)
        elif isinstance(value, list):
            text = "[" + ", ".join(repr(item) for item in value) + "]"
        else:
            text = str(value)
        parts.append(f"{field.name}={text}")
    return ",".join(parts)


def _compatibility_level(value: Any) -> int | None:
    if value is None:
        return None
    if _is_int(value) and value in COMPATIBILITY_LEVELS:
        return int(value)
    if isinstance(value, str):
        by_name = {name.lower(): level for level, name in COMPATIBILITY_LEVELS.items()}
        level = by_name.get(value.lower())
        if level is not None:
            return level
    raise ConfigError(f"compatibility_level must be one of {sorted(COMPATIBILITY_LEVELS)} or "
                      f"{[name.lower() for name in COMPATIBILITY_LEVELS.values()]} or None, got {value!r}")


def _profiles(value: Any) -> ProfileMode | list[TensorRTProfile]:
    if isinstance(value, ProfileMode):
        return value
    if isinstance(value, str):
        try:
            return ProfileMode(value.lower())
        except ValueError:
            raise ConfigError(f"profiles must be one of {[mode.value for mode in ProfileMode]} or a list of "
                              f"TensorRTProfile, got {value!r}") from None
    if isinstance(value, TensorRTProfile):
        value = [value]
    if isinstance(value, (list, tuple)):
        if not value:
            raise ConfigError("profiles is an empty list; give at least one TensorRTProfile or a ProfileMode")
        profiles = []
        for index, item in enumerate(value):
            if isinstance(item, dict):
                item = TensorRTProfile.from_dict(item)
            if not isinstance(item, TensorRTProfile):
                raise ConfigError(f"profiles[{index}] must be a TensorRTProfile, got {type(item).__name__}")
            if not item.shapes:
                raise ConfigError(f"profiles[{index}] has no input shapes; call add_input_shape() for each input")
            profiles.append(item)
        return profiles
    raise ConfigError(f"profiles must be a ProfileMode or a list of TensorRTProfile, got {type(value).__name__}")
