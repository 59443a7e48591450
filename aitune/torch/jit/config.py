"""``jit_config``: the settings of just-in-time tuning (one process-wide instance, plain data).

Every field is validated when it is set (``jit_config.min_samples = 0`` raises :class:`ConfigError` at once),
so a bad setting never surfaces later inside the user's run. Defaults live in the field defaults only.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from pathlib import Path
from typing import Any

from aitune.errors import ConfigError
from aitune.torch.check.guard import GuardConfig
from aitune.torch.tune_strategy import FirstWinsStrategy, TuneStrategy
from aitune.torch.tuning import cache_dir

__all__ = ["JITMode", "JitConfig", "jit_config"]


class JITMode(str, enum.Enum):
    """When recorded modules are tuned.

    ``TUNE_EAGER``: inside the user's call that made a module ready (``min_samples`` calls seen and, if
    required, a varying input axis); that call pauses for the tuning and returns eager's output.
    ``TUNE_DEFERRED``: only when :func:`aitune.torch.jit.tune_now` is called (or at interpreter exit,
    with ``tune_at_exit``); until then every module only records.
    ``INSPECT``: nothing is tuned; every discovered module and its children (down to ``max_depth_level``) are
    timed and described (:mod:`aitune.torch.jit.enable_inspection` sets it).
    """

    TUNE_EAGER = "tune_eager"
    TUNE_DEFERRED = "tune_deferred"
    INSPECT = "inspect"


def _names(value: Any, field: str) -> list[str]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(
            isinstance(item, str) and item for item in value):
        raise ConfigError(f"jit_config.{field} must be a list of non-empty strings (class names, qualified class "
                          f"names, package prefixes or module paths), got {value!r}")
    return list(value)


def _int(value: Any, field: str, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"jit_config.{field} must be an int >= {minimum}, got {value!r}")
    return value


def _bool(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"jit_config.{field} must be True or False, got {value!r}")
    return value


@dataclasses.dataclass(kw_only=True)
class JitConfig:
    """Settings of just-in-time tuning (the process-wide instance is :data:`jit_config`).

    Args:
        mode: :class:`JITMode` (or its value, ``"tune_eager"`` / ``"tune_deferred"`` / ``"inspect"``).
        min_samples: calls a module must have recorded before it is tuned (>= 1; default 2: one call
            cannot show which input axes vary).
        batch_axis_required: also wait until some input axis has varied across the recorded calls (a batch
            or sequence axis), so the build covers a range of shapes instead of one (the reference's rule:
            "a graph with a detected dynamic axis"). With False, fixed-shape workloads are tuned too.
        max_depth_level: levels that may be tracked: the top-level module is level 0, and a child is tried
            (when its parent cannot be tuned) only at level < ``max_depth_level``. 1 = top-level modules only.
        min_parameters: modules with fewer parameters (elements) are never tuned, nor is anything below them
            (default 1: losses, activations and other weightless helpers are left alone).
        skip_modules: never tuned, and nothing below them either. Each entry names modules by class name
            (``"BertPooler"``), qualified class name, package (``"transformers.models.bert"`` and below) or
            module path as :func:`aitune.torch.jit.describe` shows it (``"SentenceEncoder.bert.pooler"``).
        patch_exclude: never tuned themselves, but their children are tried; entries as for
            ``skip_modules``. Added to the built-in exclusions (torch internals, ``torch.compile``'d and
            scripted modules, aitune's own).
        device: where to build and measure (None: the module's own device, as in :func:`aitune.torch.tune`).
        strategy: a :class:`~aitune.torch.tune_strategy.TuneStrategy`, cloned per module (None:
            ``FirstWinsStrategy()`` over the default backends: the first that builds, matches eager and beats
            it, which keeps the pause shorter than measuring them all).
        max_samples: distinct input shapes kept per graph (as ``aitune.torch.Module``'s ``max_samples``).
        guard: run-time checks after tuning (:class:`~aitune.torch.GuardConfig`; None: its defaults).
        replay_samples: when a module cannot be tuned, run its recorded samples through it once more (under
            ``no_grad``) so its children record at once instead of on later calls. Forward hooks on the
            children see these extra calls; modules that change their own state or their inputs are never
            replayed.
        tune_at_exit: in deferred mode, tune what is still pending at interpreter exit (fills the build
            cache and writes the reports; the outputs of this run were eager's anyway).
        cache_dir: builds and reports (None: ``$AITUNE_JIT_CACHE_DIR``, else ``<aitune cache>/jit``).
        inspection_dir: inspect mode: where the ``jit_inspect_<timestamp>.html`` page is written at exit when
            ``save_report()`` was never called (None: the working directory of the moment inspection was
            enabled).

    Raises:
        ConfigError: for any value outside the ranges above, at construction or assignment.
    """

    mode: JITMode = JITMode.TUNE_EAGER
    min_samples: int = 2
    batch_axis_required: bool = True
    max_depth_level: int = 3
    min_parameters: int = 1
    skip_modules: list[str] = dataclasses.field(default_factory=list)
    patch_exclude: list[str] = dataclasses.field(default_factory=list)
    device: str | None = None
    strategy: Any = None
    max_samples: int = 8
    guard: Any = None
    replay_samples: bool = True
    tune_at_exit: bool = True
    cache_dir: str | None = None
    inspection_dir: str | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        validate = _VALIDATORS.get(name)
        if validate is None:
            raise ConfigError(f"jit_config has no setting {name!r}; the settings are: {', '.join(_VALIDATORS)}")
        super().__setattr__(name, validate(value))

    def resolve_strategy(self):
        """A fresh copy of :attr:`strategy`, or the default ``FirstWinsStrategy()``."""
        return self.strategy.clone() if self.strategy is not None else FirstWinsStrategy()

    def resolved_cache_dir(self) -> Path:
        """:attr:`cache_dir`, else ``$AITUNE_JIT_CACHE_DIR``, else ``<aitune cache>/jit``."""
        if self.cache_dir:
            return Path(self.cache_dir).expanduser()
        if os.environ.get("AITUNE_JIT_CACHE_DIR"):
            return Path(os.environ["AITUNE_JIT_CACHE_DIR"]).expanduser()
        return cache_dir() / "jit"

    def reset_to_defaults(self) -> None:
        """Every setting back to its default."""
        for field in dataclasses.fields(self):
            default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
            setattr(self, field.name, default)

    def update(self, **settings) -> None:
        """Set several settings at once (each validated; unknown names raise :class:`ConfigError`)."""
        for name, value in settings.items():
            setattr(self, name, value)

    def to_dict(self) -> dict:
        """JSON-able settings (the strategy and guard by their description)."""
        data = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        data["mode"] = self.mode.value
        data["strategy"] = self.strategy.describe() if self.strategy is not None else None
        data["guard"] = repr(self.guard) if self.guard is not None else None
        return data


def _mode(value: Any) -> JITMode:
    try:
        return JITMode(value)
    except ValueError:
        raise ConfigError(f"jit_config.mode must be one of {[mode.value for mode in JITMode]}, got {value!r}") from None


def _strategy(value: Any):
    if value is not None and not isinstance(value, TuneStrategy):
        raise ConfigError(f"jit_config.strategy must be a TuneStrategy such as FirstWinsStrategy() or None, "
                          f"got {value!r}")
    return value


def _guard(value: Any):
    if value is not None and not isinstance(value, GuardConfig):
        raise ConfigError(f"jit_config.guard must be an aitune.torch.GuardConfig or None, got {value!r}")
    return value


def _optional_str(field: str):
    def validate(value: Any) -> str | None:
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise ConfigError(f"jit_config.{field} must be a string or None, got {value!r}")
        return None if value is None else str(value)
    return validate


_VALIDATORS = {
    "mode": _mode,
    "min_samples": lambda value: _int(value, "min_samples", 1),
    "batch_axis_required": lambda value: _bool(value, "batch_axis_required"),
    "max_depth_level": lambda value: _int(value, "max_depth_level", 1),
    "min_parameters": lambda value: _int(value, "min_parameters", 0),
    "skip_modules": lambda value: _names(value, "skip_modules"),
    "patch_exclude": lambda value: _names(value, "patch_exclude"),
    "device": _optional_str("device"),
    "strategy": _strategy,
    "max_samples": lambda value: _int(value, "max_samples", 1),
    "guard": _guard,
    "replay_samples": lambda value: _bool(value, "replay_samples"),
    "tune_at_exit": lambda value: _bool(value, "tune_at_exit"),
    "cache_dir": _optional_str("cache_dir"),
    "inspection_dir": _optional_str("inspection_dir"),
}

jit_config = JitConfig()
"""The process-wide settings read by just-in-time tuning (change them before or while it runs)."""
