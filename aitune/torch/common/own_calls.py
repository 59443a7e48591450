"""The wrapped module's own methods, reached through an ``ait.Module``, call the wrapper when they call ``self``.

NOTE [own calls]: a model is often driven by a method of its own that calls ``self(...)`` in a loop —
transformers' ``generate`` calls ``self.__call__`` once per token. Reached through the ``wrapt`` proxy alone,
such a method is bound to the original module, so those calls never reach the wrapper: wrapping a whole causal
LM recorded nothing (``ait.tune`` failed: no wrapped module was called) and a tuned one ran eagerly. The
reference system swaps the module's ``forward`` for its interceptor; aitune does not change the user's module.
Instead, a method of the module (any bound method whose name ``torch.nn.Module`` does not define) is bound,
when read through the wrapper, to a *view* of the module: an instance of a subclass of the module's class (made
once per class), sharing the module's ``__dict__`` (its parameters, submodules, buffers and attributes: what
the method reads or assigns is the module's own), whose only difference is that calling it — ``self(...)`` or
``self.__call__(...)`` — goes to the wrapper. The methods it reaches through ``self`` are bound to the view
too, and ``type(self)`` has the class's methods (``generate`` looks its decoding loop up there); ``type(self)`` is
not the module's class itself: an instance an own method makes of it, or a copy of the view, is a plain module of
its own (copies and pickles are of the module's class), and what changes the class (``self.__class__ = ...``,
``torch.nn.utils.parametrize`` inside such a method) reaches the view only. A class that refuses subclasses (a
metaclass or ``__init_subclass__`` with required arguments) keeps its methods bound to the module: they run
eagerly, as before.
``torch.nn.Module``'s own methods (``to``, ``state_dict``, ``forward``, ``named_modules``, ...) are left as they
are, also where the class overrides them: ``wrapper.forward(x)`` still runs the module's forward eagerly.
"""

from __future__ import annotations

import copyreg
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
        own = view(wrapper)
        if own is not None:
            return types.MethodType(value.__func__, own)
    return value


def view(wrapper) -> torch.nn.Module:
    """The module wrapped by ``wrapper`` as its own methods see it (NOTE [own calls]), made once per wrapper and
    module: a ``type(module)`` instance sharing the module's ``__dict__`` whose calls run ``wrapper``; None where
    no subclass of the module's class can be made (a metaclass or ``__init_subclass__`` that refuses one)."""
    module = wrapper.__wrapped__
    made = wrapper._self_view
    own = _view_class(type(module))
    if own is None:
        return None
    if made is not None and made.__dict__ is module.__dict__ and type(made) is own:
        return made
    made = object.__new__(own)
    object.__setattr__(made, "__dict__", module.__dict__)
    # by id, not by the view (a class with __eq__ and no __hash__ is unhashable); weak both ways: the wrapper keeps
    # its view, nothing keeps the wrapper, and the entry goes with the view
    _ROUTES[id(made)] = weakref.ref(wrapper)
    weakref.finalize(made, _ROUTES.pop, id(made), None)
    wrapper._self_view = made
    return made


_ROUTES: dict[int, "weakref.ref"] = {}  # id of a live view -> weakref to its wrapper
# id of a module class -> (the class, its view class or None); by id: a metaclass may make classes unhashable. Kept
# for the process, as jit's routing classes are (the view class holds its base strongly: weak keys would not free it)
_VIEW_CLASSES: dict[int, tuple[type, type | None]] = {}


def _view_class(cls: type) -> type | None:
    """The subclass of ``cls`` that views are instances of, made once per class. Only a view registered in
    ``_ROUTES`` calls its wrapper: an instance an own method makes of ``type(self)`` (or a copy of the view) is a
    plain module of its own."""
    known = _VIEW_CLASSES.get(id(cls))
    if known is not None and known[0] is cls:
        return known[1]

    def route(self, args, kwargs):
        wrapper = _ROUTES.get(id(self), _DEAD)()
        return wrapper(*args, **kwargs) if wrapper is not None else cls.__call__(self, *args, **kwargs)

    try:
        own = calling_subclass(cls, route)
    except Exception:  # (a metaclass or __init_subclass__ with required arguments): its methods stay unrouted
        own = None
    _VIEW_CLASSES[id(cls)] = (cls, own)
    return own


def _DEAD():  # the route of an object that is no view: no wrapper
    return None


def calling_subclass(cls: type, route, **namespace) -> type:
    """A subclass of ``cls`` (same name, module and docstring; ``namespace`` added) whose instances' calls run
    ``route(instance, args, kwargs)``, except inside a caller's ``torch.compile`` trace (transformers'
    auto-compile, a user's compile), where ``cls``'s own call runs; copies and pickles of its instances are of
    ``cls``. Used for the views here and for just-in-time tuning's routing classes (``aitune/torch/jit/patching.py``).

    Raises:
        whatever ``cls``'s metaclass or ``__init_subclass__`` raises for a subclass.
    """
    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return cls.__call__(self, *args, **kwargs)
        return route(self, args, kwargs)

    def __reduce_ex__(self, protocol):
        return _reduce_as(cls, self, protocol)

    namespace.update({"__call__": __call__, "__reduce_ex__": __reduce_ex__, "__module__": cls.__module__,
                      "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
    return type(cls)(cls.__name__, (cls,), namespace)


def _reduce_as(cls: type, obj, protocol: int):
    """``obj.__reduce_ex__(protocol)`` as if ``obj`` were an instance of ``cls`` (a base of its class made by aitune):
    pickle refuses ``__newobj__`` with another class, so the stdlib's ``_reconstructor`` stands in, and unpickling
    needs neither aitune nor the made class."""
    reduced = cls.__reduce_ex__(obj, protocol)
    if not (isinstance(reduced, tuple) and len(reduced) >= 2 and reduced[1] and reduced[1][0] is type(obj)):
        return reduced
    if reduced[0] is copyreg.__newobj__ and len(reduced[1]) == 1:
        return (copyreg._reconstructor, (cls, object, None), *reduced[2:])
    return (reduced[0], (cls, *reduced[1][1:]), *reduced[2:])
