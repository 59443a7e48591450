"""State a module keeps outside its parameters and buffers: plain tensor attributes (a running statistic kept
as ``self.mean = ...``), counters, caches (lists, dicts, sets).

:func:`state_marks` reads what can change (cheaply: tensors by identity and version counter, containers by
their items), :func:`changed_state` names what a call changed, and :class:`AttributeSnapshot` puts every such
attribute back — tuning's own eager runs (references, probes, timing, the max-batch search) must leave the
module as the user's calls left it (docs/promises.md).
"""

from __future__ import annotations

from typing import Any

import torch

# nn.Module's own bookkeeping (hooks, registries, flags), never user state.
# nn.Module's own bookkeeping (and the flag `train()` sets): not state a forward keeps
MODULE_INTERNALS = frozenset(vars(torch.nn.Module())) | {"training", "_compiled_call_impl"}
_SCALARS = (int, float, bool, str, bytes, complex, type(None))
_CONTAINER_ITEMS = 256  # items of a container read one by one; a longer one is marked by identity and length


def _mark(value: Any, keep: list, depth: int = 0) -> Any:
    """A comparable mark of ``value``; objects it names by identity are appended to ``keep`` (so that identity
    is not reused while the mark lives)."""
    if isinstance(value, torch.Tensor):
        keep.append(value)
        return ("tensor", id(value), value._version)
    if isinstance(value, _SCALARS):
        return ("value", type(value), value)
    keep.append(value)
    if isinstance(value, (list, tuple, dict, set, frozenset)) and depth < 2:
        if len(value) > _CONTAINER_ITEMS:
            return ("container", id(value), len(value))
        items = value.items() if isinstance(value, dict) else (
            sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value)
        return ("container", id(value), len(value), tuple(
            (_mark(k, keep, depth + 1), _mark(v, keep, depth + 1)) if isinstance(value, dict)
            else _mark(k, keep, depth + 1) for k, v in ((item if isinstance(value, dict) else (item, None))
                                                        for item in items)))
    return ("object", id(value))


def _attributes(module: torch.nn.Module):
    for prefix, sub in module.named_modules():
        for name, value in list(vars(sub).items()):
            if name in MODULE_INTERNALS or isinstance(value, torch.nn.Module):
                continue
            yield (f"{prefix}.{name}" if prefix else name), sub, name, value


def state_marks(module: torch.nn.Module) -> tuple[dict[str, Any], list]:
    """``({"what": mark}, kept objects)`` for every parameter, buffer and plain attribute of the module tree.

    Keys name the state for messages: ``parameter `lin.weight```, ``buffer `bn.running_mean```,
    ``attribute `count```. Keep the second item alive until the marks are compared.
    """
    keep: list = []
    marks: dict[str, Any] = {}
    for name, tensor in module.named_parameters():
        keep.append(tensor)
        marks[f"parameter `{name}`"] = (id(tensor), tensor._version)
    for name, tensor in module.named_buffers():
        keep.append(tensor)
        marks[f"buffer `{name}`"] = (id(tensor), tensor._version)
    for path, _, _, value in _attributes(module):
        marks[f"attribute `{path}`"] = _mark(value, keep)
    return marks, keep


def changed_state(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The names (as :func:`state_marks` writes them) whose mark differs, was added or was removed."""
    return [name for name in {**before, **after} if before.get(name) != after.get(name)]


class AttributeSnapshot:
    """Every plain attribute of a module tree (tensors, scalars, containers), put back by :meth:`restore`.

    Restoring keeps identities: the attribute holds the same object as when the snapshot was taken, with its
    contents as they were then (tensors copied back in place, lists/dicts/sets refilled); attributes added
    since are removed. Objects of other types are put back by identity only.
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.entries = []
        for _, sub, name, value in _attributes(module):
            self.entries.append((sub, name, value, _contents(value)))
        self.names = {(id(sub), name) for sub, name, _, _ in self.entries}

    def restore(self) -> None:
        for sub, name, value, contents in self.entries:
            if sub.__dict__.get(name, _MISSING) is not value:
                sub.__dict__[name] = value
            _put_back(value, contents)
        for _, sub, name, _ in list(_attributes(self.module)):
            if (id(sub), name) not in self.names:
                del sub.__dict__[name]


_MISSING = object()


def _contents(value: Any, depth: int = 0) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if depth >= 2:
        return None
    if isinstance(value, list):
        return [(item, _contents(item, depth + 1)) for item in value]
    if isinstance(value, dict):
        return [(key, item, _contents(item, depth + 1)) for key, item in value.items()]
    if isinstance(value, set):
        return set(value)
    return None


def _put_back(value: Any, contents: Any) -> None:
    if contents is None:
        return
    if isinstance(value, torch.Tensor):
        with torch.no_grad():
            if value.shape != contents.shape or value.dtype != contents.dtype:
                value.data = contents.clone()
            elif not torch.equal(value, contents):
                value.copy_(contents)
    elif isinstance(value, list):
        value[:] = [item for item, _ in contents]
        for item, inner in contents:
            _put_back(item, inner)
    elif isinstance(value, dict):
        value.clear()
        value.update((key, item) for key, item, _ in contents)
        for _, item, inner in contents:
            _put_back(item, inner)
    elif isinstance(value, set):
        value.clear()
        value.update(contents)
