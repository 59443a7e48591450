"""Where a tuned module's host time per call goes, stage by stage (no profiler's distortion).

:func:`stages` wraps the functions a tuned call goes through (``Dispatch.call`` and the stages it calls: the
LLM phase read, the cache counter's copy for a rewind, the baked-state check, the weight watch, the value gate,
the guard's counter, the backend's ``run``, the compiled callable, the CUDA-graph output copy) in timers, times
``calls`` calls of ``call`` and returns the mean host µs per call of each. A stage nested in another counts in
both (``run`` includes the compiled callable and the copy); ``call - stages`` is what the dispatch does between
them. Each timer adds ~0.2 µs (two ``perf_counter_ns`` reads), so the total reads a little above the untimed call.
:func:`profile_calls` is the profiler's view of the same calls (cProfile, own time; distorted, but it names every
function).

Used by ``benchmarks/wrapper_cost.py --stages/--profile``, ``benchmarks/llm_decode_host.py --stages`` and
``benchmarks/llm_generate.py --decode-calls N --stages M/--profile-decode FILE``.
"""

from __future__ import annotations

import contextlib
import cProfile
import pstats
import statistics
import time
from typing import Callable, Iterator

import torch

import aitune.torch.dispatch as dispatch_module
from aitune.torch.backend.accepted import ValueGate
from aitune.torch.check.baked_state import BakedState
from aitune.torch.check.guard import RuntimeGuard, StateWatch

_CLOCK = time.perf_counter_ns


def _timed(totals: dict, label: str, function: Callable) -> Callable:
    def timed(*args, **kwargs):
        started = _CLOCK()
        try:
            return function(*args, **kwargs)
        finally:
            totals[label] = totals.get(label, 0) + _CLOCK() - started
    return timed


@contextlib.contextmanager
def patched(owner, name: str, replacement) -> Iterator[None]:
    """``owner.name`` set to ``replacement`` for the ``with`` block, then put back as it was (removed where
    ``owner`` did not hold it itself, e.g. a method its class gives it). Used here and by
    ``benchmarks/generate_loop.py``."""
    original = vars(owner).get(name, _ABSENT)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        if original is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


_ABSENT = object()


@contextlib.contextmanager
def _patched(totals: dict, module, backend):
    """Timers around the stages of ``module``'s (an ``ait.Module``) calls served by ``backend``."""
    import aitune.torch.backend.inductor_jit as inductor_jit

    with contextlib.ExitStack() as stack:
        def patch(owner, name, label):
            stack.enter_context(patched(owner, name, _timed(totals, label, getattr(owner, name))))

        patch(dispatch_module.Dispatch, "call", "Dispatch.call (total)")
        # host time from entering the dispatch to entering the backend's run: what a GPU waits for before the launch
        entered: list = []
        call, run = dispatch_module.Dispatch.call, backend.run

        def marked_call(*args, **kwargs):
            entered.append(_CLOCK())
            try:
                return call(*args, **kwargs)
            finally:
                entered.clear()

        def marked_run(*args, **kwargs):
            if entered:
                label = "before the launch (Dispatch.call entry to backend.run entry)"
                totals[label] = totals.get(label, 0) + _CLOCK() - entered[0]
                entered.clear()  # (a guard check's second run is not a launch)
            return run(*args, **kwargs)

        stack.enter_context(patched(dispatch_module.Dispatch, "call", marked_call))
        patch(dispatch_module, "phase_call", "phase_call (phase, cache fill)")
        patch(dispatch_module.Dispatch, "_phase_route", "_phase_route")  # (a re-routing call counts twice)
        patch(dispatch_module, "counter_snapshot", "counter_snapshot (rewind copy)")
        patch(BakedState, "differs", "BakedState.differs")
        patch(BakedState, "module_differs", "BakedState.module_differs (after the launch)")
        patch(StateWatch, "changed", "StateWatch.changed")
        patch(ValueGate, "rejects", "ValueGate.rejects")
        patch(RuntimeGuard, "due", "RuntimeGuard.due")
        stack.enter_context(patched(backend, "run", marked_run))
        patch(backend, "run", "backend.run")
        if getattr(backend, "_compiled", None) is not None:
            patch(backend, "_compiled", "compiled callable")
        patch(inductor_jit, "clone_output", "clone_output")  # (Inductor JIT's copies; TorchAO's are not timed)
        patch(torch.compiler, "cudagraph_mark_step_begin", "cudagraph_mark_step_begin")
        yield


def stages(module, backend, call: Callable[[], object], calls: int = 2000, cuda: bool = False,
           before: Callable[[], object] | None = None, median: bool = False) -> dict[str, float]:
    """Mean host µs per call of each stage of ``calls`` calls of ``call`` (which calls the tuned ``module``,
    served by ``backend``), the device synchronised before each call on CUDA; ``before`` runs untimed before
    every call (e.g. rewinding a key/value cache). ``median``: each stage's median over the calls instead (a
    stage a call skipped counts 0 for it), which leaves out the run-time guard's periodic checks against eager and
    the every-64-calls checks. Keys: stage labels, and ``"untimed loop (sync and before() included)"``: the mean of
    the same calls without timers, measured before."""
    per_call: dict[str, list[float]] = {}
    last: dict[str, int] = {}

    def run_all(totals: dict | None = None):
        started = _CLOCK()
        for index in range(calls):
            if before is not None:
                before()
            if cuda:
                torch.cuda.synchronize()
            call()
            if totals is not None and median:  # (this call's share of each running total)
                for label, total in totals.items():
                    per_call.setdefault(label, [0.0] * index).append(total - last.get(label, 0))
                    last[label] = total
                for values in per_call.values():
                    values.extend([0.0] * (index + 1 - len(values)))
        return (_CLOCK() - started) / 1e3 / calls

    with torch.no_grad():
        for _ in range(20):
            if before is not None:
                before()
            call()
        plain = run_all()
        totals: dict = {}
        with _patched(totals, module, backend):
            for _ in range(20):
                if before is not None:
                    before()
                call()
            totals.clear()
            run_all(totals)
    if median:
        result = {label: statistics.median(values) / 1e3 for label, values in per_call.items()}
    else:
        result = {label: total / 1e3 / calls for label, total in totals.items()}
    result["untimed loop (sync and before() included)"] = plain
    return result


def profile_calls(call: Callable[[], object], calls: int, cuda: bool = False,
                  before: Callable[[], object] | None = None) -> pstats.Stats:
    """cProfile of ``calls`` calls of ``call``, the profiler on only around each call: ``before`` (e.g. rewinding a
    key/value cache) and, on CUDA, a device synchronisation run first, unprofiled, so every call starts with the
    device idle (as the timed calls do)."""
    profiler = cProfile.Profile()
    with torch.no_grad():
        for _ in range(calls):
            if before is not None:
                before()
            if cuda:
                torch.cuda.synchronize()
            profiler.enable()
            call()
            profiler.disable()
    return pstats.Stats(profiler)


def print_stages(title: str, result: dict[str, float]) -> None:
    print(f"## host µs per call, stage by stage: {title}")
    for label, value in sorted(result.items(), key=lambda item: -item[1]):
        print(f"  {label:44s} {value:9.2f}")
    total = result.get("Dispatch.call (total)")
    if total is not None:
        inner = sum(result.get(label, 0.0) for label in ("phase_call (phase, cache fill)", "_phase_route",
                                                          "counter_snapshot (rewind copy)",
                                                          "BakedState.differs", "StateWatch.changed",
                                                          "BakedState.module_differs (after the launch)",
                                                          "ValueGate.rejects", "RuntimeGuard.due", "backend.run"))
        print(f"  {'Dispatch.call outside the stages above':44s} {total - inner:9.2f}")
