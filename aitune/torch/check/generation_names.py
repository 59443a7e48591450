"""Names transformers' ``generate`` keeps on a model between calls (its own bookkeeping), read from its code.

:class:`~aitune.torch.check.baked_state.BakedState` lets these attributes come and go on a tuned causal LM without
sending calls to eager, where no ``forward`` reads them (``_previous_max_cache_length``, set after the first
``generate``); transformers is never imported here (the class is found in a model's MRO by name).
"""

from __future__ import annotations

import dis
import functools
import types


@functools.lru_cache(maxsize=None)
def generation_bookkeeping(klass: type) -> frozenset[str]:
    """Attribute names transformers' ``GenerationMixin`` (found in ``klass``'s MRO by name) assigns or deletes in
    its methods' code: its own bookkeeping on the model between ``generate`` calls. Empty for other classes."""
    names: set[str] = set()
    for base in klass.__mro__:
        if base.__name__ == "GenerationMixin":
            for value in vars(base).values():
                function = getattr(value, "__func__", value)
                if isinstance(function, types.FunctionType):
                    _stored_names(function.__code__, names)
    return frozenset(names)


def _stored_names(code: types.CodeType, names: set[str]) -> None:
    for instruction in dis.get_instructions(code):
        if instruction.opname in ("STORE_ATTR", "DELETE_ATTR"):
            names.add(instruction.argval)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            _stored_names(constant, names)
