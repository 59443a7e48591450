"""Where the tuned wrappers of a saved object sit, as JSON paths (walked by :mod:`aitune.torch.record.locate`).

A path is a list of ``[kind, key]`` steps: ``["module", name]`` (an ``nn.Module`` child), ``["attr", name]``
(an object attribute), ``["key", key]`` (a dict entry, str or int keys only), ``["index", i]`` (a list/tuple
entry). The root itself has the path ``[]``. Existing checkpoints depend on this format.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from aitune.errors import CheckpointError
from aitune.torch.record.locate import ATTR, KEY, MODULE, PathNotFound, Step, resolve, set_child, walk
from aitune.torch.module import Module


@dataclasses.dataclass
class WrapperEntry:
    """A wrapper found in a saved object: its first path and any further paths (aliases) to it."""

    path: list
    wrapper: Any
    aliases: list = dataclasses.field(default_factory=list)


def _json_step(step: Step) -> bool:
    """Dict entries are followed only under keys a JSON path can hold (str, int)."""
    return step.kind != KEY or type(step.key) in (str, int)


def find_wrappers(obj: Any, max_depth: int = 13) -> list[WrapperEntry]:
    """Every :class:`~aitune.torch.Module` reachable from ``obj`` with its path (see the module docstring).

    Args:
        obj: the saved object (a wrapper, a module, a pipeline object).
        max_depth: wrappers deeper than this many steps are not found.

    Returns:
        One entry per wrapper, in walk order; a wrapper reached by several paths lists the others as aliases.
    """
    found: dict[int, WrapperEntry] = {}
    for node in walk(obj, max_depth, follow=_json_step):
        if isinstance(node.value, Module):
            path = [[step.kind, step.key] for step in node.path]
            if id(node.value) in found:
                found[id(node.value)].aliases.append(path)
            else:
                found[id(node.value)] = WrapperEntry(path, node.value)
    return list(found.values())


def path_text(path: list) -> str:
    """``unet.blocks[0]``: attributes and submodules dotted, keys and indices in brackets; ``<root>`` for ``[]``."""
    text = ""
    for kind, key in path:
        if kind in (MODULE, ATTR):
            text += f".{key}" if text else str(key)
        else:
            text += f"[{key!r}]"
    return text or "<root>"


def resolve_path(root: Any, path: list) -> tuple[Any, Any]:
    """``(parent, value)`` at ``path`` below ``root`` (parent None for the root).

    Raises:
        CheckpointError: nothing is at ``path`` (the message names the first step that is missing).
    """
    try:
        return resolve(root, path)
    except PathNotFound as exc:
        raise CheckpointError(
            f"the checkpoint has a tuned module at {path_text(path)}, but {type(root).__name__} has nothing at "
            f"{path_text(path[: exc.depth + 1])} ({exc}); load into the same model/pipeline structure that was "
            "saved") from exc.__cause__


def replace_at(parent: Any, step: list, value: Any) -> None:
    """Put ``value`` at ``step`` in ``parent``.

    Raises:
        CheckpointError: ``parent`` is a tuple.
    """
    kind, key = step
    container = parent.__wrapped__ if isinstance(parent, Module) else parent
    if kind not in (MODULE, ATTR) and isinstance(container, tuple):
        raise CheckpointError(f"cannot wrap an entry of a tuple in place ({type(container).__name__}[{key}]); "
                              "hold the module in a list, dict or attribute, or wrap it before load")
    set_child(parent, Step(kind, key), value)
