"""Which attribute names a module class's ``forward`` can read, found in its code (for
:class:`~aitune.torch.check.baked_state.BakedState`, NOTE [what a backend follows]: the attributes a baked backend
took for granted are those)."""

from __future__ import annotations

import functools
import types
from typing import Any

import torch


def read_names(klass: type) -> frozenset[str]:
    """Names ``klass.forward`` can read: attribute and global names and string constants of its code, of nested
    code, of wrapped or enclosed functions, and of the class's own methods and properties it names, transitively
    (``self._conv_forward`` -> ``self.stride``). ``torch.nn.Module``'s own methods are not followed."""
    return _read_names_cached(klass)[0]


def optional_names(klass: type) -> frozenset[str]:
    """Names ``klass``'s forward reads by string (``getattr(self, "name", default)``, ``hasattr``): attributes
    that may be added after tuning and still be read."""
    return _read_names_cached(klass)[1]


@functools.lru_cache(maxsize=None)
def _read_names_cached(klass: type) -> tuple[frozenset[str], frozenset[str]]:
    names: set[str] = set()
    strings: set[str] = set()
    todo = [klass.__dict__["forward"] for klass in klass.__mro__ if "forward" in klass.__dict__
            and klass is not torch.nn.Module]
    seen: set[int] = set()
    while todo:
        function = todo.pop()
        for code in _codes_of(function, seen):
            for name in code.co_names:
                if name not in names:
                    names.add(name)
                    todo.extend(klass_dict[name] for klass_dict in _own_dicts(klass) if name in klass_dict)
            strings.update(value for value in code.co_consts if isinstance(value, str) and value.isidentifier())
    return frozenset(names | strings), frozenset(strings)


def _own_dicts(klass: type) -> list:
    return [base.__dict__ for base in klass.__mro__ if base not in (torch.nn.Module, object)]


def _codes_of(function: Any, seen: set[int]) -> list:
    """Code objects behind a function, method, property, static/class method, or decorator wrapper."""
    found, todo = [], [function]
    while todo:
        item = todo.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, property):
            todo.extend((item.fget, item.fset))
        elif isinstance(item, (staticmethod, classmethod)):
            todo.append(item.__func__)
        elif isinstance(item, types.CodeType):
            found.append(item)
            todo.extend(value for value in item.co_consts if isinstance(value, types.CodeType))
        elif isinstance(item, types.FunctionType):
            todo.append(item.__code__)
            todo.append(getattr(item, "__wrapped__", None))
            todo.extend(cell.cell_contents for cell in item.__closure__ or () if _callable_cell(cell))
    return found


def _callable_cell(cell: Any) -> bool:
    try:
        return isinstance(cell.cell_contents, (types.FunctionType, property, staticmethod, classmethod))
    except ValueError:  # an empty cell
        return False
