"""The configuration of :class:`~aitune.torch.backend.inductor_aot.TorchInductorAotBackend` and its checks."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math

from aitune.errors import ConfigError
from aitune.torch.backend.base import BackendConfig


@dataclasses.dataclass(kw_only=True)
class TorchInductorAotBackendConfig(BackendConfig):
    """Config of :class:`TorchInductorAotBackend`.

    Args:
        inductor_configs: ``torch._inductor.config`` options for ``aoti_compile_and_package``
            (e.g. ``{"max_autotune": True}``); keys must exist in ``torch._inductor.config`` and values must
            be JSON-able (they travel to the compile process as JSON; tuples arrive as lists).
        build_timeout_s: wall-clock limit of the compile-and-check child process, seconds (> 0).
        isolate: run compile and first load in a child process (recommended: a crash there, such as a
            SIGSEGV of ``aoti_load_package`` (NOTE [AOTInductor canary]), becomes a failed build instead of killing
            the tuning run). False runs them in this process.

    Raises:
        ConfigError: on an unknown Inductor option, a non-JSON-able value, or a non-positive timeout.
    """

    inductor_configs: dict | None = None
    build_timeout_s: float = 900.0
    isolate: bool = True

    def validate(self) -> None:
        if self.inductor_configs is not None:
            if not isinstance(self.inductor_configs, dict):
                raise ConfigError("inductor_configs must be a dict of torch._inductor.config options, got "
                                  f"{type(self.inductor_configs).__name__}")
            if self.inductor_configs:
                _check_inductor_options(self.inductor_configs)
        timeout = self.build_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
                or timeout <= 0:
            raise ConfigError(f"build_timeout_s must be a finite number of seconds > 0, got {timeout!r}")
        if not isinstance(self.isolate, bool):
            raise ConfigError(f"isolate must be a bool, got {self.isolate!r}")


def _check_inductor_options(options: dict) -> None:
    import torch._inductor.config as inductor_config  # ~1 s import: only when options are given

    known = set(inductor_config._config)  # every option of the config module, dotted names
    for key, value in options.items():
        if not isinstance(key, str):
            raise ConfigError(f"inductor_configs keys must be option names (str), got {key!r}")
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"inductor_configs: {key!r} is not a torch._inductor.config option{hint}")
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"inductor_configs[{key!r}] = {value!r} is not JSON-able; the compile runs in a "
                              "child process and receives options as JSON") from exc
