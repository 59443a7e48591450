"""An AOT-only checkpoint (ONNX Runtime, real) loaded into modules with the same, other or no weights.

The artifacts carry the weights the module was tuned with; every call of a loaded module must come from one
model (NOTE [one model per loaded module] in aitune/torch/checkpoint/load.py): the checkpoint's, or with
``weights="module"`` the loaded module's own, and the user is told when the two differ.
"""

from __future__ import annotations

import json
import logging
import zipfile
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import aitune.torch as ait
from aitune.errors import BackendRuntimeError, CheckpointError, ConfigError
from aitune.torch.backend import ONNXRuntimeBackend
from aitune.torch.measure.profiling import ProfilingConfig

pytestmark = pytest.mark.skipif(not ONNXRuntimeBackend.availability().ok,
                                reason=ONNXRuntimeBackend.availability().reason)

FAST = ProfilingConfig(warmup_rounds=1, min_rounds=3, max_rounds=10, time_budget_s=0.1)
INSIDE = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))  # batch 3: within the tuned 2..4
OUTSIDE = torch.randn(9, 8, generator=torch.Generator().manual_seed(2))  # batch 9: the artifact refuses it


class MLP(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x):
        return self.layers(x)


def fine_tuned() -> MLP:
    """The tuned model with its last layer changed: the same class and shapes, another model."""
    model = MLP(seed=0).eval()
    with torch.no_grad():
        model.layers[2].weight.add_(0.3 * torch.randn(4, 16, generator=torch.Generator().manual_seed(5)))
    return model


def eager(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    module = ait.Module(MLP(seed=0).eval(), "mlp", strategy=ait.OneBackendStrategy(
        ONNXRuntimeBackend(), profiling_config=FAST).enable_performance_validation(False))
    ait.tune(module, [torch.randn(2, 8), torch.randn(4, 8)], cache_dir_path=root / "cache", ready_batches=True)
    assert module.backends["graph0"].name == "onnxruntime"
    path = ait.save(module, root / "mlp.ait")
    return SimpleNamespace(path=path, tuned=MLP(seed=0).eval())


def load_quietly(target, checkpoint, caplog, **options):
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="aitune"):
        loaded = ait.load(target, checkpoint.path, **options)
    return loaded, " ".join(record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING)


def test_the_manifest_records_the_weights_the_artifacts_carry(checkpoint):
    with zipfile.ZipFile(checkpoint.path) as zf:
        entry = json.loads(zf.read("manifest.json"))["modules"][0]
    assert entry["weights"] is None
    from aitune.torch.checkpoint.manifest import weights_digest

    assert entry["weights_sha256"] == weights_digest(MLP(seed=0))
    assert entry["weights_sha256"] != weights_digest(fine_tuned())


def test_the_same_weights_answer_every_call(checkpoint, caplog):
    loaded, warnings = load_quietly(MLP(seed=0).eval(), checkpoint, caplog)
    assert warnings == ""
    torch.testing.assert_close(eager(loaded, INSIDE), eager(checkpoint.tuned, INSIDE), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(eager(loaded, OUTSIDE), eager(checkpoint.tuned, OUTSIDE))  # eager: the same model
    assert loaded.stats["backend_calls"] == 1 and loaded.stats["eager_fallbacks"] == {"range": 1}
    assert loaded.needs_retune is None


def test_other_weights_by_default_run_the_checkpoints_model_and_say_so(checkpoint, caplog):
    other = fine_tuned()
    assert (eager(other, INSIDE) - eager(checkpoint.tuned, INSIDE)).abs().max() > 0.1  # really another model
    loaded, warnings = load_quietly(other, checkpoint, caplog)
    assert "mlp's weights differ from those" in warnings
    assert "weights='checkpoint'" in warnings and "weights='module'" in warnings
    torch.testing.assert_close(eager(loaded, INSIDE), eager(checkpoint.tuned, INSIDE), rtol=1e-5, atol=1e-5)
    with pytest.raises(BackendRuntimeError, match="weights differ.*weights='module'"):
        eager(loaded, OUTSIDE)  # never the module's other weights


def test_weights_checkpoint_runs_only_the_checkpoints_model_without_a_warning(checkpoint, caplog):
    loaded, warnings = load_quietly(fine_tuned(), checkpoint, caplog, weights="checkpoint")
    assert warnings == ""
    torch.testing.assert_close(eager(loaded, INSIDE), eager(checkpoint.tuned, INSIDE), rtol=1e-5, atol=1e-5)
    caplog.clear()
    refused = "outside.*eager may not run.*weights differ"
    with caplog.at_level("WARNING"), pytest.raises(BackendRuntimeError, match=refused):
        eager(loaded, OUTSIDE)  # the error says what the artifact could not take, and why eager may not run it
    assert "run eager" not in caplog.text  # nothing claims the call ran eagerly
    assert loaded.needs_retune is None
    assert loaded.stats["guard"] == {}  # the guard compares with eager, which is the other model here


def test_weights_module_runs_only_the_modules_own_weights(checkpoint, caplog):
    other = fine_tuned()
    loaded, _ = load_quietly(other, checkpoint, caplog, weights="module")
    torch.testing.assert_close(eager(loaded, INSIDE), eager(fine_tuned(), INSIDE), rtol=0, atol=0)
    torch.testing.assert_close(eager(loaded, OUTSIDE), eager(fine_tuned(), OUTSIDE), rtol=0, atol=0)
    assert "weights differ from those the checkpoint was tuned with" in loaded.needs_retune
    assert "needs re-tune" in repr(loaded)
    assert loaded.stats["backend_calls"] == 0 and loaded.stats["eager_fallbacks"] == {"stale": 2}


def test_weights_module_with_the_same_weights_uses_the_artifacts(checkpoint, caplog):
    loaded, warnings = load_quietly(MLP(seed=0).eval(), checkpoint, caplog, weights="module")
    assert warnings == "" and loaded.needs_retune is None
    torch.testing.assert_close(eager(loaded, INSIDE), eager(checkpoint.tuned, INSIDE), rtol=1e-5, atol=1e-5)
    assert loaded.stats["backend_calls"] == 1


def test_meta_and_random_modules_load_the_checkpoints_model(checkpoint, caplog):
    with torch.device("meta"):
        empty = MLP(seed=0).eval()
    loaded, warnings = load_quietly(empty, checkpoint, caplog)
    assert warnings == ""  # no weights: nothing to confuse with the checkpoint's
    torch.testing.assert_close(eager(loaded, INSIDE), eager(checkpoint.tuned, INSIDE), rtol=1e-5, atol=1e-5)
    with pytest.raises(BackendRuntimeError, match="without weights"):
        eager(loaded, OUTSIDE)
    with torch.device("meta"):
        empty = MLP(seed=0).eval()
    with pytest.raises(CheckpointError, match="weights='module' runs the weights of the module.*has none"):
        ait.load(empty, checkpoint.path, weights="module")
    assert not isinstance(empty, ait.Module) and empty.layers[0].weight.is_meta  # nothing was touched

    randomly_initialised = MLP(seed=77).eval()  # the reference system's way: build, then load
    loaded, warnings = load_quietly(randomly_initialised, checkpoint, caplog, weights="checkpoint")
    torch.testing.assert_close(eager(loaded, INSIDE), eager(checkpoint.tuned, INSIDE), rtol=1e-5, atol=1e-5)
    with pytest.raises(BackendRuntimeError, match="weights differ"):
        eager(loaded, OUTSIDE)


def test_a_bad_weights_choice_is_a_config_error(checkpoint):
    with pytest.raises(ConfigError, match=r"weights must be None \(the default\), 'checkpoint' or 'module', "
                                          r"got 'mine'"):
        ait.load(MLP(seed=0).eval(), checkpoint.path, weights="mine")


def test_weights_module_keeps_a_jit_modules_own_weights(tmp_path):
    """A JIT checkpoint stores the weights and loads them into the module; ``weights="module"`` keeps the
    module's own (its JIT backends are rebuilt from them), so every call is that module's model too."""
    from aitune.torch.backend import TorchEagerBackend

    module = ait.Module(MLP(seed=0).eval(), "mlp", strategy=ait.OneBackendStrategy(
        TorchEagerBackend(), profiling_config=FAST).enable_performance_validation(False))
    ait.tune(module, [torch.randn(2, 8), torch.randn(4, 8)], cache_dir_path=tmp_path / "cache", ready_batches=True)
    path = ait.save(module, tmp_path / "jit.ait")

    kept = ait.load(fine_tuned(), path, weights="module")
    torch.testing.assert_close(eager(kept, INSIDE), eager(fine_tuned(), INSIDE), rtol=0, atol=0)
    torch.testing.assert_close(kept.layers[2].weight, fine_tuned().layers[2].weight, rtol=0, atol=0)
    restored = ait.load(fine_tuned(), path)  # the default loads the stored weights, as before
    torch.testing.assert_close(eager(restored, INSIDE), eager(MLP(seed=0).eval(), INSIDE), rtol=0, atol=0)
