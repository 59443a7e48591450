"""Shared test fixtures: an isolated cache directory and fast profiling settings."""

import pytest
import torch

from aitune.torch.profiling import ProfilingConfig


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AITUNE_CACHE_DIR", str(tmp_path / "aitune-cache"))
    torch.manual_seed(0)


@pytest.fixture
def fast_profiling() -> ProfilingConfig:
    """Short measurements: tests check values and choices, never speed."""
    return ProfilingConfig(warmup_rounds=1, warmup_s=0.0, min_rounds=3, max_rounds=20, time_budget_s=0.2)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
