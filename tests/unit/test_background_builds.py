"""NOTE [no CPU timing beside a background build] (aitune/torch/tune_strategy/base.py): on a CPU device, candidates
are built and checked while a background child step runs, but timed only after it has finished: a compile in a
child process on the same cores slows every measurement beside it by an order of magnitude or more. The
background step here is a real child process (aitune.torch.backend.isolation)."""

import time
from pathlib import Path

import torch

import aitune.torch as ait
from aitune.torch.search import evaluation
from aitune.torch.backend import TorchEagerBackend


def step_wait(seconds: float) -> dict:
    """The child's build step (run in a fresh process): busy for ``seconds``, then says when it finished."""
    end = time.time() + seconds
    while time.time() < end:
        pass
    return {"finished": time.time()}


class ChildBuiltBackend(TorchEagerBackend):
    """Eager, whose build has a child-process step that can run in the background (as AOTInductor's compile)."""

    name = "test_child_built"
    passthrough = False

    @property
    def builds_in_background(self) -> bool:
        return True

    def _build(self, module, graph, device, workdir):
        from aitune.torch.backend.isolation import submit_isolated

        super()._build(module, graph, device, workdir)
        # the strategy always provides the executor for a background build (None would fail the test: FINISHED)
        self._pending = submit_isolated(f"{__name__}:step_wait", {"seconds": 3.0}, timeout_s=120,
                                        log_path=Path(workdir) / "child.log")

    def _finish_build(self):
        FINISHED.append(self._pending.result()["finished"])


class PlainBackend(TorchEagerBackend):
    name = "test_plain"
    passthrough = False


FINISHED: list[float] = []


def test_cpu_candidates_are_timed_only_after_the_background_build(fast_profiling, monkeypatch):
    FINISHED.clear()
    timed: list[tuple[str, float]] = []
    real = evaluation.measure_backend

    def observed(backend, context, config):
        timed.append((backend.name, time.time()))
        return real(backend, context, config)

    monkeypatch.setattr(evaluation, "measure_backend", observed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    # The plain candidate comes first: the background child starts first and runs while it is evaluated.
    strategy = ait.MaxThroughputStrategy([PlainBackend(), ChildBuiltBackend()], profiling_config=fast_profiling)
    tuned = ait.Module(model, "mlp", strategy=strategy)
    report = ait.tune(tuned, [torch.randn(4, 16), torch.randn(8, 16)], ready_batches=True)

    rows = {row.backend: row for row in report.rows}
    assert len(FINISHED) == 1  # the child ran in the background: finish_build() waited for it
    plain_timings = [at for name, at in timed if name == "test_plain"]
    assert plain_timings and min(plain_timings) >= FINISHED[0]  # not one timing while the child ran
    for name in ("test_plain", "test_child_built"):
        assert rows[name].status in ("passed", "selected") and rows[name].speedup is not None
        assert rows[name].measurement["p50_ms"] > 0
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(tuned(x), model(x))


def test_a_finalist_measured_again_loses_the_quick_round_s_noise_note(fast_profiling, monkeypatch):
    """A finalist measured cleanly must not keep a "noisy measurement" note from its quick
    round. Fault injection: the first (quick) measurement of one candidate is reported as very noisy."""
    import dataclasses

    real = evaluation.measure_backend
    calls: list[str] = []

    def noisy_first(backend, context, config):
        measurement = real(backend, context, config)
        calls.append(backend.name)
        if backend.name == "test_plain" and calls.count("test_plain") == 1:
            return dataclasses.replace(measurement, noise=5.0)
        return measurement

    monkeypatch.setattr(evaluation, "measure_backend", noisy_first)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    strategy = ait.MaxThroughputStrategy([PlainBackend(), ChildBuiltBackend()], profiling_config=fast_profiling)
    report = ait.tune(ait.Module(model, "mlp", strategy=strategy), [torch.randn(4, 16)], ready_batches=True)
    row = next(row for row in report.rows if row.backend == "test_plain")
    assert calls.count("test_plain") == 2  # the quick round, then again as a finalist
    assert row.details["finalist"] and "(±500%)" not in row.reason and row.measurement["noise"] < 5.0
    # the note that is left, if any, is the second measurement's own
    assert ("noisy measurement" in row.reason) == (row.measurement["noise"] > evaluation.NOISY)
