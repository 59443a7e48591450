"""Names transformers' ``generate`` keeps on a model between calls (its own bookkeeping), read from its code.

:class:`~aitune.torch.check.baked_state.BakedState` lets these attributes come and go on a tuned causal LM without
sending calls to eager, where no ``forward`` reads them (``_previous_max_cache_length``, set after the first
``generate``); transformers is never imported here (the class is found in a model's MRO by name).
"""

from __future__ import annotations

import dis
import functools
import inspect
import types


GENERATION_CLASSES = ("GenerationMixin", "PreTrainedModel")  # generate's own code, and its auto-compile's cache


@functools.lru_cache(maxsize=None)
def generation_bookkeeping(klass: type) -> frozenset[str]:
    """Attribute names transformers' ``GenerationMixin`` and ``PreTrainedModel`` (found in ``klass``'s MRO by name)
    assign to or delete from ``self`` in their methods' code (decorated methods unwrapped): ``generate``'s own
    bookkeeping on the model between calls (``_previous_max_cache_length``; ``_compiled_call`` and
    ``_last_compile_config`` when it compiles the decode step). Empty for other classes."""
    names: set[str] = set()
    for base in klass.__mro__:
        if base.__name__ in GENERATION_CLASSES:
            for value in vars(base).values():
                function = inspect.unwrap(getattr(value, "__func__", value))
                if isinstance(function, types.FunctionType):
                    _stored_names(function.__code__, names)
    return frozenset(names)


def _stored_names(code: types.CodeType, names: set[str]) -> None:
    """Names ``code`` (and code nested in it) assigns to or deletes from ``self`` (its first argument)."""
    previous = None
    for instruction in dis.get_instructions(code):
        if (instruction.opname in ("STORE_ATTR", "DELETE_ATTR") and previous is not None
                and previous.opname.startswith("LOAD_FAST") and previous.argval == "self"):
            names.add(instruction.argval)
        previous = instruction
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            _stored_names(constant, names)
