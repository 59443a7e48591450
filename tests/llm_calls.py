"""Helpers shared by the text-generation tests (``tests/unit/test_llm_generation.py`` and the GPU ones)."""

from __future__ import annotations

import contextlib
import copy
from typing import Callable, Iterator


def first_decode_call(model, run_generate: Callable[[], object]) -> dict:
    """The keyword arguments of the first decode call (one input token) of ``model.model`` while
    ``run_generate()`` runs, each deep-copied as it was before that call (the cache too)."""
    found = {}

    def spy(module, args, kwargs):
        if "call" not in found and kwargs.get("input_ids") is not None and kwargs["input_ids"].shape[1] == 1:
            found["call"] = {name: copy.deepcopy(value) for name, value in kwargs.items()}

    handle = model.model.register_forward_pre_hook(spy, with_kwargs=True)
    try:
        run_generate()
    finally:
        handle.remove()
    return found["call"]


@contextlib.contextmanager
def raising_after_the_run(backend, times: int) -> Iterator[list]:
    """``backend.run`` runs for real, then raises on its first ``times`` calls (a backend that fails after it
    wrote the cache); yields the list of those failures (one entry each)."""
    failures: list = []
    real_run = backend.run

    def run_then_raise(args, kwargs, **options):
        output = real_run(args, kwargs, **options)
        if len(failures) < times:
            failures.append(1)
            raise RuntimeError("simulated failure after the cache was written")
        return output

    backend.run = run_then_raise
    try:
        yield failures
    finally:
        del backend.run
