"""Routing the calls of a user's module without replacing it: a routing class and an eager twin.

NOTE [routing by class swap and a twin]: just-in-time tuning must catch ``model(x)`` on an object the user
holds (the top-level module has no parent to swap a wrapper into), and must hand backends a module they
can compile, export or deep-copy without meeting any of our routing. Two objects make that possible:

* the user's module gets a *routing class*: a subclass of its own class, with the same name, module and
  qualified name, whose only change is ``__call__`` (it hands the call to the module's
  :class:`~aitune.torch.jit.patched_module.PatchedModule`). ``isinstance`` checks, attributes, parameters,
  ``state_dict``, hooks and ``forward`` are untouched; ``copy.deepcopy`` and pickling produce the original
  class (see ``_reduce_ex``). :func:`unpatch` puts the original class back.
* the *twin*: an instance of the original class that shares the module's ``__dict__`` (its parameters,
  buffers, submodules, hooks and ``training`` flag are the same objects, not copies). Recording, eager
  runs and every backend use the twin, so ``torch.compile`` traces the original class and the user's
  ``model.eval()`` or weight updates are seen by both.

Why not an instance-level ``forward`` override (what the reference does): backends that compile the
module would trace the override, and dynamo guards on it. Why not a global ``nn.Module.__call__`` patch:
every module call in the process would pay for it, compiled graphs included. The user-visible difference
is ``type(model)``: it is the routing class (``type(model) is BertModel`` is False while tuning is
enabled; ``isinstance`` holds).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from aitune.torch.common.own_calls import calling_subclass

__all__ = ["is_patched", "make_twin", "original_class", "patch", "unpatch"]

_ORIGINAL = "_aitune_jit_original_class"
_ROUTING_CLASSES: dict[type, type] = {}  # original class -> its routing class (classes live as long anyway)


def original_class(module: torch.nn.Module) -> type:
    """The module's own class (looks through the routing class)."""
    return getattr(type(module), _ORIGINAL, type(module))


def is_patched(module: torch.nn.Module) -> bool:
    """True when ``module`` currently has a routing class."""
    return _ORIGINAL in type(module).__dict__


def make_twin(module: torch.nn.Module) -> torch.nn.Module:
    """An instance of the module's original class sharing its ``__dict__`` (see the NOTE above)."""
    twin = object.__new__(original_class(module))
    object.__setattr__(twin, "__dict__", module.__dict__)
    return twin


def patch(module: torch.nn.Module, route: Callable[[torch.nn.Module, tuple, dict], Any]) -> None:
    """Give ``module`` its routing class: ``module(*args, **kwargs)`` becomes ``route(module, args, kwargs)``.

    Raises:
        TypeError: when the class cannot be swapped (e.g. a ``__slots__`` layout Python refuses).
    """
    cls = original_class(module)
    routing = _ROUTING_CLASSES.get(cls)
    if routing is None or routing.__dict__["_aitune_jit_route"] is not route:
        routing = _routing_class(cls, route)
        _ROUTING_CLASSES[cls] = routing
    module.__class__ = routing


def unpatch(module: torch.nn.Module) -> None:
    """Put the original class back (no-op for a module that is not patched)."""
    if is_patched(module):
        module.__class__ = original_class(module)


def _routing_class(cls: type, route: Callable) -> type:
    return calling_subclass(cls, route, **{_ORIGINAL: cls, "_aitune_jit_route": route})
