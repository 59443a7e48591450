"""User-declared dynamic axes: :class:`DynamicDim` (a named size range) and :class:`BatchDim`."""

from __future__ import annotations

import dataclasses

from aitune.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class DynamicDim:
    """An explicitly dynamic axis with its range (sizes in elements).

    Args:
        name: dims with the same name share one symbol (must have equal bounds).
        min: smallest size (>= 0). max: largest size (> min). opt: size to optimise for (default: max).

    Raises:
        ConfigError: on a non-positive or inconsistent range.
    """

    name: str
    min: int
    max: int
    opt: int | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"{type(self).__name__}: name must be a non-empty string, got {self.name!r}")
        for field in ("min", "max"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{type(self).__name__}({self.name}): {field} must be an int >= 0, got {value!r}")
        if self.min >= self.max:
            raise ConfigError(f"{type(self).__name__}({self.name}): min ({self.min}) must be < max ({self.max})")
        if self.opt is not None and not (self.min <= self.opt <= self.max):
            raise ConfigError(f"{type(self).__name__}({self.name}): opt ({self.opt}) must lie in [min, max]")

    @property
    def opt_or_max(self) -> int:
        return self.max if self.opt is None else self.opt


@dataclasses.dataclass(frozen=True)
class BatchDim(DynamicDim):
    """An explicitly dynamic batch axis (see :class:`DynamicDim`)."""
