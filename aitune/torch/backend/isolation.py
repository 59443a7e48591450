"""Run a file-to-file build step in a child process, so a crash or a hang becomes an error.

Some build steps can take the whole interpreter down: AOTInductor compiles and package loads (on the GPU
machine, ``aoti_load_package`` of any CUDA package dies with SIGSEGV), ONNX -> TensorRT engine builds,
Torch-TensorRT compiles. :func:`run_isolated` runs such a step in a fresh interpreter
(``python -m aitune.torch.backend.isolation REQUEST.json``), waits for it with a timeout, and turns every way it
can end into either the step's JSON result or one :class:`~aitune.errors.IsolatedStepError` whose message is
one line: ``killed by signal SIGSEGV``, ``aborted (SIGABRT)``, ``timed out after 30.0 s``,
``exited with code 3`` or the child's exception type and message.

NOTE [fresh interpreter, never fork]: the parent may hold CUDA state (a context, streams, allocator pools);
a forked child inherits it in a broken state. The child is therefore a new ``sys.executable`` started by
``subprocess`` (no fork of Python state), in its own session so that a timeout kills the compilers it
started as well. The parent's ``sys.path`` is passed through ``PYTHONPATH`` so the child imports the same
``aitune`` and the same target modules (also ones found only through the parent's path, e.g. tests).

Which builds are isolated (and which are not): the Inductor AOT compile + first load, the ONNX -> TensorRT
engine build and the Torch-TensorRT AOT compile run here. **Not isolated** — they run in the tuning process,
where a native crash ends the process and a hang hangs it: Inductor JIT compiles (every mode, max-autotune
included), ``torch.export`` and the ONNX export, ONNX Runtime session creation (with the TensorRT execution
provider that is where engines are built), TorchAO quantization and its compile, Torch-TensorRT JIT, and the
kernel selector's measurements. They hold live Python objects (a compiled module, a session) that cannot be
handed back from a child.

Steps exchange files, not objects: the target receives JSON-able keyword arguments (typically paths)
and returns a JSON-able dict. The request is written next to the log as ``<log stem>.request.json``;
``python -m aitune.torch.backend.isolation <that file>`` reruns the step by hand.
"""

from __future__ import annotations

import contextvars
import faulthandler
import importlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from aitune.errors import ConfigError, IsolatedStepError

logger = logging.getLogger(__name__)

_KILL_GRACE_S = 5.0


def resolve_target(target: str) -> Callable[..., Any]:
    """Import ``"package.module:function"`` (``function`` may be dotted, e.g. ``Class.method``).

    Raises:
        ConfigError: if ``target`` is not of the form ``module:function``.
        ImportError / AttributeError: if the module or the function does not exist.
    """
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigError(f"isolated step target {target!r} must look like 'package.module:function'")
    value: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        value = getattr(value, part)
    if not callable(value):
        raise ConfigError(f"isolated step target {target!r} is not callable")
    return value


# The ``time.perf_counter()`` by which the current candidate's build must end (set by the tuner from the
# time budget); child steps get at most the time left.
BUILD_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("aitune_build_deadline", default=None)


# NOTE [background builds]: while a strategy evaluates other candidates, the child step of an isolated build
# can run at the same time. A backend that supports it submits its step with
# :func:`submit_isolated` when ``BACKGROUND_BUILDS`` holds an executor, and waits in ``finish_build``.
BACKGROUND_BUILDS: contextvars.ContextVar = contextvars.ContextVar("aitune_background_builds", default=None)


def submit_isolated(target: str, kwargs: dict, *, timeout_s: float, log_path: Path | str):
    """:func:`run_isolated` on the executor in ``BACKGROUND_BUILDS`` (a ``Future`` of its result), or None
    when no executor is set (the caller then runs the step itself). The time budget in force now applies."""
    executor = BACKGROUND_BUILDS.get()
    if executor is None:
        return None
    context = contextvars.copy_context()  # carries BUILD_DEADLINE into the worker thread
    return executor.submit(context.run, run_isolated, target, kwargs, timeout_s=timeout_s, log_path=log_path)


def run_isolated(target: str, kwargs: dict, *, timeout_s: float, log_path: Path | str,
                 env: dict[str, str] | None = None) -> dict:
    """Run ``target(**kwargs)`` in a fresh Python process and return its result.

    Args:
        target: ``"package.module:function"``; the function takes ``kwargs`` and returns a JSON-able dict.
        kwargs: JSON-able keyword arguments (paths as strings, numbers, lists, dicts).
        timeout_s: wall-clock limit in seconds (> 0); the child and everything it started are killed after it.
        log_path: file receiving the child's stdout and stderr (created or overwritten; its folder is created).
        env: extra environment variables for the child (on top of this process's environment).

    Returns:
        The dict the target returned (after a JSON round trip).

    Raises:
        ConfigError: ``target`` malformed, ``kwargs`` not JSON-able, ``timeout_s`` not a positive number.
        IsolatedStepError: the child crashed (``killed by signal SIGSEGV``, ``aborted (SIGABRT)``), ran past
            ``timeout_s`` (``timed out after 30.0 s``), exited non-zero, or the target raised (``ValueError: ...``).
            ``log_path`` is set on the error; the child's traceback (or faulthandler dump) is in that file.
    """
    if ":" not in target:
        raise ConfigError(f"isolated step target {target!r} must look like 'package.module:function'")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0 \
            or math.isnan(timeout_s):
        raise ConfigError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
    deadline = BUILD_DEADLINE.get()
    if deadline is not None:  # the tune's time budget caps every child step
        timeout_s = max(1.0, min(timeout_s, deadline - time.perf_counter()))
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    request_path = log_path.with_name(log_path.stem + ".request.json")
    result_path = log_path.with_name(log_path.stem + ".result.json")
    try:
        request = json.dumps({"target": target, "kwargs": kwargs, "result_path": str(result_path)}, indent=1)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"kwargs of isolated step {target!r} must be JSON-able (pass paths as str): {exc}") from exc
    request_path.write_text(request)
    result_path.unlink(missing_ok=True)

    child_env = dict(os.environ)
    child_env.update(env or {})
    child_env["PYTHONPATH"] = _python_path(child_env.get("PYTHONPATH"))
    command = [sys.executable, "-m", "aitune.torch.backend.isolation", str(request_path)]
    logger.info("running %s in a child process (timeout %.1f s, log %s)", target, timeout_s, log_path)
    started = time.perf_counter()
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                   env=child_env, start_new_session=True)
        try:
            returncode = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            elapsed = time.perf_counter() - started
            logger.info("%s timed out after %.1f s; child %d killed", target, elapsed, process.pid)
            raise IsolatedStepError(f"timed out after {float(timeout_s):.1f} s", target=target, timed_out=True,
                                    log_path=log_path) from None
        except BaseException:  # KeyboardInterrupt in the parent: do not leave the child running
            _kill_group(process)
            raise
        finally:
            _kill_leftovers(process)
    elapsed = time.perf_counter() - started
    payload = _read_result(result_path)
    # DEBUG: the candidate's row already says how long its build took and how it ended (at INFO
    # this line stood among the user's progress lines with an internal function name).
    logger.debug("%s finished in %.1f s with exit status %d", target, elapsed, returncode)

    if returncode < 0:
        reason = describe_signal(-returncode)
        if payload is not None and payload.get("ok"):
            reason += " after the step returned (during interpreter shutdown)"
        raise IsolatedStepError(reason, target=target, returncode=returncode, signal_name=_signal_name(-returncode),
                                log_path=log_path)
    if payload is not None and not payload.get("ok", False):
        error_type = payload.get("error_type", "Exception")
        message = payload.get("message", "")
        reason = f"{error_type}: {message}" if message else error_type
        raise IsolatedStepError(reason, target=target, returncode=returncode, error_type=error_type,
                                log_path=log_path)
    if returncode != 0:
        raise IsolatedStepError(f"exited with code {returncode}", target=target, returncode=returncode,
                                log_path=log_path)
    if payload is None:
        raise IsolatedStepError("exited with code 0 without writing a result", target=target, returncode=0,
                                log_path=log_path)
    return payload.get("result", {})


def describe_signal(number: int) -> str:
    """One-line reason for a child killed by signal ``number`` (e.g. ``killed by signal SIGSEGV``)."""
    name = _signal_name(number)
    if number == getattr(signal, "SIGABRT", None):
        return f"aborted ({name})"
    if number == getattr(signal, "SIGKILL", None):
        return f"killed by signal {name} (out of memory, or killed from outside)"
    return f"killed by signal {name}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _python_path(existing: str | None) -> str:
    entries = [entry or os.getcwd() for entry in sys.path]
    if existing:
        entries.extend(existing.split(os.pathsep))
    unique = list(dict.fromkeys(entry for entry in entries if entry))
    return os.pathsep.join(unique)


def _kill_group(process: subprocess.Popen) -> None:
    """Kill the child and every process of its session (compilers it started), then reap it."""
    if hasattr(os, "killpg"):
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    else:  # pragma: no cover - non-POSIX
        process.kill()
    try:
        process.wait(timeout=_KILL_GRACE_S)
    except subprocess.TimeoutExpired:  # pragma: no cover - a process stuck in the kernel
        logger.warning("child %d did not exit after SIGKILL", process.pid)


def _kill_leftovers(process: subprocess.Popen) -> None:
    """After the child died abnormally, kill what it left running in its process group (orphaned workers)."""
    if process.returncode in (None, 0) or not hasattr(os, "killpg"):
        return
    try:
        os.killpg(process.pid, signal.SIGKILL)
        logger.debug("killed processes left behind by child %d", process.pid)
    except (ProcessLookupError, PermissionError):
        pass


def _read_result(result_path: Path) -> dict | None:
    try:
        return json.loads(result_path.read_text())
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------------------------- child side


def _write_result(result_path: Path, payload: dict) -> None:
    temporary = result_path.with_name(result_path.name + ".tmp")
    temporary.write_text(json.dumps(payload))
    os.replace(temporary, result_path)


def child_main(argv: list[str]) -> int:
    """Entry point of the child: run the step described by the request file ``argv[0]``; returns the exit code."""
    if len(argv) != 1:
        sys.stderr.write("usage: python -m aitune.torch.backend.isolation REQUEST.json\n")
        return 2
    faulthandler.enable(file=sys.stderr, all_threads=True)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    package_logger = logging.getLogger("aitune")
    package_logger.addHandler(handler)
    package_logger.setLevel(logging.DEBUG)

    request = json.loads(Path(argv[0]).read_text())
    result_path = Path(request["result_path"])
    target = request["target"]
    sys.stderr.write(f"aitune isolated step {target} (pid {os.getpid()}, python {sys.executable})\n")
    sys.stderr.flush()
    try:
        function = resolve_target(target)
        result = function(**request.get("kwargs", {}))
        if result is None:
            result = {}
        if not isinstance(result, dict):
            raise TypeError(f"isolated step {target} returned {type(result).__name__}, expected a JSON-able dict")
        payload = {"ok": True, "result": json.loads(json.dumps(result))}
        code = 0
    except BaseException as exc:  # noqa: BLE001 - everything the step raises is reported to the parent
        traceback.print_exc()
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        payload = {"ok": False, "error_type": type(exc).__name__, "message": lines[0][:500] if lines else ""}
        code = 1
    _write_result(result_path, payload)
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
