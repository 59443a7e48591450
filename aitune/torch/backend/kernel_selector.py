"""KernelSelectorBackend: choose faster attention kernels, then build another backend with them in place."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from aitune.errors import BackendBuildError, ConfigError
from aitune.torch.backend.base import (
    Backend,
    BackendConfig,
    BackendState,
    BuildMode,
    Check,
    _to_jsonable,
    get_backend_class,
)
from aitune.torch.common.files import checkpoint_path
from aitune.torch.common.requirements import package_versions
from aitune.torch.backend.inductor_jit import TorchInductorJitBackend
from aitune.torch.kernel_forge import KernelOptimizationPlan, KernelOptimizer, PlannedModule
from aitune.torch.kernel_forge.kernel_provider import KernelProvider, TorchSDPAKernelProvider, kernel_provider_from_dict
from aitune.torch.kernel_forge.optimizer import TIMINGS
from aitune.torch.measure.profiling import ProfilingConfig
from aitune.torch.record.onnx_module import onnx_file_refusal

logger = logging.getLogger(__name__)

CHECKPOINT_VERSION = 1
PLAN_FILE = "kernel_plan.json"
DELEGATE_DIR = "delegate"


def default_kernel_providers() -> list:
    """PyTorch SDPA pinned to cuDNN, flash, memory-efficient and math (those unsupported here are refused)."""
    return [TorchSDPAKernelProvider(name) for name in ("cudnn", "flash", "efficient", "math")]


@dataclasses.dataclass(kw_only=True)
class KernelSelectorBackendConfig(BackendConfig):
    """Config of :class:`KernelSelectorBackend`.

    Args:
        kernel_providers: a :class:`~aitune.torch.kernel_forge.kernel_provider.KernelProvider`, a list of
            them, or None for :func:`default_kernel_providers`. Providers are plain data (serialised by
            class name and fields).
        atol / rtol: elementwise tolerance of a provider's output against the original SDPA output
            (default 2e-2 / 2e-2: an fp16 attention tolerance).
        min_cosine: cosine-similarity floor per call (default 0.999).
        time_budget_s: timing budget per provider and call family, seconds (default 0.5), shared by the provider
            and the original SDPA, which are timed in alternation.
        warmup_rounds: untimed rounds before timing each provider (default 3).
        timing: how provider calls are timed: ``"auto"`` (default: inside CUDA graphs on a CUDA device,
            so only kernel time counts, as inside a delegate with CUDA graphs; eagerly on CPU),
            ``"cuda_graph"`` or ``"eager"`` (each call as made from Python, launch cost included). See
            :mod:`aitune.torch.kernel_forge.optimizer`.

    Raises:
        ConfigError: an empty provider list, a non-provider, a negative tolerance or budget, an unknown
            timing.
    """

    kernel_providers: Any = None
    atol: float = 2e-2
    rtol: float = 2e-2
    min_cosine: float = 0.999
    time_budget_s: float = 0.5
    warmup_rounds: int = 3
    timing: str = "auto"

    def validate(self) -> None:
        providers = self.kernel_providers
        if providers is not None:
            if isinstance(providers, (KernelProvider, dict)):
                providers = [providers]
            if not isinstance(providers, (list, tuple)):
                raise ConfigError(f"kernel_providers must be a KernelProvider, a list of them or None, "
                                  f"got {type(providers).__name__}")
            providers = [kernel_provider_from_dict(item) if isinstance(item, dict) else item for item in providers]
            if not providers:
                raise ConfigError("kernel_providers is empty: give at least one provider, or None for the defaults")
            for provider in providers:
                if not isinstance(provider, KernelProvider):
                    raise ConfigError(f"kernel_providers: {provider!r} is not a KernelProvider")
            self.kernel_providers = providers
        for name in ("atol", "rtol", "time_budget_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ConfigError(f"{name} must be a number >= 0, got {value!r}")
        if isinstance(self.min_cosine, bool) or not isinstance(self.min_cosine, (int, float)) \
                or not -1.0 <= self.min_cosine <= 1.0:
            raise ConfigError(f"min_cosine must lie in [-1, 1], got {self.min_cosine!r}")
        if isinstance(self.warmup_rounds, bool) or not isinstance(self.warmup_rounds, int) or self.warmup_rounds < 0:
            raise ConfigError(f"warmup_rounds must be an int >= 0, got {self.warmup_rounds!r}")
        if self.timing not in TIMINGS:
            raise ConfigError(f"timing must be one of {', '.join(TIMINGS)}, got {self.timing!r}")

    def providers(self) -> list:
        """The providers to try (the defaults when ``kernel_providers`` is None)."""
        return list(self.kernel_providers) if self.kernel_providers is not None else default_kernel_providers()

    def data(self) -> dict:
        values = {field.name: _to_jsonable(getattr(self, field.name)) for field in dataclasses.fields(self)
                  if field.name != "kernel_providers"}
        values["kernel_providers"] = (None if self.kernel_providers is None
                                      else [provider.to_dict() for provider in self.kernel_providers])
        return values

    def describe(self) -> str:
        parts = [] if self.kernel_providers is None else \
            [f"kernel_providers=[{','.join(p.name for p in self.kernel_providers)}]"]
        default = type(self)()
        for name in ("atol", "rtol", "min_cosine", "time_budget_s", "warmup_rounds", "timing"):
            if getattr(self, name) != getattr(default, name):
                parts.append(f"{name}={getattr(self, name)}")
        return ",".join(parts)


class KernelSelectorBackend(Backend):
    """Composite backend: picks faster SDPA kernels (a plan), then builds ``delegate_backend`` with the plan on.

    Wraps: :class:`~aitune.torch.kernel_forge.KernelOptimizer` + any other backend (default
    :class:`~aitune.torch.backend.TorchInductorJitBackend`). Extra: none for PyTorch's SDPA kernels;
    ``[sage]`` for SageAttention. Experimental, like the reference's.

    Build: the optimizer runs the module eagerly on the samples, finds its SDPA calls, checks every
    provider against the original and times it (``kernel_plan.json`` in the workdir; an empty plan is
    valid). The delegate then builds a :class:`~aitune.torch.kernel_forge.PlannedModule` (the user's module,
    each forward inside the plan's dispatch mode): a JIT delegate compiles through the dispatch and keeps
    the plan active at inference; an AOT delegate bakes what it traced into its artifact.

    Build mode, eligibility and quantizing flag come from the delegate (``build_mode`` is an instance
    attribute). Checkpoints hold the plan (``kernel_plan.json``) and the delegate's own checkpoint in
    ``delegate/``; loading restores the plan and loads the delegate.
    """

    name = "kernel_selector"
    config_class = KernelSelectorBackendConfig
    build_mode = BuildMode.JIT  # class-level default; every instance takes its delegate's
    rank = 60

    def __init__(self, config: KernelSelectorBackendConfig | None = None, delegate_backend: Backend | None = None):
        super().__init__(config)
        if delegate_backend is None:
            delegate_backend = TorchInductorJitBackend()
        if not isinstance(delegate_backend, Backend):
            raise ConfigError(f"delegate_backend must be an aitune Backend, got {type(delegate_backend).__name__}")
        if delegate_backend.state is not BackendState.INIT:
            delegate_backend = delegate_backend.copy()
        self.delegate = delegate_backend
        self.build_mode = delegate_backend.build_mode
        self.is_quantizing = delegate_backend.is_quantizing
        self.plan = None

    @property
    def low_precision(self) -> bool:
        """The delegate's (TF32/autocast): the checker uses its tolerances."""
        return bool(getattr(self.delegate, "low_precision", False))

    @property
    def reduces_precision(self) -> bool:
        """The delegate's (autocast): selected only when reduced precision is allowed."""
        return self.delegate.reduces_precision

    # ---- identity
    def key(self) -> str:
        return f"{type(self).__name__}_{self.config.key()[:12]}_{self.delegate.key()}"

    def describe(self) -> str:
        return f"{type(self).__name__}({self.config.describe()}; delegate={self.delegate.describe()})"

    def copy(self) -> "KernelSelectorBackend":
        import copy as copy_module

        return type(self)(copy_module.deepcopy(self.config), delegate_backend=self.delegate.copy())

    def package_versions(self) -> dict:
        """The packages this candidate runs on: its own, its delegate's and its kernel providers'
        (:func:`~aitune.torch.common.requirements.package_versions`)."""
        versions = {**self.availability().versions, **package_versions(self.delegate)}
        for provider in self.config.providers():
            versions.update(provider.availability().versions)
        return versions

    # ---- eligibility
    def supports(self, module: torch.nn.Module, graph, device: torch.device) -> Check:
        if (refusal := onnx_file_refusal(module, self)) is not None:
            return Check(False, refusal)  # whatever the delegate takes: there is no attention call to swap in a file
        device = torch.device(device)
        delegate_check = self.delegate.supports(module, graph, device)
        if not delegate_check.ok:
            return Check(False, f"delegate {self.delegate.name}: {delegate_check.reason}", delegate_check.versions)
        reasons = []
        for provider in self.config.providers():
            check = provider.availability()
            if check.ok:
                check = provider.check_device(device)
            if check.ok:
                return Check(True, "", delegate_check.versions)
            reasons.append(f"{provider.name}: {check.reason}")
        return Check(False, f"no kernel provider can run on {device.type}: " + "; ".join(reasons))

    @property
    def bakes_weights(self) -> bool:
        """The delegate's answer (the delegate runs the module)."""
        return self.delegate.bakes_weights

    @property
    def runs_own_copy(self) -> bool:
        """The delegate's answer."""
        return self.delegate.runs_own_copy

    def rejects(self, leaves: list) -> str | None:
        """The delegate's answer (the delegate runs the call)."""
        return self.delegate.rejects(leaves)

    # ---- build
    def _optimizer(self):
        config = self.config
        profiling = ProfilingConfig(warmup_rounds=config.warmup_rounds, min_rounds=5, max_rounds=200,
                                    time_budget_s=config.time_budget_s)
        return KernelOptimizer(config.providers(), atol=config.atol, rtol=config.rtol, min_cosine=config.min_cosine,
                               profiling=profiling, timing=config.timing)

    def _build(self, module, graph, device, workdir: Path) -> None:
        plan = self._optimizer().make_plan(module, graph.samples, device)
        self.plan = plan
        plan.save(workdir / PLAN_FILE)
        logger.debug("kernel_selector plan (%d choices):\n%s", len(plan), plan.describe())
        self.build_info["kernel_plan"] = {"choices": len(plan), "swapped_call_sites": plan.swapped_call_sites(),
                                          "path": str(workdir / PLAN_FILE)}
        self.delegate.build(PlannedModule(module, plan), graph, device, workdir / DELEGATE_DIR)
        self.build_info["delegate"] = {"name": self.delegate.name, **self.delegate.build_info}

    def _infer(self, args, kwargs):
        return self.delegate.infer(*args, **kwargs)

    def _activate(self) -> None:
        self.delegate.activate()

    def _deactivate(self) -> None:
        self.delegate.deactivate()

    # ---- checkpoints
    def _save(self, directory: Path) -> dict:
        if self.plan is None:
            raise BackendBuildError("kernel_selector: no kernel plan to save", backend=self.name)
        self.plan.save(directory / PLAN_FILE)
        delegate_metadata = self.delegate.save(directory / DELEGATE_DIR)
        return {"version": CHECKPOINT_VERSION, "device": str(self.device), "kernel_plan": PLAN_FILE,
                "plan_active_at_inference": self.build_mode is BuildMode.JIT,
                "delegate_backend": {"name": self.delegate.name, "config": self.delegate.config.to_dict(),
                                     "directory": DELEGATE_DIR, "metadata": delegate_metadata}}

    def _load(self, directory, metadata, module, graph, device) -> None:
        version = int(metadata.get("version", 0))
        if version > CHECKPOINT_VERSION:
            raise ConfigError(f"kernel_selector checkpoint version {version} is newer than this aitune reads "
                              f"({CHECKPOINT_VERSION}); upgrade aitune")
        delegate_info = metadata.get("delegate_backend")
        if not isinstance(delegate_info, dict):
            raise ConfigError("kernel_selector checkpoint has no delegate_backend entry")
        delegate_class = get_backend_class(delegate_info["name"])
        delegate_config = BackendConfig.from_dict(delegate_info["config"])

        plan_path = checkpoint_path(directory, metadata.get("kernel_plan", PLAN_FILE), "kernel_selector metadata "
                                    "'kernel_plan'")
        self.plan = KernelOptimizationPlan.load(plan_path).check_runtime()
        self.build_mode = delegate_class.build_mode
        target = module
        if delegate_class.build_mode is BuildMode.JIT:
            if module is None:
                raise ConfigError("kernel_selector with a JIT delegate needs the original module to load")
            target = PlannedModule(module, self.plan)
        delegate_directory = checkpoint_path(directory, delegate_info.get("directory", DELEGATE_DIR),
                                             "kernel_selector metadata 'delegate_backend.directory'", kind="dir")
        self.delegate = delegate_class.from_checkpoint(delegate_directory,
                                                       delegate_config, delegate_info.get("metadata", {}), target,
                                                       graph, device)
        self.build_mode = self.delegate.build_mode
        self.is_quantizing = self.delegate.is_quantizing
