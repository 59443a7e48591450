"""After tuning: run-time checks against eager, and stale weights.

Two mechanisms protect a tuned module once it serves calls:

:class:`RuntimeGuard` (one per tuned graph)
    re-runs eager on some calls and compares: the first call of every input signature (tensor shapes) the
    tuner never checked, and one call in N. On a mismatch the backend is retired for that graph: the call
    returns eager's result, the next-best candidate that passed tuning takes over if it also gets *this*
    input right (else eager), one warning names the error measured and the input's shape, and the event
    is recorded (``Module.stats``, the report of a later ``ait.save``).

    NOTE [guard cost]: a checked call costs one extra eager call plus a comparison. With a candidate
    ``s`` times faster than eager, checking one call in ``N`` adds about ``s / N`` to the serving time, so
    the default ``N`` is ``ceil(s / 0.02)`` (2 % at most), capped at ``max_check_every`` (1000; also the ``N``
    when the speed-up is unknown) so that no speed-up figure, however large, turns the periodic check all
    but off; past 20x the cap costs more than 2 % (50x: ~5 %). The comparison (and the copy of the backend's
    output) can cost more than the eager call on a small module, several times a served call
    (``benchmarks/wrapper_cost.py`` prints the checks' share of the mean), so each check's time is measured
    and ``N`` widens, at most doubling per check, until the cheapest check seen, beyond one served call (the
    row's measured p50; where the tune marked that p50 or its speed-up noisy and even the quickest whole check
    took less than it, the least time the backend's own run took in a check, until its output was ready: a
    tune timed on a loaded machine reported a small MLP's p50 at 8-18 ms against ~0.1 ms and a speed-up far
    below 1, which made ``N`` 1 and re-ran eager at every call), costs at most 2 % of ``N`` served calls,
    never past ``max_check_every``. A check whose run raised is not counted. ``s`` is the
    tune row's paired speed-up (the median of per-round ratios, NOTE [paired speed-up] in
    :mod:`aitune.torch.measure.profiling`), or its lower quartile when that figure is marked noisy.
    Signatures are remembered up to ``max_signatures``; the per-call cost of an unchecked call is building
    a tuple of shapes and a set lookup (a few µs; ``benchmarks/trust_overhead.py`` measures it).

:class:`StateWatch` (one per tuned module whose backends bake weights in)
    notices parameters or buffers replaced or changed after tuning — ``load_state_dict`` (in place and
    ``assign=True``), ``.to()``/``.half()``/``.cuda()``, in-place edits — before the next call reaches a
    backend that baked the old values in (Inductor AOT, ONNX Runtime, TensorRT, TorchAO's quantized copy).
    Per call it sums the tensors' version counters (in-place writes, ``copy_`` in ``load_state_dict``), reads
    the first tensor's data pointer, dtype and device (``.half()``/``.to()``/``.cuda()`` of the model replace
    every tensor's ``.data`` without touching the versions) and a global counter bumped by PyTorch's
    parameter/buffer registration hooks (``assign=True``); every ``FULL_SCAN_EVERY`` (16) calls it also sums
    all data pointers, which catches a ``.data`` replaced on one tensor or a ``.to()`` of one submodule within
    16 calls. No hashing. Cost: tens of ns per parameter/buffer per call. Where aitune's small C++ extension is
    built (NOTE [native watch] in :mod:`aitune.torch.check.native_watch`), one C call reads every tensor's version
    counter, data pointer, dtype and device instead, several times faster (``benchmarks/state_watch_cost.py`` times
    both), so a ``.data`` replaced is noticed at the next call too.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
import time
from typing import Any, Callable

import torch

from aitune.errors import ConfigError
from aitune.torch.common.arguments import KnownFields
from aitune.torch.check.correctness import comparator_for
from aitune.torch.check.native_watch import state_reader
from aitune.torch.measure.profiling import NOISY_SPREAD
from aitune.torch.record.pytree import tree_flatten
from aitune.torch.record.samples import clone_tree

logger = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True)
class GuardConfig(KnownFields):
    """Run-time checks of a tuned module against eager.

    Args:
        enabled: check at all (default True).
        check_unseen_shapes: check the first call of every input signature (tensor shapes) that tuning
            never checked (default True).
        check_every: check one call in N; None (default) = ``ceil(speed-up / max_overhead)`` from the speed-up
            measured at tuning, widened once checks are seen to cost more than that allows (NOTE [guard cost]),
            at most ``max_check_every`` (which is also N when the speed-up is unknown); 0 = never.
        max_overhead: the share of serving time the periodic eager re-runs may cost with ``check_every=None``
            (default 0.02 = 2 %).
        max_signatures: input signatures remembered per graph, the ones checked at tuning included; once
            that many are remembered, a call of a new signature is no longer checked for being new (only the
            periodic check runs), so serving many shapes never re-runs eager on every call.
        max_check_every: the largest N that ``check_every=None`` derives (default 1000): a wildly large
            speed-up figure cannot switch the periodic check off (NOTE [guard cost]).

    Raises:
        ConfigError: on a negative count, a ``max_check_every`` below 1 or an overhead outside (0, 1].
    """

    enabled: bool = True
    check_unseen_shapes: bool = True
    check_every: int | None = None
    max_overhead: float = 0.02
    max_signatures: int = 1024
    max_check_every: int = 1000

    def __post_init__(self):
        for name in ("enabled", "check_unseen_shapes"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"GuardConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.check_every is not None and (not isinstance(self.check_every, int) or isinstance(
                self.check_every, bool) or self.check_every < 0):
            raise ConfigError(f"GuardConfig.check_every must be None or an int >= 0, got {self.check_every!r}")
        if not isinstance(self.max_overhead, (int, float)) or not 0 < self.max_overhead <= 1:
            raise ConfigError(f"GuardConfig.max_overhead must lie in (0, 1], got {self.max_overhead!r}")
        if not isinstance(self.max_signatures, int) or self.max_signatures < 0:
            raise ConfigError(f"GuardConfig.max_signatures must be an int >= 0, got {self.max_signatures!r}")
        if not isinstance(self.max_check_every, int) or isinstance(self.max_check_every, bool) or \
                self.max_check_every < 1:
            raise ConfigError(f"GuardConfig.max_check_every must be an int >= 1, got {self.max_check_every!r}")

    def interval(self, speedup: float | None) -> int:
        """The N of "one call in N" for a candidate measured ``speedup`` x eager (0 = never): ``check_every`` when
        set, else ``ceil(speedup / max_overhead)`` within ``[1, max_check_every]`` (``max_check_every`` for an
        unknown speed-up)."""
        if self.check_every is not None:
            return self.check_every
        if speedup is None or not math.isfinite(speedup) or speedup <= 0:
            return self.max_check_every
        return min(self.max_check_every, max(1, math.ceil(speedup / self.max_overhead)))


def guard_speedup(row: dict | None) -> float | None:
    """The speed-up the guard's interval is derived from: the row's ``speedup`` (the paired median), or the
    lower quartile of its per-round ratios when ``speedup_spread`` marks it noisy (a smaller N: more checks).
    None when the row has no speed-up."""
    row = row or {}
    speedup, spread = row.get("speedup"), row.get("speedup_spread") or {}
    if speedup is not None and spread.get("noisy") and spread.get("q25") is not None:
        return min(float(speedup), float(spread["q25"]))
    return speedup


def signature(leaves: list) -> tuple:
    """The shapes of a call's tensor leaves (the graph key already fixes structure, dtypes and constants)."""
    return tuple([leaf.shape for leaf in leaves if isinstance(leaf, torch.Tensor)])


@dataclasses.dataclass
class GuardEvent:
    """A mismatch the guard saw: where, which backend, the error measured, the input's shapes, what took over."""

    graph: str
    backend: str
    reason: str
    input_shapes: list
    replaced_by: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class RuntimeGuard:
    """Checks some calls of one tuned graph against eager (see the module docstring).

    Args:
        graph_name: for messages. config: :class:`GuardConfig`.
        compare: ``compare(eager_output, backend_output, backend)`` raising a CorrectnessError on a mismatch
            (the comparator and tolerance ``backend`` is judged by).
        seen: signatures already checked at tuning (recorded samples and probes).
        speedup: the chosen backend's measured speed-up over eager (None when unknown).
        fallbacks: next-best backends that passed tuning, best first (eager is the last resort).
    """

    def __init__(self, graph_name: str, config: GuardConfig, compare: Callable[[Any, Any], None], seen: set,
                 speedup: float | None, fallbacks: list | None = None, serving_s: float | None = None,
                 clock: Callable[[], float] = time.perf_counter, serving_noisy: bool = False):
        self.graph_name = graph_name
        self.config = config
        self.compare = compare
        self.seen = set(seen)
        self.interval = config.interval(speedup)
        self._base_interval = self.interval
        self.fallbacks = list(fallbacks or [])
        self.calls = 0
        self.checks = 0
        self.events: list[GuardEvent] = []
        # NOTE [guard cost]: the seconds a call of the chosen backend takes (its measured p50) and the least a
        # check cost beyond such a call (s; None until one ran); for a p50 the tune marked noisy also the least
        # time a whole check took and the least the backend's own run in a check took
        self.serving_s = serving_s if serving_s is not None and serving_s > 0 else None
        self.serving_noisy = serving_noisy
        self.check_s: float | None = None
        self.least_s: float | None = None
        self.backend_s: float | None = None
        self._clock = clock

    def due(self, leaves: list) -> bool:
        """Should this call be checked? Counts the call (``stats()['calls']``: the calls that asked, which after the
        launch are those the backend answered and the weight watch and the module check let through)."""
        self.calls += 1
        if self.interval and self.calls % self.interval == 0:
            return True
        if self.config.check_unseen_shapes and len(self.seen) < self.config.max_signatures:
            # Once the table is full only the periodic check runs (GuardConfig.max_signatures): checking
            # every call of a shape it can no longer remember would re-run eager on all of them.
            key = signature(leaves)
            if key not in self.seen:
                self.seen.add(key)
                return True
        return False

    def undo_due(self, leaves: list) -> None:
        """Take back what :meth:`due` noted for a call it chose that then ran eager without a check: its input
        shapes count as unchecked again (shapes checked before are then checked once more)."""
        self.seen.discard(signature(leaves))

    def check(self, backend, run_backend: Callable[[Any], Any], run_eager: Callable[[], Any], leaves: list,
              served: Any = None):
        """Compare the backend's output for this call (run here, or ``served``) with eager's.

        Args:
            served: a one-item tuple holding the output ``backend`` already gave for this call (NOTE [guard after
                launch] in aitune/torch/dispatch.py): it is compared instead of running ``backend`` again; the clock
                starts once it is computed (on CUDA: its stream is waited for), so all of the check's time is its
                extra cost. None: ``run_backend(backend)`` runs it (always for a guard whose serving p50 is noisy,
                which times the backend's own run).

        Raises:
            ValueError: ``served`` given to a guard whose serving p50 is noisy.

        Returns:
            ``(output, replacement)``: the output to return (the backend's when it matches, else eager's) and
            the backend that serves this graph from now on (``backend`` itself, a fallback that gets this
            input right, or None for eager).
        """
        if served is not None:
            if self.serving_noisy:
                raise ValueError("a guard whose serving p50 is noisy times the backend's own run: pass no output")
            _wait_for(served[0])  # (a GPU backend's kernels are not the check's cost)
        self.checks += 1
        started = self._clock()
        output, replacement = self._check(backend, run_backend, run_eager, leaves, served)  # (a check that raised:
        self._count_cost(self._clock() - started, served is not None)  # not counted, its short time says nothing)
        if replacement is not backend:  # the retired backend's own times go with it
            self.least_s = self.backend_s = None
        return output, replacement

    def _count_cost(self, elapsed_s: float, extra_only: bool = False) -> None:
        """Widen the derived interval so that checks costing ``elapsed_s`` stay within ``max_overhead`` of the
        serving time (NOTE [guard cost]); an explicit ``check_every`` and an unknown serving time are kept.
        ``extra_only``: ``elapsed_s`` holds no run of the served backend (its output was given), so all of it is
        the check's extra cost.

        The interval at most doubles per check: one slow check (a new shape compiling, a cold cache) does not put
        the guard to sleep for ``max_check_every`` calls; a check that stays that costly widens it again next time.
        """
        if self.config.check_every is not None or self.serving_s is None or not self.interval:
            return
        serving = self.serving_s
        if self.serving_noisy:
            self.least_s = elapsed_s if self.least_s is None else min(self.least_s, elapsed_s)
            if self.backend_s is not None and self.least_s < serving:
                # a whole check (a backend run, an eager run, the comparison) took less than one served call by a
                # p50 the tune marked noisy: timed on a loaded machine (its speed-up, far below 1, may have made
                # the base interval 1); the backend's own runs in checks stand in, so the guard does not go on
                # re-running eager at every call
                serving = self.backend_s
            self.check_s = max(0.0, self.least_s - serving)  # (one reference for every check: the least)
        else:  # the checked call stands in for one served call, where it ran one
            extra = elapsed_s if extra_only else max(0.0, elapsed_s - serving)
            self.check_s = extra if self.check_s is None else min(self.check_s, extra)  # noise only adds
        needed = math.ceil(self.check_s / (self.config.max_overhead * serving))
        self.interval = min(self.config.max_check_every, max(self._base_interval, min(needed, 2 * self.interval)))

    def _check(self, backend, run_backend, run_eager, leaves, served=None):
        if served is not None:
            output = served[0]
        elif self.serving_noisy:  # (NOTE [guard cost]: the backend's own run, until its output is ready)
            started = self._clock()
            output = run_backend(backend)
            _wait_for(output)
            ran = self._clock() - started
            self.backend_s = ran if self.backend_s is None else min(self.backend_s, ran)
        else:
            output = run_backend(backend)
        output = clone_tree(output)
        expected = run_eager()
        try:
            self.compare(expected, output, backend)
            return output, backend
        except Exception as exc:  # noqa: BLE001 - any disagreement retires the backend for this graph
            reason = str(exc).splitlines()[0][:300]
        replacement = None
        while self.fallbacks:
            candidate = self.fallbacks.pop(0)
            try:
                self.compare(expected, clone_tree(run_backend(candidate)), candidate)
            except Exception:  # noqa: BLE001 - this one is wrong here too: try the next
                candidate.deactivate()
                continue
            replacement = candidate
            break
        shapes = [list(shape) for shape in signature(leaves)]
        self.events.append(GuardEvent(self.graph_name, backend.name, reason, shapes,
                                      replacement.name if replacement is not None else "eager"))
        return expected, replacement

    def stats(self) -> dict:
        return {"calls": self.calls, "checks": self.checks, "check_every": self.interval,
                "events": [event.to_dict() for event in self.events]}


def _wait_for(output: Any) -> None:
    """Wait until ``output``'s first CUDA tensor is computed (its device's current stream): a run's host time is
    then its device time too, as the tune's p50 (CUDA events); nothing on the CPU."""
    for leaf in tree_flatten(output)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
            torch.cuda.current_stream(leaf.device).synchronize()
            return


def guard_for(config: GuardConfig, graph, backend, tolerance, row: dict | None, checked: set,
              fallbacks: list | None = None) -> RuntimeGuard | None:
    """The run-time guard of one tuned graph, or None where re-running eager is not possible or pointless:
    guard off, eager itself chosen, a stateful graph (a second run would advance the module's state), a
    graph whose ``forward`` changes its inputs in place, a nondeterministic graph (``graph.nondeterministic``:
    two runs of it differ, and seeding the caller's own call would change what it returns), or one whose eager
    runs differ by rounding (``graph.rounding_spread``: a per-call comparison could fail on eager's own spread).

    Args:
        config: the module's :class:`GuardConfig`. graph: the tuned graph. backend: the chosen backend.
        tolerance: the :class:`~aitune.torch.check.correctness.Tolerance` it was tuned with.
        row: its report row as a dict (speed-up; the comparison's metric and errors), or None.
        checked: input signatures already checked at tuning. fallbacks: next-best passing backends.

    NOTE [guard tolerance]: an fp16/bf16 candidate that passed tuning by correctness rule 5 (no less
    accurate than eager against an fp32 run) cannot be re-judged that way per call without an fp32 copy of
    the module; the guard then allows twice the largest error measured at tuning.
    """
    if not config.enabled or getattr(backend, "passthrough", False) or graph.stateful or graph.mutated_inputs \
            or getattr(graph, "nondeterministic", None) is not None or getattr(graph, "rounding_spread", None):
        return None
    row = row or {}
    comparison = row.get("comparison") or {}
    if "fp32-parity" in str(comparison.get("metric", "")):
        loose = 2 * float(comparison.get("max_abs_error") or 0.0)
        tolerance = dataclasses.replace(tolerance, low_precision_atol=max(tolerance.low_precision_atol, loose),
                                        atol=max(tolerance.atol, loose))

    def compare(expected, actual, chosen) -> None:
        comparator_for(chosen, tolerance).compare(expected, actual)

    measurement = row.get("measurement") or {}
    p50_ms = measurement.get("p50_ms")
    noisy = bool((row.get("speedup_spread") or {}).get("noisy")) or (measurement.get("noise") or 0) > NOISY_SPREAD
    return RuntimeGuard(graph.name, config, compare, checked, guard_speedup(row), fallbacks,
                        serving_s=float(p50_ms) / 1000 if p50_ms else None, serving_noisy=noisy)


# ------------------------------------------------------------------------------------------ stale weights

FULL_SCAN_EVERY = 16  # calls between full data-pointer scans (see StateWatch)
_REGISTRATIONS = [0]  # bumped by PyTorch's global parameter/buffer/module registration hooks
_HOOKS: list = []
VERSION = operator.attrgetter("_version")  # a tensor's version counter (bumped by in-place writes)
_DATA_PTR = torch.Tensor.data_ptr


def _count_registration(*_args) -> None:
    _REGISTRATIONS[0] += 1


def _count_module_registration(*_args) -> None:
    # NOTE [registrations while compiling]: a forward that builds modules as it runs (``self.layers[:n]`` makes a
    # new ModuleList, as transformers' decoders do on every call) fires the module registration hook inside a
    # torch.compile trace. Counted there, dynamo would guard on the counter, which that same forward bumps: every
    # later call would recompile, until the recompile limit leaves the module to run eagerly. A module registered
    # inside a compiled forward is taken as transient and not counted. Parameters and buffers registered there
    # are counted (dynamo replays such an assignment without the hooks, so the counter is the only sign of it).
    if torch.compiler.is_compiling():
        return
    _REGISTRATIONS[0] += 1


def watch_registrations() -> None:
    """Install PyTorch's global parameter/buffer/module registration hooks that count registrations (StateWatch
    reads the count), once per process; every aitune compile calls it before ``torch.compile``.

    NOTE [registration hooks before compiling]: Dynamo guards a compiled forward that registers modules as it runs
    (transformers' decoders slice ``self.layers``) on whether any global module registration hook exists. Installed
    only by the first StateWatch, after a tune whose chosen backend bakes the weights, the hooks made every entry
    compiled during that tune fail its guard at the first call after it: transformers' decoder recompiled its
    prefill and decode graphs there (82.6 s for a Qwen2-0.5B-sized model on an H100; on this project's CPU two new
    graphs for the tiny test decoder, ``tests/unit/test_llm_generation.py``)."""
    if _HOOKS:
        return
    from torch.nn.modules import module as nn_module

    for name, hook in (("register_module_parameter_registration_hook", _count_registration),
                       ("register_module_buffer_registration_hook", _count_registration),
                       ("register_module_module_registration_hook", _count_module_registration)):
        register = getattr(nn_module, name, None)
        if register is not None:
            _HOOKS.append(register(hook))


class StateWatch:
    """Notices a module's parameters/buffers changed or replaced since tuning (see the module docstring).

    Args:
        module: the user's module (observed, never modified).
    """

    def __init__(self, module: torch.nn.Module):
        watch_registrations()
        self.module = module
        self._snapshot()
        self.reason: str | None = None

    def _snapshot(self) -> None:
        named = named_state(self.module)
        self.names = [name for name, _ in named]
        self.tensors = [tensor for _, tensor in named]
        self.versions = [tensor._version for tensor in self.tensors]
        self.pointers = [tensor.data_ptr() for tensor in self.tensors]
        self.dtypes = [(tensor.dtype, tensor.device) for tensor in self.tensors]
        self.version_sum = sum(self.versions)
        self.pointer_sum = sum(self.pointers)
        self.registrations = _REGISTRATIONS[0]
        self.submodules = list(map(id, self.module.modules()))  # a submodule swapped for another (no new weights)
        self.first = self.tensors[0] if self.tensors else None
        # (Tensor.get_device(): an int, no torch.device built per call; -1 off CUDA, where .to() also moves data)
        self.first_facts = (self.pointers[0], self.tensors[0].dtype, self.tensors[0].get_device()) \
            if self.tensors else None
        self.calls = 0
        # NOTE [native watch]: one C call reads every version counter, data pointer, dtype and device
        native = state_reader(self.tensors)
        self.reader = native.state if native is not None else None
        self.reader_state = self.reader() if native is not None else None

    def changed(self) -> str | None:
        """None while the state is as tuned; else (and from then on) what changed, e.g.
        ``parameter '0.weight' was changed in place``."""
        if self.reason is not None:
            return self.reason
        reader = self.reader
        if reader is not None:
            try:
                if reader() == self.reader_state and _REGISTRATIONS[0] == self.registrations:
                    return None
            except RuntimeError:  # a tensor swapped for one whose data torch will not hand out: Python reads now
                logger.debug("native weight watch dropped for this module", exc_info=True)
                self.reader = reader = None
        if reader is None:
            tensors = self.tensors
            self.calls += 1
            first = self.first
            if (sum(map(VERSION, tensors)) == self.version_sum and _REGISTRATIONS[0] == self.registrations
                    and (first is None or (first.data_ptr(), first.dtype, first.get_device()) == self.first_facts)
                    and (self.calls % FULL_SCAN_EVERY or sum(map(_DATA_PTR, tensors)) == self.pointer_sum)):
                return None
        self.reason = self._what_changed()
        if self.reason is None:  # a registration elsewhere (another module was built): nothing changed here
            self.registrations = _REGISTRATIONS[0]
            if reader is not None:
                try:
                    self.reader_state = reader()
                except RuntimeError:
                    self.reader = None
        return self.reason

    def changed_now(self) -> str | None:
        """:meth:`changed` with every check made now (no sampled pointer scan): for rare callers (an export).
        What it finds is kept, as :meth:`changed` keeps it: the calls of a backend that baked the old weights
        run eager from then on."""
        if self.reason is None:
            self.reason = self._what_changed()
        return self.reason

    def _what_changed(self) -> str | None:
        if list(map(id, self.module.modules())) != self.submodules:
            return "a submodule was replaced or added since tuning"
        named = named_state(self.module)
        current = dict(named)
        if [name for name, _ in named] != self.names:
            missing = sorted(set(self.names) - set(current))
            extra = sorted(set(current) - set(self.names))
            return f"the module's parameters/buffers changed ({'missing ' + ', '.join(missing[:3]) if missing else ''}"\
                   f"{' ' if missing and extra else ''}{'new ' + ', '.join(extra[:3]) if extra else ''})"
        for name, tensor, version, pointer, (dtype, device) in zip(self.names, self.tensors, self.versions,
                                                                   self.pointers, self.dtypes):
            now = current[name]
            if now is not tensor:
                return f"'{name}' was replaced by a new tensor (load_state_dict(assign=True) or assignment)"
            if now.dtype != dtype or now.device != device:
                return f"'{name}' is now {str(now.dtype).removeprefix('torch.')} on {now.device} (was " \
                       f"{str(dtype).removeprefix('torch.')} on {device}: .to()/.half()/.cuda())"
            if now.data_ptr() != pointer:
                return f"'{name}' holds new data (its .data was replaced)"
            if now._version != version:
                return f"'{name}' was changed in place (load_state_dict or an in-place edit)"
        return None


def named_state(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every parameter and buffer of ``module`` (shared ones once, None ones skipped)."""
    named = list(module.named_parameters(remove_duplicate=True)) + list(module.named_buffers(remove_duplicate=True))
    return [(name, tensor) for name, tensor in named if tensor is not None]
