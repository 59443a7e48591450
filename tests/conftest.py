"""Shared test fixtures: an isolated cache directory and fast profiling settings."""

import os
import shutil
import sys
import tempfile

import pytest
import torch

from aitune.torch.measure.profiling import ProfilingConfig


_SESSION_CACHE: list[str] = []
_EXIT_STATUS = pytest.StashKey[int]()


def pytest_configure(config):
    """The whole session (module- and session-scoped fixtures, subprocesses too) tunes into a temporary cache,
    never the user's ``~/.cache/aitune`` (a module-scoped fixture's report would land there and overwrite
    ``tuning_data/report.json``); each test then gets its own below (``_isolated_cache``)."""
    _SESSION_CACHE.append(tempfile.mkdtemp(prefix="aitune-tests-"))
    os.environ["AITUNE_CACHE_DIR"] = _SESSION_CACHE[0]
    # the native weight watch (NOTE [native watch]) is built once for the session, its subprocesses included
    os.environ.setdefault("AITUNE_NATIVE_DIR", os.path.join(_SESSION_CACHE[0], "native"))


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Remove the session's cache, then end the process with pytest's exit status without tearing the interpreter
    down: one of five fresh-clone runs of the suite (2026-12-06) printed "1100 passed" and then died of a
    segmentation fault during interpreter shutdown (native libraries' threads and finalizers: Inductor's compile
    workers, OpenMP, ONNX Runtime), which turned a passing run into exit status 139. Every result is reported
    before this point; the cause is not found yet, so the crash is sidestepped here, not fixed."""
    for path in _SESSION_CACHE:
        shutil.rmtree(path, ignore_errors=True)
    status = config.stash.get(_EXIT_STATUS, None)
    if status is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AITUNE_CACHE_DIR", str(tmp_path / "aitune-cache"))
    torch.manual_seed(0)


@pytest.fixture
def fake_clock(monkeypatch):
    """aitune's timers read a :class:`fake_clock.FakeClock` (tests/fake_clock.py) for this test: durations are the
    pauses the test's code makes with ``fake_clock.pause`` (plus 1 us per clock reading), whatever the machine's
    load. Returns the clock."""
    import fake_clock
    from aitune.torch.measure import profiling
    from aitune.torch.jit import inspection_records

    clock = fake_clock.FakeClock()
    monkeypatch.setattr(inspection_records, "_clock", clock)
    fake_clock.install(clock)
    with profiling.use_clock(clock.nanoseconds):
        yield clock
    fake_clock.install(None)


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
