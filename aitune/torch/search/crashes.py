"""Remember candidates that crash this environment.

A build step run in a child process (:mod:`aitune.torch.backend.isolation`) that dies from a signal — SIGSEGV, SIGABRT,
SIGBUS, SIGILL, SIGFPE — will die again in the same environment (in one where loading any AOTInductor package
segfaults, each attempt costs a tune the minute its compile takes). Such a crash is recorded per environment (torch
and CUDA versions, driver, device name and capability or CPU model) and per candidate (backend class and config
key); later tunes skip that candidate with a row that says so and points to the log of the crash. Timeouts are not
recorded (they depend on the model and the machine's load).

The record lives in ``<cache dir>/crashes.json``; ``aitune env`` lists it; deleting the cache (or
:meth:`CrashRegistry.clear`, ``aitune env --clear-crashes``) retries the candidates.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from pathlib import Path

from aitune.torch.common.environment import environment_id, environment_key

logger = logging.getLogger(__name__)

CRASH_SIGNALS = frozenset({"SIGSEGV", "SIGABRT", "SIGBUS", "SIGILL", "SIGFPE"})
FILE_NAME = "crashes.json"


def crash_signal(exc: BaseException | None) -> str | None:
    """The signal that killed a child build step somewhere in ``exc``'s cause chain, if it is a crash."""
    while exc is not None:
        name = getattr(exc, "signal_name", None)
        if name in CRASH_SIGNALS:
            return name
        exc = exc.__cause__
    return None


class CrashRegistry:
    """Candidates that crashed, per environment, in one JSON file.

    Args:
        path: the file (``<cache dir>/crashes.json``).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    @staticmethod
    def candidate_key(blueprint) -> str:
        return f"{type(blueprint).__module__}.{type(blueprint).__qualname__}:{blueprint.config.key()}"

    @staticmethod
    def environment_id(device) -> str:
        return environment_id(device)

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def lookup(self, blueprint, device) -> dict | None:
        """The recorded crash of ``blueprint`` on ``device`` in this environment, or None."""
        return self._read().get(self.environment_id(device), {}).get("crashes", {}).get(self.candidate_key(blueprint))

    def record(self, blueprint, device, signal_name: str, reason: str, log_path: str | None) -> None:
        """Remember that building ``blueprint`` killed its child process with ``signal_name``."""
        data = self._read()
        environment = data.setdefault(self.environment_id(device), {"environment": environment_key(device),
                                                                     "crashes": {}})
        environment["crashes"][self.candidate_key(blueprint)] = {
            "backend": blueprint.name, "description": blueprint.describe(), "signal": signal_name,
            "reason": reason, "log": log_path, "when": datetime.datetime.now().isoformat(timespec="seconds")}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        partial.write_text(json.dumps(data, indent=2))
        os.replace(partial, self.path)
        logger.warning("%s crashed its build child (%s); later tunes in this environment skip it (record: %s)",
                       blueprint.describe(), signal_name, self.path)

    def entries(self) -> list[dict]:
        """Every recorded crash: ``{"environment", "backend", "description", "signal", "reason", "log", "when"}``."""
        rows = []
        for environment in self._read().values():
            for crash in environment.get("crashes", {}).values():
                rows.append({"environment": environment.get("environment", {}), **crash})
        return rows

    def clear(self) -> int:
        """Forget every recorded crash (they are retried); returns how many there were."""
        count = len(self.entries())
        self.path.unlink(missing_ok=True)
        return count
