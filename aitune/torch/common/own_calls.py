"""The wrapped module's own methods, reached through an ``ait.Module``, call the wrapper when they call ``self``.

NOTE [own calls]: a model is often driven by a method of its own that calls ``self(...)`` in a loop —
transformers' ``generate`` calls ``self.__call__`` once per token. Reached through the ``wrapt`` proxy alone,
such a method is bound to the original module, so those calls never reach the wrapper: wrapping a whole causal
LM recorded nothing (``ait.tune`` failed: no wrapped module was called) and a tuned one ran eagerly. The
reference system swaps the module's ``forward`` for its interceptor; aitune does not change the user's module.
Instead, a method the wrapped module's class (or a base between it and ``torch.nn.Module``) defines is bound,
when read through the wrapper, to a *view* of the module: an instance of a subclass of the module's class made
for this wrapper, sharing the module's ``__dict__`` (its parameters, submodules, buffers and attributes: what
the method reads or assigns is the module's own), whose only difference is that calling it — ``self(...)`` or
``self.__call__(...)`` — goes to the wrapper. The methods it reaches through ``self`` are bound to the view
too, and ``type(self)`` has the class's methods (``generate`` looks its decoding loop up there).
``torch.nn.Module``'s own methods (``to``, ``state_dict``, ``forward``, ``named_modules``, ...) are left as they
are, also where the class overrides them: ``wrapper.forward(x)`` still runs the module's forward eagerly.
"""

from __future__ import annotations

import types
import weakref
from typing import Any

import torch

_MODULE_API = frozenset(vars(torch.nn.Module))  # names whose meaning nn.Module fixes: never re-bound


def own_method(name: str, value: Any, wrapper) -> Any:
    """``value`` (the wrapped module's attribute ``name``) bound to the wrapper's view of the module when it is
    a method of the module's own class (NOTE [own calls]); anything else as it is.

    Args:
        name: the attribute's name.
        value: what ``getattr(module, name)`` gave.
        wrapper: the ``ait.Module`` it was read through (``__wrapped__``: the module; calls go to it).
    """
    if type(value) is types.MethodType and name not in _MODULE_API and value.__self__ is wrapper.__wrapped__:
        return types.MethodType(value.__func__, view(wrapper))
    return value


def view(wrapper) -> torch.nn.Module:
    """The module wrapped by ``wrapper`` as its own methods see it (NOTE [own calls]), made once per wrapper and
    module: a ``type(module)`` instance sharing the module's ``__dict__`` whose calls run ``wrapper``."""
    module = wrapper.__wrapped__
    made = getattr(wrapper, "_self_view", None)
    if made is not None and made.__dict__ is module.__dict__:
        return made
    cls = type(module)
    route = weakref.ref(wrapper)  # (the view is kept by the wrapper: no cycle through it)

    def __call__(self, *args, **kwargs):
        target = route()
        return target(*args, **kwargs) if target is not None else cls.__call__(self, *args, **kwargs)

    own = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                      "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
    made = object.__new__(own)
    object.__setattr__(made, "__dict__", module.__dict__)
    wrapper._self_view = made
    return made
