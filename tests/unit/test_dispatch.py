"""A tuned module's calls (aitune/torch/dispatch.py): the per-call check that an artifact may serve a call, and
the import layers of the wrapper (module.py never reaches the orchestrator above it)."""

import ast
import copy
from pathlib import Path

import pytest
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


class BakedCopy(TorchEagerBackend):
    """Serves a copy of the module taken at build, as an artifact that baked the module in would (weights,
    training flags, hooks as they were)."""

    name = "test_baked_copy"
    passthrough = False

    @property
    def bakes_weights(self) -> bool:
        return True

    def _build(self, module, graph, device, workdir) -> None:
        super()._build(module, graph, device, workdir)
        self._copy = copy.deepcopy(module)

    def _infer(self, args, kwargs):
        with torch.no_grad():
            return self._copy(*args, **kwargs)


def test_a_warm_route_still_obeys_every_change_it_could_skip(fast_profiling):
    """Calls shaped like the last ones take the dispatch's fast route (NOTE [dispatch fast path]); each check on
    that route must still see what changed between two calls: a hook, the training flag, grad mode with an input
    or a parameter that requires grad, an input with nan, weights edited in place. Each case compares with eager
    under the same state and is then put back, and the backend serves again."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 4)).eval()
    strategy = ait.OneBackendStrategy(BakedCopy(), profiling_config=fast_profiling)
    tuned = ait.Module(model, "warm", strategy=strategy.enable_performance_validation(False),
                       guard=ait.GuardConfig(enabled=False))
    ait.tune(tuned, [torch.randn(3, 4)], ready_batches=True)
    x = torch.randn(3, 4) * 5 + 2

    def served(expected_calls):
        with torch.no_grad():
            torch.testing.assert_close(tuned(x), model(x))
        assert tuned.backend_calls == expected_calls, tuned.stats

    for calls in (1, 2, 3):  # the route is warm from here on
        served(calls)
    with torch.no_grad():
        handle = model[0].register_forward_hook(lambda module, inputs, output: output * 2)
        torch.testing.assert_close(tuned(x), model(x))  # the hook runs: eager
        handle.remove()
    served(4)
    model.train()
    with torch.no_grad():
        torch.manual_seed(0)
        dropped = tuned(x)  # dropout: eager
        torch.manual_seed(0)
        torch.testing.assert_close(dropped, model(x))
    model.eval()
    served(5)
    model.requires_grad_(False)  # grad mode on: served while nothing requires grad
    assert torch.is_grad_enabled() and tuned(x).grad_fn is None and tuned.backend_calls == 6
    leaf = x.clone().requires_grad_(True)
    output = tuned(leaf)  # grad mode on and the input requires grad: eager's graph
    assert output.grad_fn is not None
    torch.testing.assert_close(output, model(leaf))
    model[2].weight.requires_grad_(True)
    output = tuned(x)  # a parameter requires grad: eager's graph
    assert output.grad_fn is not None
    torch.testing.assert_close(output, model(x))
    model.requires_grad_(False)
    served(7)
    bad = x.clone()
    bad[0, 0] = float("nan")
    with torch.no_grad():
        torch.testing.assert_close(tuned(bad), model(bad), equal_nan=True)
    served(8)
    assert tuned.stats["eager_fallbacks"] == {"hooks": 1, "training": 1, "grad": 2, "values": 1}
    with torch.no_grad():
        model[0].weight.mul_(2)  # the copy holds the old weights: eager from now on
        torch.testing.assert_close(tuned(x), model(x))
    assert tuned.backend_calls == 8 and tuned.needs_retune


class ServesTheModule(TorchEagerBackend):
    """Runs the module through the backend's own path (not a passthrough), so the dispatch routes, normalises and
    counts its calls as it does a compiled artifact's."""

    name = "test_serves_the_module"
    passthrough = False


class PositionalOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x, /):
        return self.linear(x).relu()


class VarArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, *xs):
        return self.linear(xs[0] - xs[1])


@pytest.mark.parametrize("model_class", [PositionalOnly, VarArgs])
def test_a_forward_with_positional_only_parameters_or_var_args_is_served_on_every_call(model_class, fast_profiling):
    # such a signature has no normalising plan: the dispatch kept None as the fast route's plan and called it
    model = model_class().eval()
    inputs = (torch.randn(2, 4),) if model_class is PositionalOnly else (torch.randn(2, 4), torch.randn(2, 4))
    strategy = ait.OneBackendStrategy(ServesTheModule(), profiling_config=fast_profiling)
    tuned = ait.Module(model, "signature", strategy=strategy.enable_performance_validation(False),
                       guard=ait.GuardConfig(enabled=False))
    ait.tune(tuned, [inputs], ready_batches=True)
    with torch.no_grad():
        for calls in (1, 2, 3):
            torch.testing.assert_close(tuned(*inputs), model(*inputs), rtol=0, atol=0)
            assert tuned.backend_calls == calls, tuned.stats


@pytest.mark.parametrize("backend_class", [TorchEagerBackend, ServesTheModule])
def test_hooks_of_the_wrapped_module_see_the_call_as_the_caller_made_it(backend_class, fast_profiling):
    # NOTE [calls as given]: recording and eager runs pass the caller's positional arguments on, so a pre-hook that
    # reads args[0] works as without aitune (it saw args == () and raised IndexError)
    model = Net().eval()
    seen = []

    def doubling(module, args):
        seen.append(len(args))
        return (args[0] * 2,)

    strategy = ait.OneBackendStrategy(backend_class(), profiling_config=fast_profiling)
    tuned = ait.Module(model, "hooked", strategy=strategy.enable_performance_validation(False),
                       guard=ait.GuardConfig(enabled=False))
    ait.tune(tuned, [torch.randn(3, 4)], ready_batches=True)
    x = torch.randn(3, 4)
    handle = model.register_forward_pre_hook(doubling)
    late = model.register_forward_hook(lambda module, inputs, output: output + inputs[0].sum())
    with torch.no_grad():
        torch.testing.assert_close(tuned(x), model(x), rtol=0, atol=0)  # hooks registered: eager, as called
    handle.remove(), late.remove()
    assert seen == [1, 1]

    recording = ait.Module(Net().eval(), "recording", strategy=strategy.enable_performance_validation(False))
    recording.module.register_forward_pre_hook(doubling)
    with torch.no_grad():
        torch.testing.assert_close(recording(x), recording.module(x), rtol=0, atol=0)  # recorded, as called
    assert seen == [1, 1, 1, 1]
    ait.tune(recording, [x], ready_batches=True)  # the checks replay the canonical call: the hook cannot run
    assert "it failed in a forward hook of the module" in recording.tuning_error
    with torch.no_grad():
        torch.testing.assert_close(recording(x), recording.module(x), rtol=0, atol=0)


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


@pytest.mark.parametrize("autocast", [False, True])
def test_a_served_inductor_call_keeps_what_its_build_runs_under(autocast, fast_profiling):
    """NOTE [a bare served call]: with grad mode off, a plain Inductor build answers through its compiled callable
    alone (no contexts entered), and gives eager's values; a bf16-autocast build never takes that path: its served
    calls still run under autocast (bf16 results, cast back to eager's fp32), also under ``no_grad``."""
    from aitune.torch.backend import TorchInductorJitBackend, TorchInductorJitBackendConfig

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    config = TorchInductorJitBackendConfig(autocast_enabled=autocast,
                                           autocast_dtype=torch.bfloat16 if autocast else None)
    strategy = ait.OneBackendStrategy(TorchInductorJitBackend(config), profiling_config=fast_profiling)
    tuned = ait.Module(model, "bare", strategy=strategy.enable_performance_validation(False),
                       guard=ait.GuardConfig(enabled=False))
    x = torch.randn(4, 32)
    ait.tune(tuned, [x], ready_batches=True, ignore_failing_modules=False)
    backend = tuned.backends["graph0"]
    entered = []
    real_autocast = backend._autocast
    backend._autocast = lambda: entered.append(1) or real_autocast()
    with torch.no_grad():
        served = tuned(x)
        exact = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            in_bf16 = model(x).float()
    assert tuned.backend_calls == 1 and served.dtype == torch.float32
    if autocast:
        assert entered == [1]  # under autocast, as at build
        torch.testing.assert_close(served, in_bf16, rtol=2e-2, atol=2e-2)
        assert float((served - exact).abs().max()) > 1e-4  # not an fp32 run
    else:
        assert entered == []  # the compiled callable alone
        torch.testing.assert_close(served, exact, rtol=1e-5, atol=1e-5)
        backend.run(*tuned._self_dispatch.signature.normalize((x,), {}))  # grad mode on: the contexts again
        assert entered == [1]


class RecordsInputs(BakedCopy):
    """BakedCopy that notes whether each served call's input was contiguous (what its artifact received)."""

    name = "test_records_inputs"

    def _infer(self, args, kwargs):
        self.received = [value.is_contiguous() for value in [*args, *kwargs.values()]
                         if isinstance(value, torch.Tensor)]
        return super()._infer(args, kwargs)


@pytest.mark.parametrize("native_key", [True, False])
def test_routes_keyed_in_c_or_python_serve_the_same_calls(native_key, fast_profiling):
    """NOTE [native call key]: a route keyed by the extension skips the per-tensor loop only where its key says every
    tensor is contiguous with elements; a non-contiguous call takes its own route, is served made contiguous, and a
    zero-size call runs eager, whichever function keyed them (the extension's, or flat_call_key without it)."""
    from aitune.torch.check import native_watch

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    strategy = ait.OneBackendStrategy(RecordsInputs(), profiling_config=fast_profiling)
    tuned = ait.Module(model, "keyed", strategy=strategy.enable_performance_validation(False),
                       guard=ait.GuardConfig(enabled=False))
    ait.tune(tuned, [torch.randn(3, 4)], ready_batches=True)
    dispatch = tuned._self_dispatch
    if not native_key:
        dispatch._native_key = None  # (as where the extension is unavailable)
    elif native_watch.native_module() is None:
        pytest.skip(f"the extension is not built here: {native_watch.native_status(build=False)}")
    backend = tuned.backends["graph0"]
    contiguous, transposed, empty = torch.randn(3, 4), torch.randn(4, 3).t(), torch.randn(0, 4)
    with torch.no_grad():
        for round_ in (1, 2):  # the second round takes the routes made in the first
            for x in (contiguous, transposed):
                torch.testing.assert_close(tuned(x), model(x))
                assert backend.received == [True]
            torch.testing.assert_close(tuned(empty), model(empty))
            assert tuned.backend_calls == 2 * round_
    assert tuned.stats["eager_fallbacks"] == {"empty": 2}
    quiet = sorted(route[3] for route in dispatch._routes.values())  # (non-contiguous and empty: one route)
    assert quiet == ([False, True] if native_key else [False])
