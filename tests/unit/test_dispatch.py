"""A tuned module's calls (aitune/torch/dispatch.py): the per-call check that an artifact may serve a call, and
the import layers of the wrapper (module.py never reaches the orchestrator above it)."""

import ast
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import aitune.torch as ait
from aitune.torch.backend import TorchEagerBackend

PACKAGE = Path(ait.__file__).parent


class EvalModeBatchNorm(TorchEagerBackend):
    """Serves the graph itself (not a passthrough), as an artifact traced in eval mode would: batch norm with
    the running statistics, whatever the module's training flag says now."""

    name = "test_eval_mode_batch_norm"
    passthrough = False

    def _infer(self, args, kwargs):
        linear, norm = self.module.linear, self.module.norm
        return F.batch_norm(linear(kwargs["x"]), norm.running_mean, norm.running_var, norm.weight, norm.bias,
                            training=False, eps=norm.eps)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.norm = nn.Linear(4, 4), nn.BatchNorm1d(4)

    def forward(self, x):
        return self.norm(self.linear(x))


def test_an_artifact_tuned_in_eval_does_not_serve_a_module_in_training(fast_profiling):
    model = Net().eval()
    strategy = ait.OneBackendStrategy(EvalModeBatchNorm(), profiling_config=fast_profiling)
    tuned = ait.Module(model, "net", strategy=strategy.enable_performance_validation(False),
                       guard=ait.GuardConfig(enabled=False))
    ait.tune(tuned, [torch.randn(3, 4)], ready_batches=True)
    assert tuned.backends["graph0"].name == "test_eval_mode_batch_norm"
    x = torch.randn(3, 4) * 5 + 2  # far from the running statistics: eval and training outputs differ
    with torch.no_grad():
        in_eval = model(x)
        torch.testing.assert_close(tuned(x), in_eval)
        assert tuned.stats["backend_calls"] == 1
        model.train()
        in_training = tuned(x)  # eager, with the batch statistics
        torch.testing.assert_close(in_training, model(x))
        assert not torch.allclose(in_training, in_eval, atol=1e-2)
        assert tuned.stats["eager_fallbacks"] == {"training": 1} and tuned.stats["backend_calls"] == 1
        model.eval()
        torch.testing.assert_close(tuned(x), model(x))
        assert tuned.stats["backend_calls"] == 2


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):  # every import, function-local ones too
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_wrapper_never_imports_the_orchestrator():
    # pyproject.toml [tool.importlinter]: tuning sits above module and dispatch; Module.tune gets it handed in
    for path in (PACKAGE / "module.py", PACKAGE / "dispatch.py"):
        assert "aitune.torch.tuning" not in _imported_modules(path), path.name
