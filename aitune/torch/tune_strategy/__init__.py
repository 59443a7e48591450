"""Tune strategies: how candidates are chosen for each graph."""

from aitune.torch.common.legacy_names import resolve as _resolve_legacy_name
from aitune.torch.tune_strategy.base import TuneStrategy
from aitune.torch.tune_strategy.first_wins import FirstWinsStrategy
from aitune.torch.tune_strategy.latency_budget import LatencyBudgetStrategy
from aitune.torch.tune_strategy.max_throughput import MaxThroughputStrategy
from aitune.torch.tune_strategy.min_latency import MinLatencyStrategy
from aitune.torch.tune_strategy.one_backend import OneBackendStrategy

__all__ = [
    "FirstWinsStrategy",
    "LatencyBudgetStrategy",
    "MaxThroughputStrategy",
    "MinLatencyStrategy",
    "OneBackendStrategy",
    "TuneStrategy",
]


def __getattr__(name: str):
    """Old reference names (e.g. the examples' ``TorchInductorBackend``), with a DeprecationWarning."""
    return _resolve_legacy_name("aitune.torch.tune_strategy", name)
