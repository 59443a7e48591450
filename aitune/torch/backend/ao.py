"""TorchAOBackend: weight / dynamic quantization with torchao ``quantize_``, then ``torch.compile``."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import logging
from pathlib import Path
from typing import Any, Callable

import torch

from aitune.errors import ConfigError
from aitune.torch.backend.base import (
    Backend,
    BackendConfig,
    BuildMode,
    Check,
    Requirement,
    _to_jsonable,
)
from aitune.torch.common.requirements import validate_flags
from aitune.torch.config import config as aitune_config
from aitune.torch.backend.compile_settings import dynamic_for_axes, parameter_freezing
from aitune.torch.backend.inductor_jit import (
    COMPILE_MODES,
    allow_many_variants,
    clone_output,
    compile_arguments,
    graph_break_count,
    uses_cuda_graphs,
)

logger = logging.getLogger(__name__)

PRESETS = ("int8wo", "int8dq", "int4wo", "fp8wo", "fp8dq", "fp8dq_row", "mxfp8dq", "nvfp4dq")
FP8_PRESETS = ("fp8wo", "fp8dq", "fp8dq_row")
# Microscaling presets (torchao.prototype.mx_formats): MX-fp8 (e4m3 activations and weights, one scale per
# 32 elements) and NVFP4 (fp4 e2m1, one fp8 scale per 16 elements, dynamic per-tensor scale). Their kernels
# exist on Blackwell-class GPUs (sm_100+) only, and take bfloat16 weights whose last dimension (mxfp8) or
# last two dimensions (nvfp4) divide by the block size (the reference system's pre-flight checks).
BLOCK_PRESETS = {"mxfp8dq": 32, "nvfp4dq": 16}
BLOCK_MIN_CAPABILITY = (10, 0)

# Float8 tensor cores: Ada (sm_89) and Hopper (sm_90) and newer (torchao's own assertion says
# "Float8 dynamic quantization requires CUDA compute capability >= 8.9").
FP8_MIN_CAPABILITY = (8, 9)
# int4wo uses PyTorch's tinygemm int4 kernel (torchao Int4TilePackedTo4dTensor): sm_80+, bfloat16 weights.
INT4_MIN_CAPABILITY = (8, 0)
INT4_GROUP_SIZE = 128

# Why each preset cannot run on CPU (found by running every preset on CPU with torch 2.13 /
# torchao 0.18): int4wo's default packing raises "ImportError: Requires mslk >= 1.0.0" and its
# tile-packed format needs a CUDA GPU; fp8dq/fp8dq_row raise "Float8 dynamic quantization requires CUDA
# compute capability >= 8.9". fp8wo does run on CPU, but only as an fp8 storage format (dequantise +
# fp32 matmul): refused too, like every fp8 preset, without float8 tensor cores.
CPU_REFUSALS = {
    "int4wo": "no CPU kernel in torchao (its packing formats need the mslk package or the CUDA "
              "tinygemm kernel); use int8wo or int8dq on CPU",
    "fp8wo": "fp8 presets need a CUDA GPU with compute capability >= 8.9 (float8 tensor cores); "
             "use int8wo or int8dq on CPU",
    "fp8dq": "fp8 presets need a CUDA GPU with compute capability >= 8.9 (float8 tensor cores); "
             "use int8dq on CPU",
    "fp8dq_row": "fp8 presets need a CUDA GPU with compute capability >= 8.9 (float8 tensor cores); "
                 "use int8dq on CPU",
    "mxfp8dq": "MX-fp8 kernels need a Blackwell-class CUDA GPU (compute capability >= 10.0); use int8dq on CPU",
    "nvfp4dq": "NVFP4 kernels need a Blackwell-class CUDA GPU (compute capability >= 10.0); use int8dq on CPU",
}


def default_preset(device: torch.device | str, module: torch.nn.Module | None = None) -> str:
    """The preset ``TorchAOBackend()`` uses on ``device``.

    CPU: ``int8dq`` (int8 dynamic activations + int8 weights: the one preset with int8 GEMMs on CPU;
    ``benchmarks/cpu_search.py`` times it against eager). CUDA with compute
    capability >= 8.9: ``fp8dq_row`` (float8 tensor cores, per-row scales, torchao's recommended float8
    inference recipe) for bfloat16 weights, ``fp8dq`` (per-tensor scales) otherwise — torchao's per-row
    float8 asserts bfloat16 (an fp16 model fails there). Older CUDA GPUs: ``int8wo``.
    """
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_MIN_CAPABILITY:
            return "int8wo"
        return "fp8dq_row" if module is None or _all_linear_bf16(module) else "fp8dq"
    return "int8dq"


def _all_linear_bf16(module: torch.nn.Module) -> bool:
    return all(sub.weight.dtype == torch.bfloat16 for sub in module.modules() if isinstance(sub, torch.nn.Linear))


def preset_config(preset: str):
    """The torchao 0.18 config object of a preset (imports torchao).

    ``set_inductor_config=False`` everywhere: torchao would otherwise change process-wide Inductor
    settings (coordinate-descent tuning, ...) for every later compile of any backend.
    """
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Float8WeightOnlyConfig,
        Int4WeightOnlyConfig,
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
        PerRow,
        PerTensor,
    )

    if preset == "int8wo":
        return Int8WeightOnlyConfig(set_inductor_config=False)
    if preset == "int8dq":
        return Int8DynamicActivationInt8WeightConfig(set_inductor_config=False)
    if preset == "int4wo":
        return Int4WeightOnlyConfig(group_size=INT4_GROUP_SIZE, int4_packing_format="tile_packed_to_4d",
                                    set_inductor_config=False)
    if preset == "fp8wo":
        return Float8WeightOnlyConfig(set_inductor_config=False)
    if preset == "fp8dq":
        return Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor(), set_inductor_config=False)
    if preset == "fp8dq_row":
        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)
    if preset == "mxfp8dq":
        from torchao.prototype.mx_formats import MXDynamicActivationMXWeightConfig

        return MXDynamicActivationMXWeightConfig(activation_dtype=torch.float8_e4m3fn,
                                                 weight_dtype=torch.float8_e4m3fn)
    if preset == "nvfp4dq":
        from torchao.prototype.mx_formats import NVFP4DynamicActivationNVFP4WeightConfig

        return NVFP4DynamicActivationNVFP4WeightConfig(use_dynamic_per_tensor_scale=True)
    raise ConfigError(f"unknown TorchAO preset {preset!r}; presets: {', '.join(PRESETS)}")


def _block_preset_refusal(preset: str, capability: tuple[int, int] | None, selected: list) -> str | None:
    """Why ``mxfp8dq``/``nvfp4dq`` cannot run here (GPU generation, weight dtype, block divisibility), or None."""
    if capability is None or capability < BLOCK_MIN_CAPABILITY:
        where = "this CPU" if capability is None else f"this GPU (sm_{capability[0]}{capability[1]})"
        return (f"{preset} needs a Blackwell-class GPU (compute capability >= 10.0) for its microscaling kernels; "
                f"{where} has none — use fp8dq (sm_89+) or int8dq")
    block = BLOCK_PRESETS[preset]
    for name, sub in selected:
        weight = getattr(sub, "weight", None)
        if weight is None:
            continue
        if weight.dtype != torch.bfloat16:
            return (f"{preset} needs bfloat16 weights; {name or 'the module'} has "
                    f"{str(weight.dtype).removeprefix('torch.')}")
        dims = weight.shape[-2:] if preset == "nvfp4dq" else weight.shape[-1:]
        if any(size % block for size in dims):
            return (f"{preset} needs weight dimension(s) {tuple(dims)} of {name or 'the module'} divisible by its "
                    f"block size {block}")
    return None


def _callable_descriptor(function: Callable) -> dict:
    """Plain-data record of a callable: its name and a digest of its code (never the code itself)."""
    code = getattr(function, "__code__", None)
    digest = ""
    if code is not None:
        material = repr((code.co_code, code.co_consts, code.co_names, code.co_varnames)).encode()
        digest = hashlib.sha256(material).hexdigest()
    name = f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', type(function).__name__)}"
    return {"callable": name, "code_sha256": digest, "serializable": False}


@dataclasses.dataclass(kw_only=True)
class TorchAOBackendConfig(BackendConfig):
    """Config of :class:`TorchAOBackend`.

    Args:
        quantization: a preset: ``int8wo`` (int8 weight-only, per-row), ``int8dq`` (int8 dynamic
            activations + int8 weights), ``int4wo`` (int4 weight-only, group size 128, tinygemm; CUDA,
            bfloat16), ``fp8wo`` (float8 e4m3 weight-only), ``fp8dq`` (float8 dynamic activations + float8
            weights, per-tensor scales), ``fp8dq_row`` (the same with per-row scales), ``mxfp8dq`` (MX-fp8
            activations + weights) and ``nvfp4dq`` (NVFP4 activations + weights) — these two need a
            Blackwell-class GPU (sm_100+) and bfloat16 weights; ``supports()`` says why elsewhere. None together with
            no ``quantization_config`` picks the device's default (:func:`default_preset`) at build time.
        quantization_config: any torchao ``AOBaseConfig`` instead of a preset (exclusive with ``quantization``).
            Serialised with torchao's own JSON form (``torchao.core.config.config_to_dict``), never pickled;
            a config torchao cannot serialise is recorded by class name and refused by :meth:`from_dict`.
        filter_fn: ``(module, fully_qualified_name) -> bool`` choosing the modules to quantize (torchao's
            default: every ``nn.Linear``). Recorded by name and code digest only: a config holding one
            cannot be rebuilt from a checkpoint (pass it again).
        mode: ``torch.compile`` mode (``default``, ``reduce-overhead``, ``max-autotune``,
            ``max-autotune-no-cudagraphs``) or None (torch.compile's default).
        fullgraph: fail on a graph break. dynamic: as in ``torch.compile``; None = True when the graph
            has dynamic axes.
        compile: compile the quantized module (True) or run it eagerly (False).
        freezing: compile with Inductor's weight folding (constant-folds the quantized weights,
            which saves time per call on CPU).

    Raises:
        ConfigError: both ``quantization`` and ``quantization_config``, an unknown preset or mode, a
            ``quantization_config`` that is not a torchao config, a non-callable ``filter_fn``.
    """

    quantization: str | None = None
    quantization_config: Any = None
    filter_fn: Callable[[torch.nn.Module, str], bool] | None = None
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    compile: bool = True
    freezing: bool = False

    def validate(self) -> None:
        if self.quantization is not None and self.quantization_config is not None:
            raise ConfigError("TorchAOBackendConfig takes either quantization (a preset) or quantization_config "
                              "(a torchao config object), not both: drop one of them")
        if self.quantization is not None and self.quantization not in PRESETS:
            raise ConfigError(f"unknown TorchAO preset {self.quantization!r}; presets: {', '.join(PRESETS)}")
        if isinstance(self.quantization_config, dict):
            self.quantization_config = self._config_from_data(self.quantization_config)
        if self.quantization_config is not None:
            try:
                from torchao.core.config import AOBaseConfig
            except ImportError as exc:
                raise ConfigError("quantization_config needs torchao — pip install 'aitune[torchao]'") from exc
            if not isinstance(self.quantization_config, AOBaseConfig):
                raise ConfigError(f"quantization_config must be a torchao config (AOBaseConfig), got "
                                  f"{type(self.quantization_config).__name__}")
        if isinstance(self.filter_fn, dict):
            raise ConfigError(f"TorchAOBackendConfig: filter_fn {self.filter_fn.get('callable')!r} was recorded by "
                              "name only and cannot be rebuilt (aitune never unpickles code); pass the function "
                              "again: TorchAOBackendConfig(filter_fn=...)")
        if self.filter_fn is not None and not callable(self.filter_fn):
            raise ConfigError(f"filter_fn must be callable (module, name) -> bool, got {self.filter_fn!r}")
        if self.mode is not None and self.mode not in COMPILE_MODES:
            raise ConfigError(f"mode must be one of {COMPILE_MODES} or None, got {self.mode!r}")
        validate_flags(self, ("fullgraph", "compile", "freezing"))

    @staticmethod
    def _config_from_data(data: dict):
        if data.get("serializable") is False:
            raise ConfigError(f"TorchAOBackendConfig: quantization_config {data.get('class')!r} was recorded by "
                              "name only (torchao could not serialise it) and cannot be rebuilt; pass the config "
                              "object again: TorchAOBackendConfig(quantization_config=...)")
        try:
            from torchao.core.config import config_from_dict
        except ImportError as exc:
            raise ConfigError("rebuilding a torchao quantization_config needs torchao — "
                              "pip install 'aitune[torchao]'") from exc
        try:
            return config_from_dict(data)
        except Exception as exc:  # noqa: BLE001 - translated with the cause chained
            raise ConfigError(f"cannot rebuild torchao quantization_config {data.get('_type')!r}: {exc}") from exc

    def data(self) -> dict:
        values = {field.name: _to_jsonable(getattr(self, field.name)) for field in dataclasses.fields(self)
                  if field.name not in ("quantization_config", "filter_fn")}
        values["quantization_config"] = None
        if self.quantization_config is not None:
            try:
                from torchao.core.config import config_to_dict

                values["quantization_config"] = config_to_dict(self.quantization_config)
            except Exception:  # noqa: BLE001 - recorded by name, refused on load
                values["quantization_config"] = {"class": type(self.quantization_config).__qualname__,
                                                 "repr": repr(self.quantization_config)[:500], "serializable": False}
        values["filter_fn"] = None if self.filter_fn is None else _callable_descriptor(self.filter_fn)
        return values


class TorchAOBackend(Backend):
    """torchao ``quantize_`` on a deep copy of the module, then ``torch.compile``, warmed up on every sample.

    Wraps: torchao (extra ``[torchao]``, torchao >= 0.12; presets written against 0.18). Devices: CPU
    (int8wo, int8dq) and CUDA (all presets; fp8 needs compute capability >= 8.9, int4wo >= 8.0 and
    bfloat16 weights). The default preset depends on the device (:func:`default_preset`).

    The caller's module is never quantized in place (torchao's ``quantize_`` mutates what it is given):
    the build quantizes a ``copy.deepcopy``. Outputs are judged against eager by SQNR and
    cosine similarity (``is_quantizing``), since quantized outputs are not equal within atol/rtol; NaN from
    overflow (pytorch/ao#1662) is caught there.

    torchao's configs would set process-wide Inductor options (``set_inductor_config``; torchao <= 0.17 also
    the fp32 matmul precision); presets turn that off, and whatever a custom config changes is restored after
    the build.

    Checkpoints: JIT-style (``BuildMode.JIT``): no quantized weights are written; loading re-quantizes the
    original module's weights and recompiles (torchao's tensor-subclass state dicts do not round-trip
    reliably: pytorch/ao#2478, #1118).
    """

    name = "torchao"
    config_class = TorchAOBackendConfig
    build_mode = BuildMode.JIT
    is_quantizing = True
    rank = 40
    default_search_position = 50  # in the default search (Backend.default_search_position)
    requirements = (Requirement("torchao", ("torchao",), "torchao", "0.12"),)
    _freezing = contextlib.nullcontext()  # parameter_freezing(...) once built

    def search_space(self, module, graph, device) -> list["Backend"]:
        """At the default configuration, the device's preset compiled with ``freezing`` (on CUDA
        also with CUDA graphs), then — with a time budget — without freezing. A configuration the user chose
        is tried as given."""
        if self.config != TorchAOBackendConfig():
            return [self]
        configs = [dict(freezing=True), dict()]
        if torch.device(device).type == "cuda":
            configs.insert(0, dict(mode="reduce-overhead", freezing=True))
        variants = [TorchAOBackend(TorchAOBackendConfig(**kwargs)) for kwargs in configs]
        for variant in variants[1:]:  # the first is the likely best; the others only with a time budget
            variant._tier = 1
        return variants

    # ---- eligibility
    @property
    def bakes_weights(self) -> bool:
        """The quantized copy holds the weights as they were at tuning."""
        return True

    @property
    def runs_own_copy(self) -> bool:
        """Calls run the compiled quantized copy, never the user's module."""
        return True

    def preset_for(self, device: torch.device | str, module: torch.nn.Module | None = None) -> str | None:
        """The preset this backend uses on ``device`` for ``module`` (None: a custom ``quantization_config``)."""
        if self.config.quantization_config is not None:
            return None
        return self.config.quantization or default_preset(device, module)

    def _supports(self, module, graph, device) -> Check:
        if device.type == "cuda" and not torch.cuda.is_available():
            return Check(False, "CUDA is not available in this process")
        if self.config.compile and uses_cuda_graphs(self.config.mode, None) and device.type != "cuda":
            return Check(False, "mode 'reduce-overhead' captures CUDA graphs and needs a CUDA device")
        preset = self.preset_for(device, module)
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        if preset is not None and device.type == "cpu" and preset in CPU_REFUSALS:
            return Check(False, f"{preset}: {CPU_REFUSALS[preset]}")
        if preset in FP8_PRESETS and device.type == "cuda" and capability < FP8_MIN_CAPABILITY:
            return Check(False, f"{preset}: fp8 presets need compute capability >= 8.9 (float8 tensor cores); "
                                f"this GPU is sm_{capability[0]}{capability[1]} — use int8wo/int8dq")
        if preset in BLOCK_PRESETS:
            refusal = _block_preset_refusal(preset, capability, self._selected_modules(module, preset))
            if refusal is not None:
                return Check(False, refusal)
        if preset == "fp8dq_row" and not _all_linear_bf16(module):
            return Check(False, "fp8dq_row: torchao's per-row float8 needs bfloat16 weights; use fp8dq (per-tensor) "
                                "or cast the module to bfloat16")
        selected = self._selected_modules(module, preset)
        if not selected:
            what = "module selected by filter_fn" if self.config.filter_fn else "nn.Linear module"
            return Check(False, f"nothing to quantize: no {what} in {type(module).__name__}", no_op=True)
        if preset == "int4wo":
            if device.type != "cuda" or capability < INT4_MIN_CAPABILITY:
                return Check(False, "int4wo (tinygemm int4 kernel) needs a CUDA GPU of compute capability >= 8.0")
            wrong = [name for name, sub in selected if sub.weight.dtype != torch.bfloat16]
            if wrong:
                return Check(False, f"int4wo (tinygemm int4 kernel) needs bfloat16 weights; {wrong[0]} is "
                                    f"{str(dict(selected)[wrong[0]].weight.dtype).removeprefix('torch.')} — "
                                    "cast the module to bfloat16 first")
        return Check(True, "" if preset is None else f"preset {preset}")

    def _selected_modules(self, module: torch.nn.Module, preset: str | None) -> list[tuple[str, torch.nn.Module]]:
        """Modules quantize_ would touch: filter_fn's choice (else every nn.Linear); presets act on Linear only."""
        selected = []
        for name, sub in module.named_modules():
            if self.config.filter_fn is not None:
                try:
                    chosen = bool(self.config.filter_fn(sub, name))
                except Exception:  # noqa: BLE001 - a filter that fails on some module does not select it
                    chosen = False
                if chosen and (preset is None or isinstance(sub, torch.nn.Linear)):
                    selected.append((name, sub))
            elif isinstance(sub, torch.nn.Linear):
                selected.append((name, sub))
        return selected

    # ---- build
    def _torchao_config(self, device: torch.device, module: torch.nn.Module | None = None):
        preset = self.preset_for(device, module)
        return (preset_config(preset) if preset is not None else self.config.quantization_config), preset

    def _build(self, module, graph, device, workdir: Path) -> None:
        from torchao.quantization import quantize_

        torchao_config, preset = self._torchao_config(device, module)
        self.build_info["preset"] = preset
        self.build_info["quantization_config"] = type(torchao_config).__name__
        saved_inductor = _inductor_snapshot()
        try:
            # NOTE [never in place]: quantize_ swaps the weights of the module it is given; quantize a copy.
            quantized = copy.deepcopy(module)
            before = {name: type(sub.weight) for name, sub in quantized.named_modules()
                      if isinstance(getattr(sub, "weight", None), torch.Tensor)}
            if self.config.filter_fn is not None:
                quantize_(quantized, torchao_config, filter_fn=self.config.filter_fn)
            else:
                quantize_(quantized, torchao_config)
            changed = [name for name, sub in quantized.named_modules()
                       if name in before and type(getattr(sub, "weight", None)) is not before[name]]
            self.build_info["quantized_modules"] = len(changed)
            if not changed:
                logger.warning("torchao: %s quantized no module of %s (it runs unquantized and is measured as is)",
                               preset or type(torchao_config).__name__, type(module).__name__)
            logger.debug("torchao: quantized %d modules with %s", len(changed), preset or torchao_config)
            self._clone_outputs = bool(changed) and self.config.compile and uses_cuda_graphs(self.config.mode, None)
            self._freezing = parameter_freezing(self.config.compile and self.config.freezing)
            if self.config.compile and changed:  # nothing quantized: a no-op row (evaluation), not worth a compile
                dynamic = dynamic_for_axes(self.config.dynamic, graph)
                self.build_info["dynamic"] = dynamic
                mode, options = compile_arguments(self.config.mode, None, self.config.freezing)
                allow_many_variants()
                self._callable = torch.compile(quantized, backend="inductor", mode=mode, options=options,
                                               fullgraph=self.config.fullgraph, dynamic=dynamic)
            else:
                self._callable = quantized
            self._quantized = quantized
            if not changed:
                return
            breaks_before = graph_break_count()
            for sample in graph.samples:  # warm-up: quantize/compile every recorded shape now
                sample = sample.clone()
                self._infer(sample.args, sample.kwargs)
            self.build_info["graph_breaks"] = graph_break_count() - breaks_before
        finally:
            _inductor_restore(saved_inductor)

    def _infer(self, args, kwargs, copy: bool = True):
        if self._clone_outputs:  # CUDA-graph outputs are overwritten by the next replay (pytorch/pytorch#144386)
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad(), self._freezing:
            output = self._callable(*args, **kwargs)
        return clone_output(output) if self._clone_outputs and copy else output

    def _infer_accepted(self, args, kwargs):
        return self._infer(args, kwargs, aitune_config._copy_cuda_graph_outputs)  # served (NOTE [output copies])

    # ---- checkpoints (JIT-style)
    def _save(self, directory: Path) -> dict:
        return {"preset": self.build_info.get("preset"), "build_mode": "jit",
                "note": "no quantized weights stored; loading re-quantizes the original weights"}

    def _load(self, directory, metadata, module, graph, device) -> None:
        if module is None:
            raise ConfigError("the torchao backend re-quantizes on load and needs the original module (weights)")
        self._build(module, graph, device, directory)


def _inductor_snapshot() -> dict:
    """Process-wide settings a torchao config may change: Inductor options and the fp32 matmul precision."""
    import torch._inductor.config as inductor_config

    return {"inductor": inductor_config.get_config_copy(),
            "float32_matmul_precision": torch.get_float32_matmul_precision()}


def _inductor_restore(snapshot: dict) -> None:
    """Undo what a torchao config changed process-wide during the build.

    torchao's ``set_inductor_config=True`` (the default of its configs) turns on coordinate-descent tuning
    and other Inductor options, and torchao <= 0.17 also calls ``torch.set_float32_matmul_precision("high")``
    (TF32 for every later fp32 matmul in the process, eager references included).
    """
    import torch._inductor.config as inductor_config

    if torch.get_float32_matmul_precision() != snapshot["float32_matmul_precision"]:
        logger.debug("restoring float32 matmul precision %r changed by torchao", snapshot["float32_matmul_precision"])
        torch.set_float32_matmul_precision(snapshot["float32_matmul_precision"])
    saved = snapshot["inductor"]
    current = inductor_config.get_config_copy()
    changed = {key: value for key, value in saved.items() if key in current and current[key] != value}
    for key, value in changed.items():
        try:
            owner = inductor_config
            *parents, leaf = key.split(".")
            for parent in parents:
                owner = getattr(owner, parent)
            setattr(owner, leaf, value)
        except Exception:  # noqa: BLE001 - best effort; logged
            logger.debug("could not restore inductor option %s", key, exc_info=True)
    if changed:
        logger.debug("restored inductor options changed by torchao: %s", sorted(changed))
