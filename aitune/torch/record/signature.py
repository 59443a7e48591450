"""How calls bind to a module's ``forward``: one canonical ``(args, kwargs)`` form per call.

Recording, graph keys and dispatch all see a call in this form, so ``m(x, mask)`` and ``m(x, mask=mask)``
are the same call.
"""

from __future__ import annotations

import inspect
from typing import Callable


class CallSignature:
    """Normalises calls against a ``forward`` signature.

    ``normalize(args, kwargs)`` returns the canonical ``(args, kwargs)``: every argument that can be
    passed by keyword is, in signature order (extra ``**kwargs`` sorted by name); only positional-only
    parameters and ``*args`` stay positional. Defaults are not filled in: some decorated ``forward``s
    (e.g. transformers') inject keyword arguments themselves and reject them when given twice.
    Calling the module with the canonical form is equivalent to the original call.
    """

    def __init__(self, function: Callable):
        try:
            self.signature = inspect.signature(function)
        except (TypeError, ValueError):  # builtins without a signature: take the call as given
            self.signature = None
        self._var_keyword = None
        self._fast = self.signature is not None
        self._names: list[str] = []
        self._positional: list[str] = []
        self._required: list[str] = []
        if self.signature is not None:
            for parameter in self.signature.parameters.values():
                kind = parameter.kind
                if kind is inspect.Parameter.VAR_KEYWORD:
                    self._var_keyword = parameter.name
                    continue
                if kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL):
                    self._fast = False
                    continue
                self._names.append(parameter.name)
                if kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
                    self._positional.append(parameter.name)
                if parameter.default is inspect.Parameter.empty:
                    self._required.append(parameter.name)
        self._known = set(self._names)

    def normalize(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Return the canonical (args, kwargs). Raises ``TypeError`` like Python for a bad call."""
        if self.signature is None:
            return tuple(args), dict(sorted(kwargs.items()))
        if self._fast and len(args) <= len(self._positional):
            result = self._normalize_fast(args, kwargs)
            if result is not None:
                return result
        bound = self.signature.bind(*args, **kwargs)
        positional: list = []
        keyword: dict = {}
        for name, value in bound.arguments.items():
            kind = self.signature.parameters[name].kind
            if kind is inspect.Parameter.POSITIONAL_ONLY:
                positional.append(value)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                positional.extend(value)
            elif kind is inspect.Parameter.VAR_KEYWORD:
                keyword.update(sorted(value.items()))
            else:
                keyword[name] = value
        return tuple(positional), keyword

    def plan(self, args: tuple, kwargs: dict) -> Callable[[tuple, dict], tuple[tuple, dict]] | None:
        """A function that normalises, like :meth:`normalize`, every call with as many positional arguments as
        ``args`` and the keyword names of ``kwargs`` in the same order (no binding per call: ``ait.Module``'s
        dispatch fast path); None where such calls need the general path (positional-only parameters,
        ``*args``, a call Python would reject)."""
        if not self._fast or len(args) > len(self._positional):
            return None
        result = self._normalize_fast(args, kwargs)
        if result is None or result[0]:
            return None
        positional = {name: index for index, name in enumerate(self._positional[:len(args)])}
        steps = tuple((name, positional.get(name, -1)) for name in result[1])
        names = tuple(name for name, _ in steps)
        if not kwargs and [index for _, index in steps] == list(range(len(args))):
            # positional arguments only, bound in order: one C-level dict(zip()) (the common call, ~0.3 µs less)
            return lambda call_args, call_kwargs: ((), dict(zip(names, call_args)))
        return lambda call_args, call_kwargs: _apply_plan(steps, call_args, call_kwargs)

    def _normalize_fast(self, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        # Same result as the bind() path for signatures without positional-only params or *args;
        # returns None (=> inspect's binder) for anything unusual, so errors match Python's.
        given = dict(zip(self._positional, args))
        for name in kwargs:
            if name in given:
                return None
        keyword: dict = {}
        for name in self._names:
            if name in given:
                keyword[name] = given[name]
            elif name in kwargs:
                keyword[name] = kwargs[name]
            elif name in self._required:
                return None
        extra = [key for key in kwargs if key not in self._known]
        if extra:
            if self._var_keyword is None:
                return None
            for key in sorted(extra):
                keyword[key] = kwargs[key]
        return (), keyword


def _apply_plan(steps: tuple, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return (), {name: args[index] if index >= 0 else kwargs[name] for name, index in steps}


def positional_parameter_names(signature: CallSignature) -> list[str]:
    """Names of the parameters that canonical positional arguments bind to, in order."""
    if signature.signature is None:
        return []
    return [p.name for p in signature.signature.parameters.values()
            if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
