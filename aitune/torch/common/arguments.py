"""Misspelled keyword arguments get an error that lists the valid ones."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
from typing import Iterable

from aitune.errors import UnknownArgumentError


def reject_unknown_keywords(owner: str, valid: Iterable[str], given: Iterable[str]) -> None:
    """Raise :class:`~aitune.errors.UnknownArgumentError` for the first name in ``given`` not in ``valid``.

    The message names the owner, the closest valid name when there is one, and every valid name.
    """
    valid = sorted(set(valid))
    for name in given:
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UnknownArgumentError(f"{owner} got an unexpected keyword argument {name!r}{hint}; valid: "
                                       f"{', '.join(valid)}")


def known_keywords(function):
    """Decorator: an unknown keyword argument to ``function`` raises :class:`~aitune.errors.UnknownArgumentError`
    (closest name and every valid one) instead of Python's bare ``TypeError``. For entry points (``ait.tune``,
    ``ait.save``/``ait.load``, ``ait.inspect``), not hot paths: it costs a set lookup per keyword."""
    parameters = inspect.signature(function).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return function
    valid = frozenset(name for name, p in parameters.items()
                      if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY))

    @functools.wraps(function)
    def checked(*args, **kwargs):
        if not valid.issuperset(kwargs):
            reject_unknown_keywords(f"{function.__name__}()", valid, kwargs)
        return function(*args, **kwargs)

    return checked


class KnownFields:
    """Mixin for config dataclasses: unknown keyword arguments raise an error listing the fields."""

    def __new__(cls, *args, **kwargs):
        reject_unknown_keywords(cls.__name__, [f.name for f in dataclasses.fields(cls) if f.init], kwargs)
        return super().__new__(cls)


def init_keywords(cls: type) -> set[str]:
    """Keyword names ``cls(...)`` accepts: the named parameters of each ``__init__`` up the MRO, following
    ``**kwargs`` that are passed on to the parent."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        parameters = inspect.signature(init).parameters.values()
        names |= {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self"}
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    return names
