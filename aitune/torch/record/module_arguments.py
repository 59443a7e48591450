"""Argument checks for ``ait.Module`` and the functions that take wrappers (``ait.tune``, ``ait.save``).

Each check raises :class:`aitune.errors.ConfigError` naming the argument that is wrong and how to fix it.
"""

from __future__ import annotations

from typing import Any

from aitune.errors import ConfigError
from aitune.torch.record.samples import DynamicDim


def check_unique_names(wrappers, where: str) -> None:
    """Wrapper names key reports, build caches and checkpoints: two different wrappers of one model (or one
    tune run) may not share one.

    Raises:
        ConfigError: naming the duplicated name and the two wrapped classes.
    """
    seen: dict[str, Any] = {}
    for wrapper in wrappers:
        other = seen.get(wrapper.name)
        if other is not None and other is not wrapper:
            raise ConfigError(f"{where}: two wrapped modules are named {wrapper.name!r} ({type(other.module).__name__} "
                              f"and {type(wrapper.module).__name__}); names identify modules in reports, caches and "
                              "checkpoints — give each ait.Module a distinct name")
        seen[wrapper.name] = wrapper


def validate_strategies(strategy, strategies, strategy_class) -> list | dict | None:
    """``strategies`` as a list or a dict of TuneStrategy (exclusive with ``strategy``)."""
    if strategies is None:
        return None
    if strategy is not None:
        raise ConfigError("give either strategy (one for every graph) or strategies (one per graph), not both")
    if isinstance(strategies, (list, tuple)):
        values = list(strategies)
    elif isinstance(strategies, dict):
        for key in strategies:
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise ConfigError(f"strategies keys are graph names ('graph0') or indices (0), got {key!r}")
        values = list(strategies.values())
    else:
        raise ConfigError(f"strategies must be a list (one per graph, in order) or a dict keyed by graph name, "
                          f"got {type(strategies).__name__}")
    if not values:
        raise ConfigError("strategies is empty: give one strategy per graph")
    for value in values:
        if not isinstance(value, strategy_class):
            raise ConfigError(f"strategies must hold TuneStrategy instances, got {value!r}")
    return values if isinstance(strategies, (list, tuple)) else dict(strategies)


def validate_dynamic_shapes(dynamic_shapes) -> None:
    """``dynamic_shapes``: ``{input path: (int | DynamicDim | BatchDim, ...)}``; dims sharing a name share bounds."""
    if dynamic_shapes is None:
        return
    if not isinstance(dynamic_shapes, dict):
        raise ConfigError("dynamic_shapes must be a dict {input path: (int | DynamicDim | BatchDim, ...)}")
    by_name: dict[str, DynamicDim] = {}
    for path, dims in dynamic_shapes.items():
        if not isinstance(dims, (tuple, list)):
            raise ConfigError(f"dynamic_shapes[{path!r}] must be a tuple with one entry per axis")
        for dim in dims:
            if isinstance(dim, DynamicDim):
                previous = by_name.setdefault(dim.name, dim)
                if previous != dim:
                    raise ConfigError(f"dims named {dim.name!r} differ ({previous} vs {dim}); same name, same bounds")
            elif not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
                raise ConfigError(f"dynamic_shapes[{path!r}]: {dim!r} is neither a size >= 0 nor a DynamicDim")
