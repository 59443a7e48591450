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
     ``atol = rtol = 2e-2``, cosine >= 0.999) are case C24's attention tolerance.
  3. Calls are dispatched at run time by *family*: every argument property except batch size and
     sequence lengths (:data:`~aitune.torch.kernel_forge.kernel_provider.FAMILY_FIELDS`). Per family the
     original SDPA and every provider correct on all the family's examples are timed over those examples
     (:func:`aitune.torch.profiling.measure`: CUDA events on GPU, ``perf_counter_ns`` on CPU). The fastest
     provider is kept only if it beats the original by more than the measured noise
     (:func:`aitune.torch.profiling.beats`). A plan may be empty.

A plan is applied per call through a ``TorchFunctionMode`` scoped to one module's forward
(:meth:`KernelOptimizationPlan.apply`) or to a wrapper (:class:`PlannedModule`): nothing global is
patched, so another module and a direct ``F.scaled_dot_product_attention`` call behave exactly as before
(case C24). Inside the scope each call is looked up by family and handed to the chosen provider only if
``provider.accepts(call)``; every other call goes to the original SDPA. The mode is plain Python over
tensor metadata, so ``torch.compile`` traces through it.

Limitations: one provider per family (call sites that share a family share the choice, checked and timed
at every one of them); a plan made on one GPU architecture is re-checked (availability and device) when
applied elsewhere; concurrent forwards of the same module in several threads each enter their own mode;
run eagerly, the mode sees every torch call of the forward (microseconds of Python per op), while a
compiled delegate traces it away.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from torch.overrides import TorchFunctionMode

from aitune.errors import ConfigError, CorrectnessError, ToleranceExceededError
from aitune.torch.backend.base import one_line
from aitune.torch.correctness import OutputComparator, Tolerance, cosine_similarity
from aitune.torch.kernel_forge.kernel_provider import (
    ORIGINAL_SDPA,
    SDPA_FUNCTION,
    KernelProvider,
    SDPACall,
    family_from_dict,
    family_to_dict,
    kernel_provider_from_dict,
)
from aitune.torch.profiling import ProfilingConfig, beats, measure

logger = logging.getLogger(__name__)

PLAN_FORMAT = "aitune.kernel_plan"
PLAN_VERSION = 1

_THIS_FILE = os.path.normcase(os.path.abspath(__file__))
_SKIPPED_FILES = (os.path.normcase(os.path.join("torch", "overrides.py")),
                  os.path.normcase(os.path.join("torch", "utils", "_device.py")))


# --------------------------------------------------------------------------------------------- plan


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """One decision of a plan: calls of family ``match`` go to ``provider``.

    Attributes:
        match: the family (JSON form; keys :data:`FAMILY_FIELDS`).
        provider: the chosen provider.
        call_sites: the call sites (``file:line in function [module]``) this choice was checked at.
        original_ms / provider_ms: median time of one round over the family's examples, ms.
        speedup: ``original_ms / provider_ms``.
        max_abs_error: largest ``|provider - original|`` over the examples. min_cosine: smallest cosine.
    """

    match: dict
    provider: KernelProvider
    call_sites: tuple[str, ...] = ()
    original_ms: float = float("nan")
    provider_ms: float = float("nan")
    speedup: float = float("nan")
    max_abs_error: float = float("nan")
    min_cosine: float = float("nan")

    def to_dict(self) -> dict:
        return {"function": SDPA_FUNCTION, "match": dict(self.match), "provider": self.provider.to_dict(),
                "call_sites": list(self.call_sites), "original_ms": self.original_ms,
                "provider_ms": self.provider_ms, "speedup": self.speedup, "max_abs_error": self.max_abs_error,
                "min_cosine": self.min_cosine}

    @classmethod
    def from_dict(cls, payload: dict) -> "KernelChoice":
        if payload.get("function", SDPA_FUNCTION) != SDPA_FUNCTION:
            raise ConfigError(f"kernel plan entry for unsupported function {payload.get('function')!r}")
        family_from_dict(payload.get("match", {}))  # validates
        return cls(match=dict(payload["match"]), provider=kernel_provider_from_dict(payload.get("provider", {})),
                   call_sites=tuple(payload.get("call_sites", ())),
                   **{key: float(payload[key]) for key in ("original_ms", "provider_ms", "speedup", "max_abs_error",
                                                           "min_cosine") if payload.get(key) is not None})


class KernelDispatchMode(TorchFunctionMode):
    """Hands each SDPA call to the plan's provider for its family, or to the original SDPA.

    Every other function passes through unchanged. Entered per forward (see :meth:`KernelOptimizationPlan.apply`).
    """

    def __init__(self, table: dict[tuple, KernelProvider]):
        super().__init__()
        self.table = table

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not ORIGINAL_SDPA:
            return func(*args, **kwargs)
        call = SDPACall.from_args(args, kwargs)
        provider = self.table.get(call.family())
        if provider is not None and provider.accepts(call):
            return provider.run(call)
        return func(*args, **kwargs)


class KernelOptimizationPlan:
    """Which provider runs which family of SDPA calls; JSON-serialisable.

    Args:
        choices: the decisions (an empty plan is valid: everything stays on the original SDPA).
        candidates: report rows of every (call site, shape, provider) tried: status, reason, timings, errors.
        device: the device the plan was made on (informational).

    Raises:
        ConfigError: two choices for one family.
    """

    def __init__(self, choices: Iterable[KernelChoice] = (), candidates: Iterable[dict] = (), device: str = ""):
        self.choices: tuple[KernelChoice, ...] = tuple(choices)
        self.candidates: tuple[dict, ...] = tuple(candidates)
        self.device = device
        self._table: dict[tuple, KernelProvider] = {}
        for choice in self.choices:
            family = family_from_dict(choice.match)
            if family in self._table:
                raise ConfigError(f"kernel plan has two choices for one call family {choice.match}")
            self._table[family] = choice.provider

    # ---- queries
    def __len__(self) -> int:
        return len(self.choices)

    @property
    def is_empty(self) -> bool:
        return not self.choices

    @property
    def providers(self) -> tuple[KernelProvider, ...]:
        return tuple(choice.provider for choice in self.choices)

    def swapped_call_sites(self) -> list[str]:
        """Call sites whose SDPA calls the plan sends to another provider (for the report)."""
        return [f"{site} -> {choice.provider.name}" for choice in self.choices for site in choice.call_sites]

    def provider_for(self, call: SDPACall) -> KernelProvider | None:
        """The provider a call would be dispatched to (None = original SDPA)."""
        provider = self._table.get(call.family())
        return provider if provider is not None and provider.accepts(call) else None

    # ---- applying
    def dispatch_mode(self) -> KernelDispatchMode:
        """A fresh mode to enter around one forward (``with plan.dispatch_mode(): module(x)``)."""
        return KernelDispatchMode(self._table)

    @contextlib.contextmanager
    def apply(self, module: torch.nn.Module):
        """Context in which ``module``'s forward dispatches SDPA calls through the plan.

        Installs a forward pre-hook and a forward hook (``always_call``) on ``module`` that enter and leave
        a :class:`KernelDispatchMode`; both are removed on exit. Nothing global is patched.
        """
        self.check_runtime()
        active: list[KernelDispatchMode] = []

        def enter(_module, _args):
            mode = self.dispatch_mode()
            mode.__enter__()
            active.append(mode)

        def leave(_module, _args, _output):
            if active:
                active.pop().__exit__(None, None, None)

        pre_handle = module.register_forward_pre_hook(enter)
        post_handle = module.register_forward_hook(leave, always_call=True)
        try:
            yield module
        finally:
            pre_handle.remove()
            post_handle.remove()
            while active:
                active.pop().__exit__(None, None, None)

    def check_runtime(self) -> "KernelOptimizationPlan":
        """Drop (with a warning) choices whose provider cannot run in this process; returns self.

        A choice for CUDA calls is kept when CUDA is absent: no call can match it here anyway.
        """
        kept = []
        for choice in self.choices:
            check = choice.provider.availability()
            if check.ok and choice.match.get("device_type") == "cuda" and torch.cuda.is_available():
                check = choice.provider.check_device("cuda")
            if not check.ok:
                logger.warning("kernel plan: %s cannot run here (%s); its calls stay on the original SDPA",
                               choice.provider.name, check.reason)
                continue
            kept.append(choice)
        if len(kept) != len(self.choices):
            self.choices = tuple(kept)
            self._table = {family_from_dict(choice.match): choice.provider for choice in kept}
        return self

    # ---- serialisation
    def to_dict(self) -> dict:
        """Plain JSON data (non-finite numbers become None, so the file is strict JSON)."""
        return _strict_json({"format": PLAN_FORMAT, "version": PLAN_VERSION, "device": self.device,
                             "choices": [choice.to_dict() for choice in self.choices],
                             "candidates": list(self.candidates)})

    @classmethod
    def from_dict(cls, payload: dict) -> "KernelOptimizationPlan":
        """Rebuild a plan written by :meth:`to_dict`. Raises ConfigError on another format or newer version."""
        if not isinstance(payload, dict) or payload.get("format") != PLAN_FORMAT:
            raise ConfigError("not an aitune kernel plan (missing format 'aitune.kernel_plan')")
        if int(payload.get("version", 0)) > PLAN_VERSION:
            raise ConfigError(f"kernel plan version {payload.get('version')} is newer than this aitune reads "
                              f"({PLAN_VERSION}); upgrade aitune")
        return cls([KernelChoice.from_dict(item) for item in payload.get("choices", [])],
                   payload.get("candidates", []), payload.get("device", ""))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> "KernelOptimizationPlan":
        return cls.from_dict(json.loads(text))

    def save(self, path: Path | str) -> Path:
        path = Path(path)
        path.write_text(self.to_json())
        return path

    @classmethod
    def load(cls, path: Path | str) -> "KernelOptimizationPlan":
        return cls.from_json(Path(path).read_text())

    def describe(self) -> str:
        """Markdown table of every candidate tried, then the choices."""
        lines = ["| call site | shape | provider | status | original ms | provider ms | reason |",
                 "|---|---|---|---|---|---|---|"]
        for row in self.candidates:
            lines.append(f"| {row.get('call_site', '')} | {_short_shape(row.get('shape'))} | "
                         f"{row.get('provider', '')} | "
                         f"{row.get('status', '')} | {_fmt(row.get('original_ms'))} | {_fmt(row.get('provider_ms'))} | "
                         f"{row.get('reason', '')} |")
        if self.choices:
            lines.append("")
            for choice in self.choices:
                lines.append(f"- {choice.provider.name} for {choice.match} ({choice.speedup:.2f}x): "
                             + ", ".join(choice.call_sites))
        else:
            lines.append("")
            lines.append("- empty plan: every SDPA call stays on PyTorch's own selection")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"KernelOptimizationPlan({[f'{c.provider.name}:{c.match}' for c in self.choices]})"


def _short_shape(shape: Any) -> str:
    if not isinstance(shape, dict):
        return ""
    mask = shape.get("attn_mask")
    text = (f"q{shape.get('query')} k{shape.get('key')} v{shape.get('value')} {shape.get('dtype')} "
            f"{shape.get('device')}")
    if mask:
        text += f" mask{mask.get('shape')} {mask.get('dtype')}"
    if shape.get("is_causal"):
        text += " causal"
    return text.replace(", ", ",")


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else ""


def _strict_json(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(key): _strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(item) for item in value]
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return str(value)


class PlannedModule(torch.nn.Module):
    """``module`` whose every forward runs inside the plan's dispatch mode (what delegates build from).

    Shares ``module`` (no copy). Mirrors its ``training`` flag without calling ``train()``, which would
    change the user's module.
    """

    def __init__(self, module: torch.nn.Module, plan: KernelOptimizationPlan):
        super().__init__()
        self.module = module
        self.plan = plan
        self.training = module.training

    def forward(self, *args, **kwargs):
        with self.plan.dispatch_mode():
            return self.module(*args, **kwargs)


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
        atol / rtol: elementwise tolerance against the original SDPA output (default 2e-2 / 2e-2, the
            fp16 attention tolerance of case C24).
        min_cosine: cosine-similarity floor per call (default 0.999, case C24).
        profiling: timing rules (:class:`aitune.torch.profiling.ProfilingConfig`); default 3 warm-up
            rounds and a 0.5 s budget per provider and family.
        max_examples: distinct (call site, shape) examples kept (default 64); further ones run but are
            not examined.

    Raises:
        ConfigError: no providers, or something that is not a provider, or a bad tolerance.
    """

    def __init__(self, kernel_providers: KernelProvider | Sequence[KernelProvider], *, atol: float = 2e-2,
                 rtol: float = 2e-2, min_cosine: float = 0.999, profiling: ProfilingConfig | None = None,
                 max_examples: int = 64):
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

    # ---- step 1
    def find_calls(self, module: torch.nn.Module, samples: Any) -> list[RecordedCall]:
        """Run ``module`` on every sample (cloned, ``no_grad``) and return its SDPA calls by site and shape."""
        from aitune.torch.samples import clone_tree

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
            samples: a list of ``(args, kwargs)``, of :class:`~aitune.torch.samples.Sample`, or a
                :class:`~aitune.torch.samples.GraphSpec`.
            device: where the calls run (decides the timer); default: the first call's device.

        Returns:
            A :class:`KernelOptimizationPlan` holding only choices that are correct and faster.
        """
        calls = self.find_calls(module, samples)
        if device is None:
            device = calls[0].call.device if calls else torch.device("cpu")
        device = torch.device(device)
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
        batch_sizes = [1] * len(examples)
        original = measure(lambda call: call.run_original(), examples, batch_sizes, device, self.profiling)
        for index, record in enumerate(records):
            row(record, "original", "baseline", "", original_ms=original.samples[index].p50_ms)
        best = None
        for name, (provider, provider_rows, max_abs_error, min_cos) in correct.items():
            try:
                timing = measure(provider.run, examples, batch_sizes, device, self.profiling)
            except Exception as exc:  # noqa: BLE001
                for entry in provider_rows:
                    entry.update(status="failed", reason=f"while timing: {one_line(exc)}")
                continue
            for index, entry in enumerate(provider_rows):
                entry.update(original_ms=original.samples[index].p50_ms, provider_ms=timing.samples[index].p50_ms)
            faster = beats(timing, original)
            for entry in provider_rows:
                entry["status"] = "faster" if faster else "not faster"
                if not faster:
                    noise = max(timing.noise, original.noise)
                    entry["reason"] = (f"round {timing.median_round_ms:.4f} ms vs original "
                                       f"{original.median_round_ms:.4f} ms (noise {noise:.1%})")
            if faster and (best is None or timing.throughput > best[1].throughput):
                best = (provider, timing, max_abs_error, min_cos)
        if best is None:
            return None
        provider, timing, max_abs_error, min_cos = best
        for entry in rows:
            if entry.get("family") is match and entry.get("provider") == provider.name and entry["status"] == "faster":
                entry["status"] = "chosen"
        sites = tuple(dict.fromkeys(record.label for record in records))
        return KernelChoice(match=match, provider=provider, call_sites=sites, original_ms=original.median_round_ms,
                            provider_ms=timing.median_round_ms,
                            speedup=original.median_round_ms / timing.median_round_ms if timing.median_round_ms else
                            float("inf"), max_abs_error=max_abs_error, min_cosine=min_cos)

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
