"""Where a ``generate`` loop's time per token goes, path by path: the host time inside the model call, the rest of
the step, and (CUDA) the device's span of the call. The whole causal LM must be the tuned scope (``ait.Module(model,
...)`` driven by its own ``generate``), so that every path times the same call: the model's.

Each decode step of ``generate`` calls the model once with one new token per sequence. :func:`loop_split` times
those calls where the loop makes them: ``tuned`` at ``ait.Module.__call__`` (the view's route to it and generate's
own code fall outside), ``hf-compile`` at transformers' compiled call (``get_compiled_call``), ``eager-static`` at
the model's ``__call__``. Only one-token calls count (a prefill is left out wherever it is timed), and the last
step of each run. Per path, the median over runs of each run's per-step medians:

- ``period``: from one decode call's start to the next one's (host µs): the loop's time per token;
- ``inside``: from the call's start until it returns (host µs);
- ``outside``: ``period - inside``: generate's own work per step, its wait for the device included;
- ``device_span`` (CUDA only, a second set of rounds with events around each call): from an event recorded
  before the call to one recorded after it returns (µs on the device's clock): the device time the call takes in
  the loop, idle gaps while the host prepares the launch included;
- ``graph_checks_per_call`` (CUDA): cudagraph trees' invariant checks per decode call (the recorded graphs of the
  called function tried before one runs); beside the paths, the recorded graphs per compiled function.

Paths that swap what serves a decode call (the rest of the run as in the path they borrow):

- ``tuned-bare``: the tuned run, its decode calls sent past aitune's dispatch to the decode graph's backend
  (normalising plan, then ``Backend.run``: step marker, compiled callable, output copy): ``tuned - tuned-bare``
  is what the dispatch costs per token in the loop;
- ``tuned-via-hf`` (CUDA): the tuned run, its decode calls sent to transformers' compiled call instead, and
  ``hf-loop-ours`` (CUDA): transformers' own loop (auto-compile on) calling aitune's decode backend as
  ``tuned-bare`` does. With ``tuned-bare`` and ``hf-compile`` they cross how the call is reached with what is
  called. They run after the other paths: a compiled function called with another cache (other static addresses)
  records its CUDA graphs again;
- ``hf-loop-callable`` and ``hf-loop-marker`` (CUDA, crossed too): transformers' loop calling the decode backend's
  compiled callable with the layers of ``Backend.run`` peeled off: the callable alone (the normalising plan and
  the freezing flag kept, no CUDA-graph step marker, no output copy: transformers' loop copies the logits it keeps
  before the next step), and the callable after the step marker. Against ``hf-loop-ours`` (the whole ``run``:
  marker, contexts, copy) and ``hf-compile`` (transformers' own compiled call) they tell which layer costs what
  inside the loop.

A call timed in isolation (``llm_generate.py --decode-calls``) starts with the device idle and the host's caches
warm; inside the loop the same host work runs between generate's steps, so the two can differ: this module
measures the loop itself. Used by ``benchmarks/llm_generate.py --loop-split ROUNDS``.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from aitune.torch.module import Module
from benchmarks.dispatch_stages import patched as _patched, profile_calls

_CLOCK = time.perf_counter_ns
# run after the other paths (see the module docstring)
CROSSED = ("tuned-via-hf", "hf-loop-ours", "hf-loop-callable", "hf-loop-marker")


def _one_token(kwargs: dict) -> bool:
    tokens = kwargs.get("input_ids")
    return isinstance(tokens, torch.Tensor) and tokens.dim() == 2 and tokens.shape[1] == 1


class _CallTimes:
    """Host start/return times (ns) of every timed decode call, and CUDA events around them when ``use_events``."""

    def __init__(self, use_events: bool) -> None:
        self.calls: list[tuple[int, int]] = []
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.use_events = use_events

    def timed(self, function: Callable) -> Callable:
        """``function`` with its one-token calls timed (any other call passes untimed)."""
        def call(*args, **kwargs):
            if not _one_token(kwargs):
                return function(*args, **kwargs)
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




def decode_backend(wrapped):
    """``(GraphSpec, Backend)`` of the decode graph of ``wrapped`` (a tuned ``ait.Module``).

    Raises:
        StopIteration: ``wrapped`` has no decode graph.
    """
    graph = next(graph for graph in wrapped.graphs if getattr(graph, "phase", None) == "decode")
    return graph, wrapped.backends[graph.name]


def _decode_backend(wrapped) -> Callable:
    """The tuned decode graph's backend as a function of a call as given: the dispatch's normalising plan, then
    ``Backend.run`` as the dispatch calls it (no route, no check)."""
    normalise = _normaliser(wrapped)
    _, backend = decode_backend(wrapped)

    def call(*args, **kwargs):
        return backend.run(*normalise(args, kwargs), accepted=True)
    return call


def _normaliser(wrapped) -> Callable:
    """The dispatch's normalising step for a call as given: the plan its phase fast path keeps for the call's
    keyword names, else the signature's general normalisation."""
    dispatch = wrapped._self_dispatch

    def normalise(args, kwargs):
        plan = dispatch._phase_plans.get(tuple(kwargs)) if not args else None
        return plan(args, kwargs) if plan is not None else dispatch.signature.normalize(args, kwargs)
    return normalise


def _decode_callable(wrapped, marker: bool) -> Callable:
    """The tuned decode graph's compiled callable as a function of a call as given: the dispatch's normalising
    plan, the freezing flag the backend calls it under, and (``marker``) the CUDA-graph step marker first; no
    output copy, no other context (the loop runs under ``no_grad`` without autocast).

    Raises:
        TypeError: the decode graph's backend is not a ``torch.compile`` one (no compiled callable to call).
    """
    normalise = _normaliser(wrapped)
    _, backend = decode_backend(wrapped)
    compiled, freezing = getattr(backend, "_compiled", None), getattr(backend, "_freezing", None)
    if compiled is None or freezing is None:
        raise TypeError(f"the decode graph's backend {backend!r} has no compiled callable to call directly")

    def call(*args, **kwargs):
        normal_args, normal_kwargs = normalise(args, kwargs)
        if marker:
            torch.compiler.cudagraph_mark_step_begin()
        with freezing:
            return compiled(*normal_args, **normal_kwargs)
    return call


def _via(wrapped, decode: Callable) -> Callable:
    """``ait.Module.__call__`` with ``wrapped``'s one-token calls sent to ``decode`` (the call as given)."""
    serve = Module.__call__

    def call(self, *args, **kwargs):
        if self is not wrapped or args or not _one_token(kwargs):
            return serve(self, *args, **kwargs)
        return decode(**kwargs)
    return call


def _timing(path: str, model, times: _CallTimes, wrapped):
    """A context in which ``path``'s model calls inside generate are timed (and, for the swapping paths, served
    as the module docstring says)."""
    if path == "tuned":
        return _patched(Module, "__call__", times.timed(Module.__call__))
    if path == "tuned-bare":
        return _patched(Module, "__call__", times.timed(_via(wrapped, _decode_backend(wrapped))))
    if path == "tuned-via-hf":
        return _patched(Module, "__call__", times.timed(_via(wrapped, vars(model)["_compiled_call"])))
    if path == "hf-loop-ours":
        return _patched(type(model), "get_compiled_call", lambda self, config: times.timed(_decode_backend(wrapped)))
    if path in ("hf-loop-callable", "hf-loop-marker"):
        decode = _decode_callable(wrapped, path == "hf-loop-marker")
        return _patched(type(model), "get_compiled_call", lambda self, config: times.timed(decode))
    if path == "hf-compile":
        make = type(model).get_compiled_call
        return _patched(type(model), "get_compiled_call", lambda self, config: times.timed(make(self, config)))
    return _patched(type(model), "__call__", times.timed(type(model).__call__))


def loop_split(model, wrapped, paths: dict[str, Callable[[], object]], rounds: int,
               cuda: bool, profile_dir: str | None = None) -> tuple[dict[str, dict], dict]:
    """``(per path, compiled entries)``: per path the figures of the module docstring
    (µs) over ``rounds`` generate runs (on CUDA as many again with events), the paths' order rotating round by
    round (the crossed paths after the others, in their own rotation); compiled entries: on CUDA the recorded
    CUDA graphs per compiled function (:func:`_cudagraph_roots`), and Dynamo's cache entries on the model's
    forward (:func:`_dynamo_entries`).

    Args:
        model: the causal LM (its class is patched for the timing of the ``hf-compile``, ``hf-loop-ours`` and
            ``eager-static`` paths, only while they run).
        wrapped: the tuned ``ait.Module`` of ``model``, with a decode graph.
        paths: name (``tuned``, ``tuned-bare``, ``hf-compile``, ``eager-static``, ``tuned-via-hf``,
            ``hf-loop-ours``, ``hf-loop-callable``, ``hf-loop-marker``) -> a function running one ``generate`` of
            the run that path times.
        rounds: generate runs per path (and per pass: a second pass with events on CUDA).
        cuda: the model runs on CUDA (events, CUDA-graph counts).
        profile_dir: after the timed rounds, one more run per path under cProfile, written here as
            ``loop_<path>.txt`` (by own time, then by cumulative time; the call counts per decode step tell
            what each path does more, the times are inflated by the profiler itself).

    Raises:
        RuntimeError: a run with fewer than three timed decode calls.
    """
    per_run: dict[str, list[dict]] = {name: [] for name in paths}
    checks = {name: [0, 0] for name in paths}  # (cudagraph trees' invariant checks, decode calls) per path
    first = [name for name in paths if name not in CROSSED]
    crossed = [name for name in paths if name in CROSSED]
    for with_events in ((False, True) if cuda else (False,)):
        for group in (first, crossed):
            for index in range(rounds if group else 0):
                for name in group[index % len(group):] + group[:index % len(group)]:
                    times = _CallTimes(with_events)
                    with _timing(name, model, times, wrapped), _counted_checks(cuda, checks[name]), torch.no_grad():
                        paths[name]()
                    if cuda:
                        torch.cuda.synchronize()
                    per_run[name].append(_split(times, with_events))
                    checks[name][1] += len(times.calls)
    if profile_dir is not None:
        for name in first + crossed:
            try:
                _profiled(name, model, wrapped, paths[name], profile_dir)
            except Exception as exc:  # noqa: BLE001 - a failed profile must not lose the timed figures
                print(f"profile of path {name} failed: {type(exc).__name__}: {exc}")
    result = {}
    for name, runs in per_run.items():
        keys = [key for key in ("period", "inside", "outside", "device_span") if any(key in run for run in runs)]
        result[name] = {key: round(statistics.median(run[key] for run in runs if key in run), 1) for key in keys}
        result[name]["steps"] = min(run["steps"] for run in runs)
        if cuda:
            result[name]["graph_checks_per_call"] = round(checks[name][0] / max(checks[name][1], 1), 2)
    return result, {**(_cudagraph_roots() if cuda else {}), **_dynamo_entries(model)}


def _dynamo_entries(model) -> dict:
    """Dynamo's cache entries on the code of ``model``'s ``forward`` and each function it wraps (every
    ``torch.compile`` of the model — aitune's candidates of both phases, transformers' own — adds its compiled
    variants there, and a call tries them until one's guards hold): ``{"dynamo entries <function>": count}``."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    found, function = {}, type(model).forward
    while function is not None and hasattr(function, "__code__"):
        code = function.__code__
        name = f"dynamo entries {Path(code.co_filename).name}:{code.co_firstlineno}({code.co_name})"
        try:
            count = len(_debug_get_cache_entry_list(code))
        except Exception as exc:  # noqa: BLE001 - torch internals of another version: say so, keep the figures
            found[name] = f"unreadable: {type(exc).__name__}: {exc}"
            count = 0
        if count:
            found[name] = count
        function = getattr(function, "__wrapped__", None)
    return found


def _profiled(name: str, model, wrapped, run: Callable[[], object], directory: str) -> None:
    """One generate run of path ``name`` under cProfile, its statistics to ``directory/loop_<name>.txt``."""
    times = _CallTimes(False)
    with _timing(name, model, times, wrapped):
        stats = profile_calls(run, 1)
    steps = max(len(times.calls), 1)
    rows = [(calls, own, total, f"{'/'.join(Path(file).parts[-2:])}:{line}({function})")
            for (file, line, function), (_, calls, own, total, _) in stats.stats.items()]
    Path(directory).mkdir(parents=True, exist_ok=True)
    with open(Path(directory) / f"loop_{name}.txt", "w") as handle:
        print(f"# path {name}: one generate run under cProfile, {len(times.calls)} decode calls; the whole run's "
              "calls, own µs and cumulative µs divided by its decode calls (the prefill and set-up included: rows "
              "called once per step are per step; the profiler's own cost included)", file=handle)
        for title, column in (("by own time", 1), ("by cumulative time", 2)):
            print(f"## {title}", file=handle)
            for row in sorted(rows, key=lambda row: -row[column])[:50]:
                print(f"{row[0] / steps:9.2f} {row[1] / steps * 1e6:10.1f} {row[2] / steps * 1e6:10.1f}  {row[3]}",
                      file=handle)


def _split(times: _CallTimes, with_events: bool) -> dict:
    """One run's per-step medians (µs) from its timed decode calls, the last one left out."""
    if len(times.calls) < 3:
        raise RuntimeError(f"only {len(times.calls)} timed decode calls in a generate run: too few to split (is the "
                           "path's call patched where generate makes it?)")
    calls = times.calls[:-1]
    if with_events:
        spans = [before.elapsed_time(after) * 1e3 for before, after in times.events[:-1]]
        return {"device_span": statistics.median(spans), "steps": len(calls)}
    inside = [(returned - started) / 1e3 for started, returned in calls]
    period = [(times.calls[index + 1][0] - started) / 1e3 for index, (started, _) in enumerate(calls)]
    return {"period": statistics.median(period), "inside": statistics.median(inside),
            "outside": statistics.median(p - i for p, i in zip(period, inside)), "steps": len(calls)}


def _counted_checks(cuda: bool, count: list):
    """A context counting, into ``count[0]``, the recorded CUDA graphs (cudagraph trees' nodes) tried by the calls
    in it: each call checks its compiled function's recorded graphs until one's invariants hold."""
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
    with several was recorded again, e.g. for other static input addresses: its calls try them in turn)."""
    from torch._inductor.cudagraph_trees import get_manager

    try:
        manager = get_manager(torch.cuda.current_device(), create_if_none_exists=False)
        if manager is None:
            return {}
        return {f"{manager.get_func_name(function_id)}#{function_id.id}": len(nodes)
                for function_id, nodes in manager.roots.items() if nodes}
    except Exception as exc:  # noqa: BLE001 - torch internals of another version: say so, keep the figures
        return {"unreadable": f"{type(exc).__name__}: {exc}"}


def print_split(result: dict[str, dict], roots: dict) -> None:
    """The table of :func:`loop_split`'s figures."""
    print("a generate loop's decode step, µs (median over rounds of per-step medians)")
    print(f"  {'path':16s} {'period':>9s} {'inside':>9s} {'outside':>9s} {'device span':>12s} {'graphs tried':>12s}")
    for name, values in result.items():
        span, tried = values.get("device_span"), values.get("graph_checks_per_call")
        print(f"  {name:16s} {values['period']:9.1f} {values['inside']:9.1f} {values['outside']:9.1f} "
              f"{'' if span is None else f'{span:12.1f}'} {'' if tried is None else f'{tried:12.2f}'}")
    if roots:
        print("  recorded CUDA graphs at the trees' root, per compiled function, and Dynamo's cache entries:", roots)
