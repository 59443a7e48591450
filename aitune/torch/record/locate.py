"""Walking a model or pipeline object: where its modules sit and how to get or replace one in place.

One walk serves :func:`aitune.torch.inspect` / :func:`aitune.torch.wrap` (which modules a pipeline holds)
and :func:`aitune.torch.save` / :func:`aitune.torch.load` (where the tuned wrappers sit, addressed by path).

The graph it walks: an ``nn.Module``'s registered children (``["module", name]``), dict entries
(``["key", key]``), list/tuple entries (``["index", i]``) and the attributes of plain objects
(``["attr", name]``) — objects with a ``__dict__`` whose class is not from ``builtins`` or ``torch``.
Wrapt proxies (:class:`aitune.torch.Module`) are looked through. Each object is walked once (by identity);
meeting it again is reported, not walked again.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, NamedTuple

import torch
import wrapt

MODULE, ATTR, KEY, INDEX = "module", "attr", "key", "index"


class Step(NamedTuple):
    """One step from a container to a child: ``kind`` is ``"module"``, ``"attr"``, ``"key"`` or ``"index"``."""

    kind: str
    key: Any


@dataclasses.dataclass(frozen=True)
class Node:
    """One object met by :func:`walk`.

    Attributes:
        value: the object. path: steps from the root (``()`` for the root). parent: the object holding it
        (None for the root). depth: ``len(path)``. first: False when the object was met before by another
        path (it is then not walked again).
    """

    value: Any
    path: tuple[Step, ...]
    parent: Any
    depth: int
    first: bool


def children(value: Any) -> list[tuple[Step, Any]]:
    """The steps below ``value`` and the child at each, in order (see the module docstring)."""
    if isinstance(value, wrapt.ObjectProxy):
        value = value.__wrapped__
    if isinstance(value, torch.nn.Module):
        return [(Step(MODULE, name), child) for name, child in value._modules.items() if child is not None]
    if isinstance(value, dict):
        return [(Step(KEY, key), child) for key, child in value.items()]
    if isinstance(value, (list, tuple)):
        return [(Step(INDEX, index), child) for index, child in enumerate(value)]
    if (hasattr(value, "__dict__") and not isinstance(value, type)
            and type(value).__module__.split(".")[0] not in ("builtins", "torch")):
        return [(Step(ATTR, name), child) for name, child in vars(value).items() if not name.startswith("__")]
    return []


def walk(root: Any, max_depth: int, follow: Callable[[Step], bool] | None = None) -> Iterator[Node]:
    """Every object reachable from ``root`` within ``max_depth`` steps, depth first, parents before children.

    Args:
        root: a module, a pipeline object, a dict or list of them.
        max_depth: objects deeper than this are not met (the root has depth 0).
        follow: when given, only steps for which it returns True are taken.

    Yields:
        A :class:`Node` per object met; an object met again (``first=False``) is not walked again.
    """
    seen: set[int] = set()

    def visit(value: Any, path: tuple[Step, ...], parent: Any) -> Iterator[Node]:
        first = id(value) not in seen
        yield Node(value, path, parent, len(path), first)
        if not first:
            return
        seen.add(id(value))
        if len(path) < max_depth:
            for step, child in children(value):
                if follow is None or follow(step):
                    yield from visit(child, path + (step,), value)

    yield from visit(root, (), None)


def get_child(parent: Any, step: Step) -> Any:
    """The child of ``parent`` at ``step``.

    Raises:
        KeyError / IndexError / AttributeError / TypeError: nothing is there (as the container raises).
    """
    kind, key = step
    if isinstance(parent, wrapt.ObjectProxy):
        parent = parent.__wrapped__
    if kind == MODULE and isinstance(parent, torch.nn.Module):
        return parent._modules[key]
    if kind in (MODULE, ATTR):
        return getattr(parent, key)
    if kind in (KEY, INDEX):
        return parent[key]
    raise KeyError(f"unknown step kind {kind!r}")


def set_child(parent: Any, step: Step, value: Any) -> None:
    """Put ``value`` at ``step`` in ``parent`` (``setattr`` registers a submodule in an ``nn.Module``).

    Raises:
        TypeError: ``parent`` is a tuple (entries cannot be replaced in place).
    """
    kind, key = step
    if isinstance(parent, wrapt.ObjectProxy):
        parent = parent.__wrapped__
    if kind in (MODULE, ATTR):
        setattr(parent, key, value)
    elif isinstance(parent, tuple):
        raise TypeError(f"cannot replace an entry of a tuple in place ({type(parent).__name__}[{key!r}])")
    else:
        parent[key] = value


class PathNotFound(LookupError):
    """Nothing is at ``path[:depth + 1]`` (raised by :func:`resolve`; the container's error is chained)."""

    def __init__(self, depth: int, reason: str):
        super().__init__(reason)
        self.depth = depth


def resolve(root: Any, path: list | tuple) -> tuple[Any, Any]:
    """``(parent, value)`` at ``path`` (a sequence of ``(kind, key)`` steps) below ``root``.

    Returns:
        The parent is None for the root (empty path).

    Raises:
        PathNotFound: nothing is at some step.
    """
    parent, value = None, root
    for depth, step in enumerate(path):
        parent = value
        try:
            value = get_child(parent, Step(*step))
        except (KeyError, IndexError, AttributeError, TypeError) as exc:
            raise PathNotFound(depth, f"{type(exc).__name__}: {exc}") from exc
    return parent, value
