"""run_isolated: every way a child step can end, with real crashes (no mocks)."""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from pathlib import Path

import pytest

from aitune.errors import BackendBuildError, ConfigError, IsolatedStepError
from aitune.torch.backend.isolation import run_isolated

HERE = f"{Path(__file__).stem}"


# ---- targets, run in the child (imported there through the parent's sys.path)
def step_ok(path: str, value: int) -> dict:
    Path(path).write_text(str(value * 2))
    print("step_ok wrote", path)
    return {"doubled": value * 2, "pid": os.getpid()}


def step_abort() -> dict:
    os.abort()


def step_segfault() -> dict:
    ctypes.string_at(0)  # reads address 0: SIGSEGV
    return {}


def step_sleep(seconds: float, marker: str) -> dict:
    Path(marker).write_text(f"started {os.getpid()}")
    time.sleep(seconds)
    Path(marker).write_text("finished")
    return {}


def step_raise(message: str) -> dict:
    raise ValueError(message)


def step_exit(code: int) -> dict:
    sys.stdout.flush()
    os._exit(code)


def step_not_a_dict() -> list:
    return [1, 2]


def _target(name: str) -> str:
    return f"{__name__}:{name}"


def test_success_returns_result_and_writes_log(tmp_path):
    output = tmp_path / "out.txt"
    log_path = tmp_path / "logs" / "step.log"
    result = run_isolated(_target("step_ok"), {"path": str(output), "value": 21}, timeout_s=120, log_path=log_path)
    assert result["doubled"] == 42
    assert result["pid"] != os.getpid()  # ran in another process
    assert output.read_text() == "42"
    assert "step_ok wrote" in log_path.read_text()
    request = json.loads(log_path.with_name("step.request.json").read_text())
    assert request["target"] == _target("step_ok") and request["kwargs"]["value"] == 21


def test_abort_becomes_error_with_signal(tmp_path):
    log_path = tmp_path / "abort.log"
    with pytest.raises(IsolatedStepError) as info:
        run_isolated(_target("step_abort"), {}, timeout_s=120, log_path=log_path)
    error = info.value
    assert isinstance(error, BackendBuildError)
    assert "aborted (SIGABRT)" in str(error)
    assert error.signal_name == "SIGABRT" and error.returncode < 0
    assert error.log_path == log_path


def test_segfault_becomes_error_with_signal(tmp_path):
    log_path = tmp_path / "segv.log"
    with pytest.raises(IsolatedStepError) as info:
        run_isolated(_target("step_segfault"), {}, timeout_s=120, log_path=log_path)
    assert str(info.value).startswith("killed by signal SIGSEGV")
    assert info.value.signal_name == "SIGSEGV"
    assert "Segmentation fault" in log_path.read_text()  # faulthandler's dump lands in the log


def test_hang_is_killed_at_timeout(tmp_path):
    marker = tmp_path / "marker.txt"
    with pytest.raises(IsolatedStepError) as info:
        run_isolated(_target("step_sleep"), {"seconds": 60, "marker": str(marker)}, timeout_s=8.0,
                     log_path=tmp_path / "sleep.log")
    assert str(info.value).startswith("timed out after 8.0 s")
    assert info.value.timed_out and info.value.returncode is None
    state, pid = marker.read_text().split()
    assert state == "started"  # the child really started and never finished its 60 s...
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid), 0)  # ...and is gone (killed and reaped) when run_isolated returns: not waited for


def test_exception_reports_type_and_message(tmp_path):
    log_path = tmp_path / "raise.log"
    with pytest.raises(IsolatedStepError) as info:
        run_isolated(_target("step_raise"), {"message": "bad input shape [3, 4]"}, timeout_s=120, log_path=log_path)
    assert str(info.value).startswith("ValueError: bad input shape [3, 4]")
    assert info.value.error_type == "ValueError" and info.value.returncode == 1
    assert "Traceback" in log_path.read_text()


def test_exit_code_and_bad_result(tmp_path):
    with pytest.raises(IsolatedStepError, match="exited with code 3"):
        run_isolated(_target("step_exit"), {"code": 3}, timeout_s=120, log_path=tmp_path / "exit.log")
    with pytest.raises(IsolatedStepError, match="TypeError: .*expected a JSON-able dict"):
        run_isolated(_target("step_not_a_dict"), {}, timeout_s=120, log_path=tmp_path / "list.log")
    with pytest.raises(IsolatedStepError, match="ModuleNotFoundError"):
        run_isolated("no_such_module_xyz:f", {}, timeout_s=120, log_path=tmp_path / "missing.log")


def test_invalid_arguments(tmp_path):
    with pytest.raises(ConfigError, match="package.module:function"):
        run_isolated("no_colon", {}, timeout_s=1, log_path=tmp_path / "x.log")
    with pytest.raises(ConfigError, match="JSON-able"):
        run_isolated(_target("step_ok"), {"path": object()}, timeout_s=1, log_path=tmp_path / "x.log")
    with pytest.raises(ConfigError, match="timeout_s"):
        run_isolated(_target("step_ok"), {}, timeout_s=0, log_path=tmp_path / "x.log")
