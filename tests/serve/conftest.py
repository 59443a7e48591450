"""Fixtures of the serve tests: one tiny tuned checkpoint per session (Ray-free tests)."""

import pytest

from aitune.torch.measure.profiling import ProfilingConfig
from serve_tiny import save_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    profiling = ProfilingConfig(warmup_rounds=1, warmup_s=0.0, min_rounds=3, max_rounds=5, time_budget_s=0.1)
    folder = tmp_path_factory.mktemp("tiny")
    return save_tiny_checkpoint(folder / "tiny.ait", profiling, cache_dir=folder / "aitune-cache")
