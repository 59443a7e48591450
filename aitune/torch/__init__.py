"""aitune's PyTorch API (``import aitune.torch as ait``).

An independent implementation of the NVIDIA AITune interface; not an NVIDIA product.
"""

from aitune.torch.checkpoint import load, save
from aitune.torch.correctness import Tolerance
from aitune.torch.guard import GuardConfig
from aitune.torch.inspecting import InspectedModulesInfo, ModuleInfo, inspect, wrap
from aitune.torch.module import Module, ModuleState
from aitune.torch.probes import ProbeConfig
from aitune.torch.profiling import ProfilingConfig
from aitune.torch.report import TuneReport
from aitune.torch.samples import BatchDim, DynamicDim
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

# Last: just-in-time tuning builds on everything above. Importing it enables nothing.
from aitune.torch.jit import PatchedModule, jit_config, patch_for_jit_tuning  # noqa: E402

__all__ = [
    "BatchDim",
    "DynamicDim",
    "FirstWinsStrategy",
    "GuardConfig",
    "InspectedModulesInfo",
    "LatencyBudgetStrategy",
    "MaxThroughputStrategy",
    "MinLatencyStrategy",
    "Module",
    "ModuleInfo",
    "ModuleState",
    "OneBackendStrategy",
    "PatchedModule",
    "ProbeConfig",
    "ProfilingConfig",
    "Tolerance",
    "TuneReport",
    "TuneStrategy",
    "aitune_cache_dir",
    "inspect",
    "jit_config",
    "load",
    "patch_for_jit_tuning",
    "save",
    "tune",
    "wrap",
]
