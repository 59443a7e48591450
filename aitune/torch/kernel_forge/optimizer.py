"""KernelOptimizer: find a module's SDPA calls, check and time kernel providers, and make a plan.

How a plan is made (:meth:`KernelOptimizer.make_plan`):
  1. Run the module eagerly on the recorded samples with a recording ``TorchFunctionMode`` that sees every
     ``scaled_dot_product_attention`` call, wherever it comes from (``F.scaled_dot_product_attention``,
     ``torch._C._nn``, or a name imported from ``torch.nn.functional``). Calls are grouped by call site
     (file, line, function) and shape, with the submodules that made them listed; one example of each
     group is kept (cloned inputs and the original SDPA's output), so identical layers cost one example.
  2. For each provider and each example: refused by ``supports()`` (with the reason), or run on cloned
     inputs and compared with the original output: ``|out - ref| <= atol + rtol * |ref|`` everywhere,
     finite where the reference is, and cosine similarity >= ``min_cosine``. Defaults (fp16
     ``atol = rtol = 2e-2``, cosine >= 0.999) are an fp16 attention tolerance.
  3. Calls are dispatched at run time by *family*: every argument property except batch size and
     sequence lengths (:data:`~aitune.torch.kernel_forge.kernel_provider.FAMILY_FIELDS`). Per family every
     provider correct on all the family's examples is timed over those examples in alternation with the
     original SDPA (:func:`aitune.torch.measure.profiling.measure_pair`: a round of one, a round of the other, so
     a drifting machine does not favour whichever ran second; CUDA events on GPU, ``perf_counter_ns`` on
     CPU). The fastest provider is kept only if it beats the original by more than the measured noise
     (:func:`aitune.torch.measure.profiling.beats`). A plan may be empty.

How calls are timed on a CUDA device (``timing="auto"``, the default): each example's call is captured
:data:`CALLS_PER_GRAPH` times in one CUDA graph, and the graph's replays are timed with CUDA events, so a
provider is judged by its kernels alone, as it runs inside a compiled delegate with CUDA graphs, not by
the Python that launches them (a provider with slow Python launch code but fast kernels
must not lose for that, and one with fast launches must not win for it). Several calls per graph spread
the graph launch's own latency over them (the method of Triton's ``triton.testing.do_bench_cudagraph``).
A provider whose call cannot be captured (a host synchronisation, an allocation the capture forbids) is
timed eagerly instead, against the original timed eagerly too, and its rows say why (``timing``). On a
CPU, or with ``timing="eager"``, every call is timed as it is made from Python.

How a plan is applied, and its limits: :mod:`aitune.torch.kernel_forge.plan`.

Limitation of the search: one provider per family (call sites that share a family share the choice,
checked and timed at every one of them).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import torch
from torch.overrides import TorchFunctionMode

from aitune.errors import ConfigError, CorrectnessError, ToleranceExceededError, one_line
from aitune.torch.check.correctness import OutputComparator, Tolerance, cosine_similarity
from aitune.torch.kernel_forge.kernel_provider import ORIGINAL_SDPA, KernelProvider, SDPACall, family_to_dict
from aitune.torch.kernel_forge.plan import KernelChoice, KernelOptimizationPlan
from aitune.torch.measure.profiling import Measurement, ProfilingConfig, beats, measure, measure_pair
from aitune.torch.record.samples import clone_tree

logger = logging.getLogger(__name__)

TIMINGS = ("auto", "cuda_graph", "eager")
CALLS_PER_GRAPH = 8
"""Calls captured per CUDA graph when timing in graphs: the graph launch's latency (a few µs) is spread
over them, which matters for attention calls of tens of µs."""

_THIS_FILE = os.path.normcase(os.path.abspath(__file__))
_SKIPPED_FILES = (os.path.normcase(os.path.join("torch", "overrides.py")),
                  os.path.normcase(os.path.join("torch", "utils", "_device.py")))


# --------------------------------------------------------------------------------------------- recording


@dataclasses.dataclass
class RecordedCall:
    """One SDPA call site and shape: a cloned example call, its original output and how often it ran.

    Attributes:
        call_site: ``file:line in function`` of the call.
        module_names: qualified names of the submodules whose forward made it (identical layers share a
            record: one example is kept, not one per layer).
        call: the example (cloned inputs). reference_output: the original SDPA's output on it.
        count: how many calls over all samples had this site and shape.
    """

    call_site: str
    module_names: list[str]
    call: SDPACall
    reference_output: torch.Tensor
    count: int = 1

    @property
    def module_name(self) -> str:
        return self.module_names[0] if self.module_names else ""

    @property
    def label(self) -> str:
        if not self.module_names:
            return self.call_site
        more = f" +{len(self.module_names) - 1} more" if len(self.module_names) > 1 else ""
        return f"{self.call_site} [{self.module_names[0]}{more}]"


def _clone_call(call: SDPACall) -> SDPACall:
    def clone(value):
        return value.detach().clone() if isinstance(value, torch.Tensor) else value

    return SDPACall(clone(call.query), clone(call.key), clone(call.value), clone(call.attn_mask), call.dropout_p,
                    call.is_causal, call.scale, call.enable_gqa)


def _shape_key(call: SDPACall) -> tuple:
    description = call.describe()
    return tuple((key, json.dumps(value, sort_keys=True)) for key, value in sorted(description.items()))


class _RecordingMode(TorchFunctionMode):
    """Records every SDPA call (site, shape, cloned inputs, original output) and runs the original."""

    def __init__(self, module_names: dict[int, str], max_examples: int):
        super().__init__()
        self.module_names = module_names
        self.max_examples = max_examples
        self.records: dict[tuple, RecordedCall] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        if func is ORIGINAL_SDPA:
            call = SDPACall.from_args(args, kwargs)
            site, module_name = self._call_site()
            key = (site, _shape_key(call))
            record = self.records.get(key)
            if record is not None:
                record.count += 1
                if module_name and module_name not in record.module_names:
                    record.module_names.append(module_name)
            elif len(self.records) < self.max_examples:
                self.records[key] = RecordedCall(site, [module_name] if module_name else [], _clone_call(call),
                                                 output.detach().clone())
        return output

    def _call_site(self) -> tuple[str, str]:
        frame = sys._getframe(1)
        site = ""
        module_name = ""
        while frame is not None:
            filename = os.path.normcase(os.path.abspath(frame.f_code.co_filename))
            if filename != _THIS_FILE and not filename.endswith(_SKIPPED_FILES):
                if not site:
                    parts = Path(frame.f_code.co_filename).parts[-3:]
                    site = f"{'/'.join(parts)}:{frame.f_lineno} in {frame.f_code.co_name}"
                owner = frame.f_locals.get("self")
                if owner is not None and id(owner) in self.module_names:
                    module_name = self.module_names[id(owner)]
                    break
            frame = frame.f_back
        return site or "<unknown>", module_name


# --------------------------------------------------------------------------------------------- optimizer


class KernelOptimizer:
    """Chooses, per family of SDPA calls a module makes, the fastest correct kernel provider.

    Args:
        kernel_providers: a provider or a list of them (each tried on every call it supports).
        atol / rtol: elementwise tolerance against the original SDPA output (default 2e-2 / 2e-2, an
            fp16 attention tolerance).
        min_cosine: cosine-similarity floor per call (default 0.999).
        profiling: timing rules (:class:`aitune.torch.measure.profiling.ProfilingConfig`); default 3 warm-up
            rounds and a 0.5 s budget per provider and family (shared with the original SDPA, timed in alternation).
        max_examples: distinct (call site, shape) examples kept (default 64); further ones run but are
            not examined.
        timing: ``"auto"`` (default: inside CUDA graphs on a CUDA device, eagerly elsewhere),
            ``"cuda_graph"`` (CUDA devices only) or ``"eager"`` (as called from Python). See the module
            docstring.

    Raises:
        ConfigError: no providers, or something that is not a provider, a bad tolerance or timing;
            ``make_plan`` raises it for ``timing="cuda_graph"`` on a device that is not CUDA.
    """

    def __init__(self, kernel_providers: KernelProvider | Sequence[KernelProvider], *, atol: float = 2e-2,
                 rtol: float = 2e-2, min_cosine: float = 0.999, profiling: ProfilingConfig | None = None,
                 max_examples: int = 64, timing: str = "auto"):
        if isinstance(kernel_providers, KernelProvider):
            kernel_providers = [kernel_providers]
        providers = list(kernel_providers or [])
        if not providers:
            raise ConfigError("KernelOptimizer needs at least one kernel provider")
        for provider in providers:
            if not isinstance(provider, KernelProvider):
                raise ConfigError(f"KernelOptimizer: {provider!r} is not a KernelProvider")
        self.kernel_providers = providers
        self.tolerance = Tolerance(atol=atol, rtol=rtol, low_precision_atol=atol, low_precision_rtol=rtol,
                                   min_cosine=min_cosine)
        self.profiling = profiling or ProfilingConfig(warmup_rounds=3, min_rounds=5, max_rounds=200,
                                                      time_budget_s=0.5)
        if not isinstance(max_examples, int) or max_examples < 1:
            raise ConfigError(f"KernelOptimizer.max_examples must be an int >= 1, got {max_examples!r}")
        self.max_examples = max_examples
        if timing not in TIMINGS:
            raise ConfigError(f"KernelOptimizer.timing must be one of {', '.join(TIMINGS)}, got {timing!r}")
        self.timing = timing

    # ---- step 1
    def find_calls(self, module: torch.nn.Module, samples: Any) -> list[RecordedCall]:
        """Run ``module`` on every sample (cloned, ``no_grad``) and return its SDPA calls by site and shape."""
        names = {id(sub): name or f"<root {type(sub).__name__}>" for name, sub in module.named_modules()}
        recorder = _RecordingMode(names, self.max_examples)
        with torch.no_grad():
            for args, kwargs in _iter_samples(samples):
                args, kwargs = clone_tree((tuple(args), dict(kwargs)))
                with recorder:
                    module(*args, **kwargs)
        calls = list(recorder.records.values())
        logger.debug("kernel optimizer: %d SDPA call site/shape pairs found", len(calls))
        return calls

    # ---- steps 2-3
    def make_plan(self, module: torch.nn.Module, samples: Any, device: torch.device | str | None = None
                  ) -> KernelOptimizationPlan:
        """Find the SDPA calls ``module`` makes on ``samples`` and choose providers for them.

        Args:
            module: the module (not changed; run eagerly under ``no_grad``).
            samples: a list of ``(args, kwargs)``, of :class:`~aitune.torch.record.samples.Sample`, or a
                :class:`~aitune.torch.record.samples.GraphSpec`.
            device: where the calls run (decides the timer); default: the first call's device.

        Returns:
            A :class:`KernelOptimizationPlan` holding only choices that are correct and faster.
        """
        calls = self.find_calls(module, samples)
        if device is None:
            device = calls[0].call.device if calls else torch.device("cpu")
        device = torch.device(device)
        if self.timing == "cuda_graph" and device.type != "cuda":
            raise ConfigError(f"timing='cuda_graph' needs a CUDA device, the calls run on {device}; "
                              f"use timing='auto' or 'eager'")
        rows: list[dict] = []
        families: dict[tuple, list[RecordedCall]] = {}
        for record in calls:
            families.setdefault(record.call.family(), []).append(record)
        choices = []
        for family, records in families.items():
            choice = self._choose(family, records, device, rows)
            if choice is not None:
                choices.append(choice)
        plan = KernelOptimizationPlan(choices, rows, str(device))
        logger.info("kernel optimizer: %d SDPA call families, %d swapped: %s", len(families), len(choices),
                    plan.swapped_call_sites() or "none")
        return plan

    def _choose(self, family: tuple, records: list[RecordedCall], device: torch.device,
                rows: list[dict]) -> KernelChoice | None:
        match = family_to_dict(family)

        def row(record: RecordedCall, provider: str, status: str, reason: str = "", **extra) -> dict:
            entry = {"call_site": record.label, "calls": record.count, "shape": record.call.describe(),
                     "family": match, "provider": provider, "status": status, "reason": reason}
            entry.update(extra)
            rows.append(entry)
            return entry

        if records[0].call.dropout_p != 0.0:
            for record in records:
                row(record, "*", "skipped", "dropout_p > 0: outputs are random and cannot be checked")
            return None
        correct: dict[str, tuple[KernelProvider, list[dict], float, float]] = {}
        for provider in self.kernel_providers:
            provider_rows: list[dict] = []
            max_abs_error, min_cos = 0.0, 1.0
            verdict = None
            for record in records:
                check = provider.supports(record.call)
                if not check.ok:
                    verdict = row(record, provider.name, "refused", check.reason)
                    break
                try:
                    with torch.no_grad():
                        output = provider.run(_clone_call(record.call))
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    abs_error, cos = self._compare(record.reference_output, output)
                except CorrectnessError as exc:
                    verdict = row(record, provider.name, "incorrect", one_line(exc))
                    break
                except Exception as exc:  # noqa: BLE001 - a failing provider is a row, not a crash
                    logger.debug("provider %s failed", provider.name, exc_info=True)
                    verdict = row(record, provider.name, "failed", one_line(exc))
                    break
                max_abs_error, min_cos = max(max_abs_error, abs_error), min(min_cos, cos)
                provider_rows.append(row(record, provider.name, "correct", "", max_abs_error=abs_error, cosine=cos))
            if verdict is not None:
                for entry in provider_rows:  # correct here, but not at every call of the family
                    entry.update(status="not used", reason=f"{verdict['status']} at {verdict['call_site']}")
                continue
            correct[provider.name] = (provider, provider_rows, max_abs_error, min_cos)
        if not correct:
            return None
        examples = [record.call for record in records]
        run_original = lambda call: call.run_original()  # noqa: E731
        original = prepare_calls(run_original, examples, device,
                                 in_graph=self.timing != "eager" and device.type == "cuda")
        eager_original = None  # the original called from Python, for a provider that cannot be captured
        baseline = None  # the original's figures from its first pair timed as planned (for its own rows)
        best = None
        for provider, provider_rows, max_abs_error, min_cos in correct.values():
            try:
                candidate = prepare_calls(provider.run, examples, device, in_graph=original.in_graph)
                reference = original
                if candidate.in_graph != original.in_graph:
                    if eager_original is None:
                        eager_original = prepare_calls(run_original, examples, device, in_graph=False)
                    reference = eager_original
                # In alternation with the original, so both meet the same machine conditions.
                original_timing, timing = reference.measure_pair(candidate, self.profiling)
                how = candidate.how
                del candidate  # its CUDA graphs' memory
            except Exception as exc:  # noqa: BLE001
                for entry in provider_rows:
                    entry.update(status="failed", reason=f"while timing: {one_line(exc)}")
                continue
            if baseline is None and reference is original:
                baseline = original_timing
            for index, entry in enumerate(provider_rows):
                entry.update(original_ms=original_timing.samples[index].p50_ms,
                             provider_ms=timing.samples[index].p50_ms, timing=how)
            faster = beats(timing, original_timing)
            for entry in provider_rows:
                entry["status"] = "faster" if faster else "not faster"
                if not faster:
                    noise = max(timing.noise, original_timing.noise)
                    entry["reason"] = (f"round {timing.median_round_ms:.4f} ms vs original "
                                       f"{original_timing.median_round_ms:.4f} ms (noise {noise:.1%})")
            # Ranked by speedup over the original timed the same way (in graphs or eagerly) beside it.
            speedup = (original_timing.median_round_ms / timing.median_round_ms if timing.median_round_ms
                       else math.inf)
            if faster and (best is None or speedup > best[4]):
                best = (provider, timing, max_abs_error, min_cos, speedup, original_timing)
        for index, record in enumerate(records):
            figures = {} if baseline is None else {"original_ms": baseline.samples[index].p50_ms}
            row(record, "original", "baseline", "" if baseline is not None else "no provider was timed", **figures,
                timing=original.how)
        if best is None:
            return None
        provider, timing, max_abs_error, min_cos, speedup, original_timing = best
        for entry in rows:
            if entry.get("family") is match and entry.get("provider") == provider.name and entry["status"] == "faster":
                entry["status"] = "chosen"
        sites = tuple(dict.fromkeys(record.label for record in records))
        return KernelChoice(match=match, provider=provider, call_sites=sites,
                            original_ms=original_timing.median_round_ms,
                            provider_ms=timing.median_round_ms, speedup=speedup, max_abs_error=max_abs_error,
                            min_cosine=min_cos)

    def _compare(self, reference: torch.Tensor, output: Any) -> tuple[float, float]:
        """Max abs error and cosine of ``output`` against the original. Raises CorrectnessError."""
        comparator = OutputComparator(self.tolerance)
        comparator.compare(reference, output)  # structure, shape, dtype, finiteness, atol/rtol
        result = comparator.result()
        reference = reference.detach().cpu()
        finite = torch.isfinite(reference)
        cos = cosine_similarity(reference[finite], output.detach().cpu()[finite])
        if cos < self.tolerance.min_cosine:
            raise ToleranceExceededError(f"cosine similarity {cos:.5f} is below the floor {self.tolerance.min_cosine}",
                                         max_abs_error=result.max_abs_error, max_rel_error=result.max_rel_error,
                                         tolerance=f"cosine>={self.tolerance.min_cosine}")
        return result.max_abs_error, cos


@dataclasses.dataclass
class TimedCalls:
    """Calls ready to be timed: ``run(item)`` for each of ``items``.

    In CUDA graphs (``in_graph``) an item is one example's graph holding ``calls_per_item`` calls and
    ``run`` replays it; otherwise an item is the example and ``run`` makes the call. Figures are per call.
    ``how`` says which, for the report rows: ``"cuda graph"``, ``"eager"`` or
    ``"eager: CUDA graph capture failed (<error>)"``.
    """

    run: Any
    items: list
    device: torch.device
    in_graph: bool
    how: str
    calls_per_item: int = 1

    def measure(self, profiling: ProfilingConfig) -> Measurement:
        """These calls alone (:func:`aitune.torch.measure.profiling.measure`), ms per call."""
        return _per_call(measure(self.run, self.items, [1] * len(self.items), self.device, profiling),
                         self.calls_per_item)

    def measure_pair(self, other: "TimedCalls", profiling: ProfilingConfig) -> tuple[Measurement, Measurement]:
        """These calls and ``other`` in alternation (:func:`aitune.torch.measure.profiling.measure_pair`), ms per call."""
        mine, theirs = measure_pair(self.run, self.items, other.run, other.items, [1] * len(self.items), self.device,
                                    profiling)
        return _per_call(mine, self.calls_per_item), _per_call(theirs, other.calls_per_item)


def prepare_calls(run, calls: Sequence[SDPACall], device: torch.device, *, in_graph: bool) -> TimedCalls:
    """Get ``run(call)`` over ``calls`` ready to time.

    Args:
        run: the function timed on each call (a provider's ``run``, or the original SDPA).
        calls: the examples (their tensors are reused by every timed call).
        device: where the calls run (decides the timer).
        in_graph: capture each call :data:`CALLS_PER_GRAPH` times in one CUDA graph (CUDA devices only); if
            capture fails the calls are timed as made from Python and ``how`` says why.
    """
    if in_graph:
        try:
            graphs = _capture(run, calls, device, CALLS_PER_GRAPH)
        except Exception as exc:  # noqa: BLE001 - a call that cannot be captured is timed eagerly
            logger.debug("CUDA graph capture failed", exc_info=True)
            return TimedCalls(run, list(calls), device, False, f"eager: CUDA graph capture failed ({one_line(exc)})")
        return TimedCalls(lambda graph: graph.replay(), graphs, device, True, "cuda graph", CALLS_PER_GRAPH)
    return TimedCalls(run, list(calls), device, False, "eager")


def _capture(run, examples: list[SDPACall], device: torch.device, repeats: int) -> list:
    """One CUDA graph per example holding ``repeats`` calls of ``run`` on it (outputs dropped).

    Warm-up runs on a side stream first (Triton compiles, cuDNN plans, lazy initialisation), as the CUDA
    graph recipe of the PyTorch docs ("CUDA Graphs", whole-network capture) does.
    """
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.no_grad():
        with torch.cuda.stream(stream):
            for call in examples:
                for _ in range(2):
                    run(call)
        torch.cuda.current_stream(device).wait_stream(stream)
        graphs = []
        for call in examples:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(repeats):
                    run(call)
            graphs.append(graph)
    return graphs


def _per_call(measurement: Measurement, calls: int) -> Measurement:
    """``measurement`` of replays holding ``calls`` calls each, as figures per call (ms / calls)."""
    samples = [dataclasses.replace(timing, p50_ms=timing.p50_ms / calls, p90_ms=timing.p90_ms / calls,
                                   p99_ms=timing.p99_ms / calls, mean_ms=timing.mean_ms / calls,
                                   std_ms=timing.std_ms / calls) for timing in measurement.samples]
    return Measurement(samples=samples, rounds=measurement.rounds,
                       round_ms=[value / calls for value in measurement.round_ms], noise=measurement.noise)


def _iter_samples(samples: Any):
    """Yield ``(args, kwargs)`` from a GraphSpec, Samples, or ``(args, kwargs)`` pairs."""
    if hasattr(samples, "samples") and not isinstance(samples, (list, tuple)):
        samples = samples.samples
    for sample in samples:
        if hasattr(sample, "args") and hasattr(sample, "kwargs"):
            yield sample.args, sample.kwargs
        else:
            args, kwargs = sample
            yield args, kwargs
