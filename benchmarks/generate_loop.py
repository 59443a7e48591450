"""Where a ``generate`` loop's time per token goes, path by path: the host time inside the model call, the rest of
the step, and (CUDA) the device's span of the call.

Each decode step of ``generate`` calls the model once. :func:`loop_split` times those calls where the loop makes
them: ``tuned`` at ``ait.Module.__call__`` (the view's route to it and generate's own code fall outside),
``hf-compile`` at transformers' compiled call (``get_compiled_call``), ``eager-static`` at the model's
``__call__``. Per step (the prefill call and the last step left out):

- ``period``: from one call's start to the next one's (host µs): the loop's time per token;
- ``inside``: from the call's start until it returns (host µs);
- ``outside``: ``period - inside``: generate's own work per step, its wait for the device included;
- ``tuned-bare``: the tuned path with its decode calls sent straight to the decode graph's compiled callable
  (:func:`_bare`): ``tuned - tuned-bare`` is what aitune's dispatch costs per token in the loop;
- ``tuned-via-hf`` (CUDA): the tuned path with its decode calls sent to transformers' compiled call instead, and
  ``hf-loop-ours`` (CUDA): transformers' own loop (auto-compile on) calling aitune's compiled decode graph as
  ``tuned-bare`` does: with ``tuned-bare`` and ``hf-compile``, which of the two — how the call is reached or
  what is called — makes a difference;
- ``graph_checks_per_call`` (CUDA): cudagraph trees' invariant checks per model call (the recorded graphs of the
  called function tried before one runs), and ``cudagraph_roots``: recorded graphs per compiled function;
- ``device_span`` (CUDA only, a second set of rounds with events around each call): from an event recorded
  before the call to one recorded after it returns (µs on the device's clock): the device time the call takes in
  the loop, idle gaps while the host prepares the launch included.

A call timed in isolation (``llm_generate.py --decode-calls``) starts with the device idle and the host's caches
warm; inside the loop the same host work runs between generate's steps, so the two can differ: this module
measures the loop itself. Used by ``benchmarks/llm_generate.py --loop-split ROUNDS``.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable

import torch

from aitune.torch.module import Module

_CLOCK = time.perf_counter_ns


class _CallTimes:
    """Host start/return times (ns) of every timed call, and CUDA events around them when ``events``."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.use_events = False

    def timed(self, function: Callable) -> Callable:
        def call(*args, **kwargs):
            started = _CLOCK()
            if self.use_events:
                before = torch.cuda.Event(enable_timing=True)
                before.record()
            output = function(*args, **kwargs)
            returned = _CLOCK()
            if self.use_events:
                after = torch.cuda.Event(enable_timing=True)
                after.record()
                self.events.append((before, after))
            self.calls.append((started, returned))
            return output
        return call


@contextlib.contextmanager
def _patched(owner, name: str, replacement) -> None:
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


def _bare(wrapped) -> Callable:
    """``ait.Module.__call__`` with ``wrapped``'s decode calls sent straight to its decode graph's compiled callable
    (CUDA-graph step marker, normalising plan and output copy kept; no route, no check): the floor of what serving
    them can cost, for the ``tuned-bare`` path. Every other call is served as usual."""
    from aitune.torch.backend.inductor_jit import clone_output

    dispatch = wrapped._self_dispatch
    graph = next(graph for graph in wrapped.graphs if getattr(graph, "phase", None) == "decode")
    compiled = wrapped.backends[graph.name]._compiled
    serve = Module.__call__

    def call(self, *args, **kwargs):
        plan = dispatch._phase_plans.get(tuple(kwargs)) if not args else None
        tokens = kwargs.get("input_ids")
        if self is not wrapped or plan is None or tokens is None or tokens.shape[1] != 1:
            return serve(self, *args, **kwargs)
        torch.compiler.cudagraph_mark_step_begin()
        normal_args, normal_kwargs = plan(args, kwargs)
        return clone_output(compiled(*normal_args, **normal_kwargs))
    return call


def _compiled_decode(wrapped) -> Callable:
    """The tuned decode graph's compiled callable as ``_bare`` calls it (step marker, plan, output copy), as a
    function of the call as given."""
    from aitune.torch.backend.inductor_jit import clone_output

    dispatch = wrapped._self_dispatch
    graph = next(graph for graph in wrapped.graphs if getattr(graph, "phase", None) == "decode")
    compiled = wrapped.backends[graph.name]._compiled

    def call(*args, **kwargs):
        plan = dispatch._phase_plans.get(tuple(kwargs)) if not args else None
        torch.compiler.cudagraph_mark_step_begin()
        normal_args, normal_kwargs = plan(args, kwargs) if plan is not None else dispatch.signature.normalize(
            args, kwargs)
        return clone_output(compiled(*normal_args, **normal_kwargs))
    return call


def _via(wrapped, decode: Callable) -> Callable:
    """``ait.Module.__call__`` with ``wrapped``'s one-token calls sent to ``decode`` (the call as given)."""
    serve = Module.__call__

    def call(self, *args, **kwargs):
        tokens = kwargs.get("input_ids")
        if self is not wrapped or args or tokens is None or tokens.shape[1] != 1:
            return serve(self, *args, **kwargs)
        return decode(**kwargs)
    return call


def _timing(path: str, model, times: _CallTimes, wrapped=None):
    """A context in which ``path``'s model calls inside generate are timed."""
    if path == "tuned":
        return _patched(Module, "__call__", times.timed(Module.__call__))
    if path == "tuned-bare":
        return _patched(Module, "__call__", times.timed(_bare(wrapped)))
    if path == "tuned-via-hf":  # the wrapper's decode calls to transformers' compiled call (made by hf-compile)
        return _patched(Module, "__call__", times.timed(_via(wrapped, vars(model)["_compiled_call"])))
    if path == "hf-loop-ours":  # transformers' loop calling aitune's compiled decode graph
        return _patched(type(model), "get_compiled_call",
                        lambda self, config: times.timed(_compiled_decode(wrapped)))
    if path == "hf-compile":
        make = type(model).get_compiled_call
        return _patched(type(model), "get_compiled_call", lambda self, config: times.timed(make(self, config)))
    return _patched(type(model), "__call__", times.timed(type(model).__call__))


def loop_split(model, paths: dict[str, Callable[[], object]], rounds: int, cuda: bool,
               wrapped=None) -> dict[str, dict]:
    """Per path, the medians over ``rounds`` generate runs of each run's per-step medians (µs; see the module
    docstring): ``period``, ``inside``, ``outside`` and, on CUDA, ``device_span`` (from as many rounds again, with
    events). ``paths``: name (``tuned``, ``tuned-bare``, ``hf-compile``, ``eager-static``) -> a function running one
    ``generate`` of that path (``tuned-bare``: the tuned path's, run with :func:`_bare`'s call); the paths alternate
    round by round. ``model``: the causal LM (its class is patched for the timing of the ``hf-compile`` and
    ``eager-static`` paths, only while they run); ``wrapped``: the tuned ``ait.Module`` (for ``tuned-bare``)."""
    per_run: dict[str, list[dict]] = {name: [] for name in paths}
    checks = {name: [0, 0] for name in paths}  # CUDA-graph tree nodes tried per path: (invariant checks, steps)
    for with_events in ((False, True) if cuda else (False,)):
        for _ in range(rounds):
            for name, run in paths.items():
                times = _CallTimes()
                times.use_events = with_events
                with _timing(name, model, times, wrapped), _counted_checks(cuda, checks[name]), torch.no_grad():
                    run()
                if cuda:
                    torch.cuda.synchronize()
                per_run[name].append(_split(times, with_events))
                checks[name][1] += len(times.calls)
    result = {}
    for name, runs in per_run.items():
        keys = [key for key in ("period", "inside", "outside", "device_span") if any(key in run for run in runs)]
        result[name] = {key: round(statistics.median(run[key] for run in runs if key in run), 1) for key in keys}
        result[name]["steps"] = min(run["steps"] for run in runs)
        if cuda:
            result[name]["graph_checks_per_call"] = round(checks[name][0] / max(checks[name][1], 1), 2)
    if cuda:
        result["cudagraph_roots"] = _cudagraph_roots()
    return result


def _counted_checks(cuda: bool, count: list):
    """A context counting, into ``count[0]``, the recorded CUDA graphs (cudagraph trees' nodes) tried per call
    before one runs: each call checks the candidates for its compiled function until one's invariants hold."""
    if not cuda:
        return contextlib.nullcontext()
    from torch._inductor.cudagraph_trees import CUDAGraphNode

    check = CUDAGraphNode.check_invariants

    def counted(self, inputs):
        count[0] += 1
        return check(self, inputs)
    return _patched(CUDAGraphNode, "check_invariants", counted)


def _cudagraph_roots() -> dict:
    """Recorded CUDA graphs per compiled function at the root of cudagraph trees on the current device (a function
    with several was re-recorded, e.g. for other static input addresses: every call tries them in turn)."""
    from torch._inductor.cudagraph_trees import get_manager

    try:
        manager = get_manager(torch.cuda.current_device(), create_if_none_exists=False)
        if manager is None:
            return {}
        return {f"{manager.get_func_name(function_id)}#{function_id.id}": len(nodes)
                for function_id, nodes in manager.roots.items()}
    except Exception as exc:  # noqa: BLE001 - torch internals of another version: say so, keep the figures
        return {"unreadable": f"{type(exc).__name__}: {exc}"}


def _split(times: _CallTimes, with_events: bool) -> dict:
    calls = times.calls[1:]  # the prefill call left out
    if len(calls) < 3:
        raise RuntimeError(f"only {len(times.calls)} timed model calls in a generate run: too few decode steps to "
                           "split (is the path's call patched where generate makes it?)")
    if with_events:
        spans = [before.elapsed_time(after) * 1e3 for before, after in times.events[1:]]
        return {"device_span": statistics.median(spans), "steps": len(calls)}
    inside = [(returned - started) / 1e3 for started, returned in calls[:-1]]
    period = [(calls[index + 1][0] - calls[index][0]) / 1e3 for index in range(len(calls) - 1)]
    return {"period": statistics.median(period), "inside": statistics.median(inside),
            "outside": statistics.median(p - i for p, i in zip(period, inside)), "steps": len(calls)}


def print_split(result: dict[str, dict]) -> None:
    print("a generate loop's decode step, µs (median over rounds of per-step medians)")
    print(f"  {'path':14s} {'period':>9s} {'inside':>9s} {'outside':>9s} {'device span':>12s} {'graphs tried':>12s}")
    for name, values in result.items():
        if name == "cudagraph_roots":
            continue
        span, tried = values.get("device_span"), values.get("graph_checks_per_call")
        print(f"  {name:14s} {values['period']:9.1f} {values['inside']:9.1f} {values['outside']:9.1f} "
              f"{'' if span is None else f'{span:12.1f}'} {'' if tried is None else f'{tried:12.2f}'}")
    if result.get("cudagraph_roots"):
        print("  recorded CUDA graphs at the trees' root, per compiled function:", result["cudagraph_roots"])
