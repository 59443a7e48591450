"""What the user's console shows while tuning: progress by default on a
terminal, off with one switch; other packages' warnings go to the candidate's build log, not the console."""

import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch

import aitune.torch as ait
from aitune.torch.backend import TorchEagerBackend


class NoisyBackend(TorchEagerBackend):
    """Builds like eager, but emits what third-party packages emit while compiling."""

    name = "test_noisy"
    passthrough = False

    def _build(self, module, graph, device, workdir):
        warnings.warn("torch.jit.script_method is deprecated", DeprecationWarning)
        logging.getLogger("torch.onnx._internal.exporter._registration").warning(
            "torchvision is not installed. Skipping torchvision::nms")
        super()._build(module, graph, device, workdir)


def _tune(progress, fast_profiling):
    model = torch.nn.Linear(8, 4).eval()
    tuned = ait.Module(model, "noisy", strategy=ait.OneBackendStrategy(NoisyBackend(), profiling_config=fast_profiling)
                       .enable_performance_validation(False))
    return ait.tune(tuned, [torch.randn(2, 8)], progress=progress, ready_batches=True)


def test_third_party_warnings_go_to_the_build_log(fast_profiling, capsys, caplog):
    torch_logger = logging.getLogger("torch")
    before = (list(torch_logger.handlers), torch_logger.propagate)
    with caplog.at_level(logging.WARNING):
        with warnings.catch_warnings(record=True) as shown:
            warnings.simplefilter("always")
            report = _tune(False, fast_profiling)
    captured = capsys.readouterr()
    assert "torchvision" not in captured.err + captured.out
    assert not [r for r in caplog.records if "torchvision" in r.getMessage()]
    assert not [w for w in shown if "script_method" in str(w.message)]
    log = open(report.rows[0].log_path).read()
    assert "torchvision is not installed" in log and "script_method is deprecated" in log
    assert (list(torch_logger.handlers), torch_logger.propagate) == before  # put back after the build


def test_progress_shows_module_candidate_and_choice(fast_profiling, capsys):
    _tune(True, fast_profiling)
    err = capsys.readouterr().err
    assert "noisy/graph0" in err and "chose NoisyBackend" in err


def test_progress_is_off_when_not_a_terminal_or_switched_off(fast_profiling, capsys, monkeypatch):
    _tune(None, fast_profiling)  # pytest's captured stderr is not a terminal
    assert "noisy/graph0" not in capsys.readouterr().err
    monkeypatch.setenv("AITUNE_PROGRESS", "1")
    _tune(None, fast_profiling)
    assert "noisy/graph0" in capsys.readouterr().err
    monkeypatch.setenv("AITUNE_PROGRESS", "0")
    _tune(True, fast_profiling)  # an explicit argument wins over the environment
    assert "noisy/graph0" in capsys.readouterr().err


def test_misspelled_keywords_list_the_valid_ones():
    import pytest

    from aitune.errors import UnknownArgumentError
    from aitune.torch.backend import TorchInductorJitBackendConfig

    with pytest.raises(UnknownArgumentError, match=r"'mdoe' \(did you mean 'mode'\?\); valid: .*fullgraph, memory_format, mode"):
        TorchInductorJitBackendConfig(mdoe="default")
    with pytest.raises(TypeError, match="did you mean 'profiling_config'"):  # still a TypeError, as Python's
        ait.MaxThroughputStrategy(profling_config=None)
    with pytest.raises(UnknownArgumentError, match="latency_budget_ms, probe_config"):
        ait.LatencyBudgetStrategy(5.0, budget=3)
    for config_class in (ait.Tolerance, ait.ProfilingConfig, ait.ProbeConfig, ait.GuardConfig):
        with pytest.raises(UnknownArgumentError, match="valid: "):
            config_class(no_such_field=1)
    wrapped = ait.Module(torch.nn.Linear(4, 4).eval(), "kw")
    with pytest.raises(UnknownArgumentError, match=r"tune\(\) .*'batch_size' \(did you mean 'batch_sizes'\?\)"):
        ait.tune(wrapped, [torch.randn(4)], batch_size=[1, 2])  # the entry points too, before any work
    with pytest.raises(UnknownArgumentError, match=r"save\(\) .*'storge' \(did you mean 'storage'\?\)"):
        ait.save(wrapped, "kw.ait", storge=None)
    with pytest.raises(UnknownArgumentError, match=r"inspect\(\) .*did you mean 'number_of_iterations'"):
        ait.inspect(wrapped, [torch.randn(4)], number_of_iteration=3)


def test_two_wrapped_modules_with_one_name_are_refused(fast_profiling):
    import pytest

    from aitune.errors import ConfigError

    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x))

    pair = Pair()
    pair.a = ait.Module(pair.a, "layer")
    b_info = ait.ModuleInfo(module=pair.b, name="layer", parent=pair, attribute="b", depth=1)
    with pytest.raises(ConfigError, match="two wrapped modules would be named 'layer'"):
        ait.wrap(pair, [b_info])
    pair.b = ait.Module(pair.b, "layer")
    with pytest.raises(ConfigError, match="two wrapped modules are named 'layer'"):
        ait.tune(pair, [torch.randn(2, 4)], ready_batches=True)


_LOGGING_SCRIPT = r"""
import json, logging, sys

import torch

root, package = logging.getLogger(), logging.getLogger("aitune")
root.addHandler(logging.StreamHandler(sys.stderr))  # the application's own logging setup
root.setLevel(logging.WARNING)


def snapshot():
    return {"root_handlers": [id(h) for h in root.handlers], "root_level": root.level,
            "root_filters": [[id(f) for f in h.filters] for h in root.handlers],
            "aitune": [len(package.handlers), package.level, package.propagate],
            "torch_level": logging.getLogger("torch").level, "warnings_captured": logging._warnings_showwarning is not None}


seen = {"before": snapshot()}
import aitune.torch as ait
from aitune.torch.backend import TorchEagerBackend

seen["import"] = snapshot()


class Candidate(TorchEagerBackend):
    name = "logging_candidate"
    passthrough = False


profiling = ait.ProfilingConfig(warmup_rounds=1, warmup_s=0.0, min_rounds=3, max_rounds=5, time_budget_s=0.05)
model = torch.nn.Linear(8, 4).eval()
tuned = ait.Module(model, "logged", strategy=ait.MaxThroughputStrategy([Candidate()], profiling_config=profiling))
ait.tune(tuned, [torch.randn(2, 8), torch.randn(4, 8)], ready_batches=True)
tuned(torch.randn(3, 8))
seen["tune"] = snapshot()
path = ait.save(tuned, sys.argv[1])
ait.load(ait.Module(torch.nn.Linear(8, 4).eval(), "logged"), path)
seen["load"] = snapshot()
print(json.dumps(seen))
"""


def test_aitune_never_configures_logging(tmp_path):
    """README "Progress and console": aitune never configures logging. In a fresh process with the
    application's own root handler, importing aitune, tuning (a candidate is built, so build logs are captured)
    and saving and loading leave the root logger's handlers, their filters and its level, the "aitune"
    logger and the capture of warnings as they were."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                       os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", _LOGGING_SCRIPT, str(tmp_path / "logged.ait")], env=env,
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    before = seen["before"]
    assert before["root_level"] == logging.WARNING and len(before["root_handlers"]) == 1
    assert before["aitune"] == [0, logging.NOTSET, True] and not before["warnings_captured"]
    for step in ("import", "tune", "load"):
        assert seen[step] == before, step
