"""aitune's PyTorch API (``import aitune.torch as ait``).

An independent implementation of the NVIDIA AITune interface; not an NVIDIA product.
"""

import aitune.utils.monitoring  # noqa: F401 - AITUNE_HARDWARE_METRICS=1 starts collecting on import
from aitune.torch.common.legacy_names import resolve as _resolve_legacy_name
from aitune.torch.config import config
from aitune.torch.check.correctness import Tolerance
from aitune.torch.dataloader import DataLoaderFactory
from aitune.torch.check.guard import GuardConfig
from aitune.torch.inspecting import InspectedModulesInfo, ModuleInfo, inspect, wrap
from aitune.torch.measure.kernel_profiler import ModuleFunctionKernelProfiler
from aitune.torch.module import Module, ModuleState
from aitune.torch.check.probes import ProbeConfig
from aitune.torch.record.onnx_module import OnnxModule
from aitune.torch.profile_api import PerformanceProfile, profile
from aitune.torch.measure.profiling import ProfilingConfig
from aitune.torch.report.rows import TuneReport
from aitune.torch.record.samples import BatchDim, DynamicDim
from aitune.torch.storage import LocalTorchStorage, load, save
from aitune.torch.report.telemetry import snapshot_tuning_data
from aitune.torch.tune_strategy import (
    FirstWinsStrategy,
    LatencyBudgetStrategy,
    MaxThroughputStrategy,
    MinLatencyStrategy,
    OneBackendStrategy,
    TuneStrategy,
)
from aitune.torch.tuning import cache_dir as aitune_cache_dir
from aitune.torch.tuning import tune
from aitune.torch import module as _module
from aitune.torch import tuning as _tuning

_module.set_orchestrator(_tuning)  # Module.tune runs the orchestrator, which sits above it (NOTE [Module.tune])

# Last: just-in-time tuning builds on everything above. Importing it enables nothing.
from aitune.torch.jit import PatchedModule, jit_config, patch_for_jit_tuning  # noqa: E402
from aitune.torch.jit import reset as jit_reset  # noqa: E402 - the reference's name

__all__ = [
    "BatchDim",
    "DataLoaderFactory",
    "DynamicDim",
    "FirstWinsStrategy",
    "GuardConfig",
    "InspectedModulesInfo",
    "LatencyBudgetStrategy",
    "LocalTorchStorage",
    "MaxThroughputStrategy",
    "MinLatencyStrategy",
    "Module",
    "ModuleFunctionKernelProfiler",
    "ModuleInfo",
    "ModuleState",
    "OneBackendStrategy",
    "OnnxModule",
    "PatchedModule",
    "PerformanceProfile",
    "ProbeConfig",
    "ProfilingConfig",
    "Tolerance",
    "TuneReport",
    "TuneStrategy",
    "aitune_cache_dir",
    "config",
    "inspect",
    "jit_config",
    "jit_reset",
    "load",
    "patch_for_jit_tuning",
    "profile",
    "save",
    "snapshot_tuning_data",
    "tune",
    "wrap",
]


def __getattr__(name: str):
    """Old reference names (e.g. the examples' ``HighestThroughputStrategy``), with a DeprecationWarning."""
    return _resolve_legacy_name("aitune.torch", name)
