"""A kernel plan: which provider runs which family of SDPA calls, and how the plan is applied.

A :class:`KernelOptimizationPlan` (made by :class:`~aitune.torch.kernel_forge.optimizer.KernelOptimizer`,
saved as strict JSON in ``kernel_plan.json``) holds one :class:`KernelChoice` per call family. It is applied per
call through a ``TorchFunctionMode`` scoped to one module's forward (:meth:`KernelOptimizationPlan.apply`) or to a
wrapper (:class:`PlannedModule`): nothing global is patched, so another module and a direct
``F.scaled_dot_product_attention`` call behave exactly as before (a global SDPA patch breaks them:
thu-ml/SageAttention#134). Inside the scope each call is looked up by family and handed to the chosen provider
only if ``provider.accepts(call)``; every other call goes to the original SDPA. The mode is plain Python over
tensor metadata, so ``torch.compile`` traces through it.

Limitations: a plan made on one GPU architecture is re-checked (availability and device) when applied
elsewhere; concurrent forwards of the same module in several threads each enter their own mode; run
eagerly, the mode sees every torch call of the forward (microseconds of Python per op), while a compiled
delegate traces it away.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Iterable

import torch
from torch.overrides import TorchFunctionMode

from aitune.errors import ConfigError
from aitune.torch.common.jsonsafe import json_safe
from aitune.torch.kernel_forge.kernel_provider import (
    ORIGINAL_SDPA,
    SDPA_FUNCTION,
    KernelProvider,
    SDPACall,
    family_from_dict,
    kernel_provider_from_dict,
)

logger = logging.getLogger(__name__)

PLAN_FORMAT = "aitune.kernel_plan"
PLAN_VERSION = 1


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
        return json_safe({"format": PLAN_FORMAT, "version": PLAN_VERSION, "device": self.device,
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
        lines = ["| call site | shape | provider | status | original ms | provider ms | timed | reason |",
                 "|---|---|---|---|---|---|---|---|"]
        for row in self.candidates:
            lines.append(f"| {row.get('call_site', '')} | {_short_shape(row.get('shape'))} | "
                         f"{row.get('provider', '')} | "
                         f"{row.get('status', '')} | {_fmt(row.get('original_ms'))} | {_fmt(row.get('provider_ms'))} | "
                         f"{row.get('timing', '')} | {row.get('reason', '')} |")
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
