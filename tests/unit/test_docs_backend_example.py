"""The worked example of docs/adding_a_backend.md is real: docs/examples/minimal_backend.py tunes a model through
``ait.tune``, answers like eager, and survives ``ait.save`` / ``ait.load``."""

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import aitune.torch as ait
from aitune.torch.backend import get_backend_class

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "minimal_backend.py"


@pytest.fixture(scope="module")
def example():
    """docs/examples/minimal_backend.py, imported as a user would import their own backend module."""
    spec = importlib.util.spec_from_file_location("minimal_backend", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["minimal_backend"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("minimal_backend", None)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()


def _eager(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def test_importing_the_example_registers_it_by_name(example):
    assert get_backend_class("example_export") is example.ExportBackend
    assert example.ExportBackend.availability().ok  # torch only: nothing optional to install


@torch.no_grad()  # inference calls: with autograd on, a tuned module runs eager (README, "What a backend baked in")
def test_the_example_backend_tunes_answers_like_eager_and_round_trips_a_checkpoint(example, fast_profiling,
                                                                                     tmp_path):
    model = _model()
    strategy = ait.OneBackendStrategy(example.ExportBackend(), profiling_config=fast_profiling)
    tuned = ait.Module(model, "mlp", strategy=strategy.enable_performance_validation(False))
    batches = [torch.randn(2, 8), torch.randn(5, 8)]  # batch axis recorded from 2 to 5
    report = ait.tune(tuned, batches, ready_batches=True, ignore_failing_modules=False)

    assert isinstance(tuned.backends["graph0"], example.ExportBackend), report.rows[0].reason
    [row] = [row for row in report.rows if row.backend == "example_export"]
    assert row.status == "selected"

    x = torch.randn(3, 8)  # inside the recorded range: the exported program answers
    torch.testing.assert_close(tuned(x), _eager(model, x), atol=1e-5, rtol=1e-4)
    assert tuned.backend_calls == 1 and tuned.stats["eager_fallbacks"] == {}
    wide = torch.randn(9, 8)  # outside it: rejects() names why and the call runs eager
    assert "outside" in tuned.backends["graph0"].rejects([wide])
    torch.testing.assert_close(tuned(wide), _eager(model, wide), atol=0, rtol=0)
    assert tuned.backend_calls == 1 and sum(tuned.stats["eager_fallbacks"].values()) == 1

    path = ait.save(tuned, tmp_path / "mlp.ait")
    loaded = ait.load(copy.deepcopy(model), path)  # same weights, a fresh object
    assert isinstance(loaded.backends["graph0"], example.ExportBackend)
    torch.testing.assert_close(loaded(x), _eager(model, x), atol=1e-5, rtol=1e-4)
    assert loaded.backend_calls == 1
    again = ait.save(loaded, tmp_path / "again.ait")  # a loaded backend saves its program again
    reloaded = ait.load(copy.deepcopy(model), again)
    torch.testing.assert_close(reloaded(x), _eager(model, x), atol=1e-5, rtol=1e-4)
    assert reloaded.backend_calls == 1


def test_the_guide_shows_the_example_as_it_is():
    """docs/adding_a_backend.md walks through the file line by line: its code block must be the file's code."""
    code = EXAMPLE.read_text().split('"""', 2)[2].strip()  # after the module docstring
    guide = (EXAMPLE.parents[1] / "adding_a_backend.md").read_text()
    assert f"```python\n{code}\n```" in guide
