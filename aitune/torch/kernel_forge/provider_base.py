"""The base of every kernel provider (:class:`KernelProvider`) and the registry of provider classes that
rebuilds one from plain data (:func:`kernel_provider_from_dict`). The public path of these names is
:mod:`aitune.torch.kernel_forge.kernel_provider`."""

from __future__ import annotations

from typing import ClassVar

import torch

from aitune.errors import ConfigError
from aitune.torch.common.requirements import Check, Requirement, check_requirements
from aitune.torch.kernel_forge.sdpa_call import SDPA_FUNCTION, SDPACall


_PROVIDER_CLASSES: dict[str, type["KernelProvider"]] = {}


class KernelProvider:
    """A replacement implementation of one ``torch.nn.functional`` call (here: SDPA).

    Subclasses set ``requirements`` (optional packages) and implement ``_check_device`` (hardware),
    ``_refusal`` (one call; plain Python over tensor metadata so ``torch.compile`` can trace it),
    ``run`` (the replacement, taking an :class:`SDPACall`), ``_state`` / ``_from_state`` (plain data).

    Calling a provider like the function it replaces (``provider(query, key, value, ...)``) runs it.
    """

    function: ClassVar[str] = SDPA_FUNCTION
    requirements: ClassVar[tuple[Requirement, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _PROVIDER_CLASSES[cls.__name__] = cls

    @property
    def name(self) -> str:
        """Short stable name used in plans and reports (``torch_sdpa_flash``, ``sage_attention``)."""
        raise NotImplementedError

    # ---- can it run here?
    @classmethod
    def availability(cls) -> Check:
        """Are the optional packages importable (cheap, silent, cached)?"""
        return check_requirements(cls.requirements)

    def check_device(self, device: torch.device | str) -> Check:
        """Can this provider run on ``device`` at all (device type, compute capability)?"""
        return self._check_device(torch.device(device))

    def _check_device(self, device: torch.device) -> Check:
        return Check(True)

    def supports(self, call: SDPACall) -> Check:
        """Can this provider take ``call``? Checks packages, the device and the call itself, with a reason."""
        available = self.availability()
        if not available.ok:
            return available
        device_check = self.check_device(call.device)
        if not device_check.ok:
            return device_check
        reason = self._refusal(call)
        if reason is None:
            reason = self._exact_refusal(call)
        return Check(reason is None, reason or "")

    def check_call(self, call: SDPACall) -> Check:
        """The call-level part of :meth:`supports` only (no package or hardware check)."""
        reason = self._refusal(call)
        return Check(reason is None, reason or "")

    def accepts(self, call: SDPACall) -> bool:
        """Runtime gate used per call while a plan is applied (call-level checks only, traceable)."""
        return self._refusal(call) is None

    def _refusal(self, call: SDPACall) -> str | None:
        """Why ``call`` cannot be taken (None if it can). Must not read sizes into strings."""
        return None

    def _exact_refusal(self, call: SDPACall) -> str | None:
        """Extra eager-only checks made when a plan is made (may use library predicates)."""
        return None

    # ---- run
    def run(self, call: SDPACall) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False) -> torch.Tensor:
        return self.run(SDPACall(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa))

    # ---- plain data
    def _state(self) -> dict:
        return {}

    @classmethod
    def _from_state(cls, state: dict) -> "KernelProvider":
        return cls(**state)

    def to_dict(self) -> dict:
        """``{"type": <class name>, "data": {...}}`` (JSON-able)."""
        return {"type": type(self).__name__, "data": self._state()}

    @classmethod
    def from_dict(cls, payload: dict) -> "KernelProvider":
        return kernel_provider_from_dict(payload)

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self._state() == other._state()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted(self._state().items()))))

    def __repr__(self) -> str:
        arguments = ", ".join(f"{key}={value!r}" for key, value in self._state().items())
        return f"{type(self).__name__}({arguments})"


def kernel_provider_from_dict(payload: dict) -> KernelProvider:
    """Rebuild a provider written by :meth:`KernelProvider.to_dict` (registered classes only).

    Raises:
        ConfigError: unknown type or bad data.
    """
    if not isinstance(payload, dict) or "type" not in payload:
        raise ConfigError(f"a kernel provider must be given as {{'type': ..., 'data': ...}}, got {payload!r}")
    provider_class = _PROVIDER_CLASSES.get(payload["type"])
    if provider_class is None:
        raise ConfigError(f"unknown kernel provider type {payload['type']!r}; known: {sorted(_PROVIDER_CLASSES)}")
    try:
        return provider_class._from_state(dict(payload.get("data") or {}))
    except TypeError as exc:
        raise ConfigError(f"kernel provider {payload['type']}: bad data {payload.get('data')!r} ({exc})") from exc


def registered_kernel_providers() -> dict[str, type[KernelProvider]]:
    return dict(_PROVIDER_CLASSES)
