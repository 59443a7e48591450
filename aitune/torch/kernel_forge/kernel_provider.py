"""Kernel providers: replacement implementations of ``torch.nn.functional.scaled_dot_product_attention``.

A :class:`KernelProvider` says whether it can run here (:meth:`~KernelProvider.availability`, packages;
:meth:`~KernelProvider.check_device`, hardware) and whether it can take one actual call
(:meth:`~KernelProvider.supports`, from the call's shapes, dtypes, device, ``attn_mask``, ``is_causal``,
``dropout_p``, ``scale`` and ``enable_gqa``). Calls it cannot take are refused there, never discovered
as a crash in the middle of inference (thu-ml/SageAttention#134: an unsupported head dim or mask).

Providers are plain data: ``to_dict()`` gives ``{"type": <class name>, "data": {...}}`` and
:func:`kernel_provider_from_dict` rebuilds it among the registered provider classes only (no pickle).

Optional packages (``sageattention``, ``triton``) are imported only inside methods.
"""

from __future__ import annotations

import enum
import functools
import inspect
import logging
import math
import warnings
from typing import Any, ClassVar

import torch
import torch.nn.attention

from aitune.errors import ConfigError
from aitune.torch.common.requirements import Check, Requirement, check_requirements

logger = logging.getLogger(__name__)

# The builtin that ``torch.nn.functional.scaled_dot_product_attention`` is bound to. Taken from
# ``torch._C._nn`` so that a global monkey-patch of ``F`` made by someone else is not mistaken for it.
ORIGINAL_SDPA = torch._C._nn.scaled_dot_product_attention

SDPA_FUNCTION = "scaled_dot_product_attention"

# ``sdpa_kernel(..., set_priority=True)`` (a priority order rather than a set of enabled kernels) is not in
# every torch this package supports; read once here so the per-call path (traced by torch.compile) stays
# free of introspection. Without it, CUDA calls pin the one kernel too.
_SDPA_KERNEL_SET_PRIORITY = "set_priority" in inspect.signature(torch.nn.attention.sdpa_kernel).parameters

_SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class SDPACall:
    """One call of ``scaled_dot_product_attention``, its arguments bound to their names.

    Attributes:
        query: ``[..., L, E]`` (usually ``[B, Hq, L, E]``). key: ``[..., S, E]``. value: ``[..., S, Ev]``.
        attn_mask: None, or a bool / float mask broadcastable to ``[..., L, S]``.
        dropout_p: dropout probability (float). is_causal: causal (top-left aligned) mask.
        scale: softmax scale; None means ``1 / sqrt(E)``. enable_gqa: grouped-query attention.
    """

    __slots__ = _SDPA_PARAMETERS

    def __init__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
        self.query = query
        self.key = key
        self.value = value
        self.attn_mask = attn_mask
        self.dropout_p = dropout_p
        self.is_causal = is_causal
        self.scale = scale
        self.enable_gqa = enable_gqa

    @classmethod
    def from_args(cls, args: tuple, kwargs: dict) -> "SDPACall":
        """Bind ``scaled_dot_product_attention``'s ``(args, kwargs)``. Raises TypeError like SDPA would."""
        if len(args) > len(_SDPA_PARAMETERS):
            raise TypeError(f"scaled_dot_product_attention takes at most {len(_SDPA_PARAMETERS)} arguments")
        for name in kwargs:
            if name not in _SDPA_PARAMETERS:
                raise TypeError(f"scaled_dot_product_attention got an unexpected keyword argument {name!r}")
        return cls(*args, **kwargs)

    def kwargs(self) -> dict:
        """Keyword arguments for ``scaled_dot_product_attention`` (``enable_gqa`` only when set)."""
        values = {"attn_mask": self.attn_mask, "dropout_p": self.dropout_p, "is_causal": self.is_causal,
                  "scale": self.scale}
        if self.enable_gqa:
            values["enable_gqa"] = True
        return values

    def run_original(self) -> torch.Tensor:
        """The call made with PyTorch's own SDPA (its default kernel selection)."""
        return ORIGINAL_SDPA(self.query, self.key, self.value, **self.kwargs())

    # ---- derived facts (plain Python over tensor metadata: torch.compile traces them)
    @property
    def head_dim(self) -> int:
        return self.query.shape[-1]

    @property
    def value_head_dim(self) -> int:
        return self.value.shape[-1]

    @property
    def query_heads(self) -> int | None:
        return self.query.shape[-3] if self.query.dim() == 4 else None

    @property
    def kv_heads(self) -> int | None:
        return self.key.shape[-3] if self.key.dim() == 4 else None

    @property
    def device(self) -> torch.device:
        return self.query.device

    def mask_kind(self) -> str:
        """``"none"`` or ``"<dtype>/<rank>d"`` of the attention mask (e.g. ``"bool/4d"``)."""
        if self.attn_mask is None:
            return "none"
        return f"{dtype_name(self.attn_mask.dtype)}/{self.attn_mask.dim()}d"

    def family(self) -> tuple:
        """Runtime dispatch key: everything but batch size and sequence lengths (see ``FAMILY_FIELDS``)."""
        return (self.query.dim(), self.query_heads, self.kv_heads, self.head_dim, self.value_head_dim,
                self.query.dtype, self.query.device.type, self.mask_kind(), bool(self.is_causal),
                float(self.dropout_p), None if self.scale is None else float(self.scale), bool(self.enable_gqa))

    def describe(self) -> dict:
        """JSON-able summary: shapes, dtype, device, mask and flags."""
        return {
            "query": list(self.query.shape), "key": list(self.key.shape), "value": list(self.value.shape),
            "dtype": dtype_name(self.query.dtype), "device": str(self.query.device),
            "attn_mask": None if self.attn_mask is None else {"shape": list(self.attn_mask.shape),
                                                               "dtype": dtype_name(self.attn_mask.dtype)},
            "dropout_p": float(self.dropout_p), "is_causal": bool(self.is_causal),
            "scale": None if self.scale is None else float(self.scale), "enable_gqa": bool(self.enable_gqa),
        }


# Names of the entries of :meth:`SDPACall.family`, in order (the JSON form of a plan's match).
FAMILY_FIELDS = ("ndim", "query_heads", "kv_heads", "head_dim", "value_head_dim", "dtype", "device_type",
                 "attn_mask", "is_causal", "dropout_p", "scale", "enable_gqa")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def family_to_dict(family: tuple) -> dict:
    values = dict(zip(FAMILY_FIELDS, family))
    values["dtype"] = dtype_name(values["dtype"])
    return values


def family_from_dict(match: dict) -> tuple:
    """Inverse of :func:`family_to_dict`. Raises ConfigError on a missing field or unknown dtype."""
    missing = [name for name in FAMILY_FIELDS if name not in match]
    if missing:
        raise ConfigError(f"kernel plan entry is missing {missing}; re-run the kernel optimizer")
    dtype = getattr(torch, str(match["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"kernel plan entry has an unknown dtype {match['dtype']!r}")
    values = dict(match)
    values["dtype"] = dtype
    values["dropout_p"] = float(values["dropout_p"])
    values["scale"] = None if values["scale"] is None else float(values["scale"])
    return tuple(values[name] for name in FAMILY_FIELDS)


@functools.lru_cache(maxsize=None)
def cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _device_capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return cuda_capability(index)


# --------------------------------------------------------------------------------------------- base

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


# --------------------------------------------------------------------------------------------- torch SDPA


class _SDPAKernel(str, enum.Enum):
    FLASH = "flash"
    EFFICIENT = "efficient"
    CUDNN = "cudnn"
    MATH = "math"


_KERNEL_ALIASES = {
    "flash": _SDPAKernel.FLASH, "flash_attention": _SDPAKernel.FLASH,
    "efficient": _SDPAKernel.EFFICIENT, "efficient_attention": _SDPAKernel.EFFICIENT,
    "mem_efficient": _SDPAKernel.EFFICIENT, "memory_efficient": _SDPAKernel.EFFICIENT,
    "cudnn": _SDPAKernel.CUDNN, "cudnn_attention": _SDPAKernel.CUDNN,
    "math": _SDPAKernel.MATH,
}

_CPU_FLASH_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class TorchSDPAKernelProvider(KernelProvider):
    """PyTorch's own SDPA pinned to one of its kernels through ``torch.nn.attention.sdpa_kernel``.

    Args:
        backend: a ``torch.nn.attention.SDPBackend`` (``FLASH_ATTENTION``, ``EFFICIENT_ATTENTION``,
            ``CUDNN_ATTENTION``, ``MATH``) or its short name ``"flash"``, ``"efficient"``, ``"cudnn"``,
            ``"math"``.

    Devices (checked on torch 2.13 CPU here): ``math`` runs everywhere; ``flash`` runs on CPU (PyTorch's
    CPU flash kernel: 4-D inputs, ``dropout_p == 0``, equal query/value head dims, unit last-dim stride)
    and CUDA; ``efficient`` and ``cudnn`` have CUDA kernels only. On CUDA, :meth:`supports` asks
    PyTorch's own predicates (``torch.backends.cuda.can_use_flash_attention`` and friends) and reports
    their reason. At run time on CUDA the chosen kernel is put first in SDPA's priority order and the
    others follow in the default order, so a call the kernel cannot take falls back instead of failing.

    Raises:
        ConfigError: for an unknown backend name.
    """

    def __init__(self, backend: Any = "flash"):
        self.kernel = self._parse(backend)

    @staticmethod
    def _parse(backend: Any) -> _SDPAKernel:
        from torch.nn.attention import SDPBackend

        if isinstance(backend, _SDPAKernel):
            return backend
        if isinstance(backend, SDPBackend):
            by_member = {SDPBackend.FLASH_ATTENTION: _SDPAKernel.FLASH,
                         SDPBackend.EFFICIENT_ATTENTION: _SDPAKernel.EFFICIENT,
                         SDPBackend.CUDNN_ATTENTION: _SDPAKernel.CUDNN, SDPBackend.MATH: _SDPAKernel.MATH}
            if backend not in by_member:
                raise ConfigError(f"TorchSDPAKernelProvider: SDPBackend {backend.name} is not a kernel it can pin; "
                                  "use FLASH_ATTENTION, EFFICIENT_ATTENTION, CUDNN_ATTENTION or MATH")
            return by_member[backend]
        key = str(backend).lower().removeprefix("sdpbackend.")
        if key not in _KERNEL_ALIASES:
            raise ConfigError(f"TorchSDPAKernelProvider: unknown SDPA backend {backend!r}; "
                              "use 'flash', 'efficient', 'cudnn' or 'math' (or a torch.nn.attention.SDPBackend)")
        return _KERNEL_ALIASES[key]

    @property
    def name(self) -> str:
        return f"torch_sdpa_{self.kernel.value}"

    @property
    def backend(self):
        """The ``torch.nn.attention.SDPBackend`` member this provider pins."""
        from torch.nn.attention import SDPBackend

        return {_SDPAKernel.FLASH: SDPBackend.FLASH_ATTENTION, _SDPAKernel.EFFICIENT: SDPBackend.EFFICIENT_ATTENTION,
                _SDPAKernel.CUDNN: SDPBackend.CUDNN_ATTENTION, _SDPAKernel.MATH: SDPBackend.MATH}[self.kernel]

    def _check_device(self, device: torch.device) -> Check:
        if device.type == "cuda":
            if not torch.cuda.is_available():
                return Check(False, "CUDA is not available in this process")
            return Check(True)
        if device.type == "cpu":
            if self.kernel in (_SDPAKernel.EFFICIENT, _SDPAKernel.CUDNN):
                return Check(False, f"PyTorch's {self.kernel.value} SDPA kernel has no CPU implementation "
                                    "(CUDA only)")
            return Check(True)
        return Check(False, f"{self.name} runs on CPU or CUDA, not {device.type}")

    def _refusal(self, call: SDPACall) -> str | None:
        device_type = call.query.device.type
        if device_type not in ("cpu", "cuda"):
            return f"{self.name} runs on CPU or CUDA, not {device_type}"
        if device_type == "cpu" and self.kernel in (_SDPAKernel.EFFICIENT, _SDPAKernel.CUDNN):
            return f"PyTorch's {self.kernel.value} SDPA kernel has no CPU implementation (CUDA only)"
        if device_type == "cpu" and self.kernel is _SDPAKernel.FLASH:
            # The rules of PyTorch's CPU flash kernel (aten sdp_utils_cpp: use_flash_attention_cpp).
            if call.query.dim() != 4 or call.key.dim() != 4 or call.value.dim() != 4:
                return "the CPU flash SDPA kernel takes 4-D query/key/value only"
            if call.dropout_p != 0.0:
                return "the CPU flash SDPA kernel does not take dropout_p > 0"
            if call.query.dtype not in _CPU_FLASH_DTYPES:
                return f"the CPU flash SDPA kernel does not take {dtype_name(call.query.dtype)}"
            if call.head_dim != call.key.shape[-1] or call.head_dim != call.value_head_dim:
                return "the CPU flash SDPA kernel needs equal query, key and value head dims"
            if call.query.stride(-1) != 1 or call.key.stride(-1) != 1 or call.value.stride(-1) != 1:
                return "the CPU flash SDPA kernel needs a unit stride in the last dim of query/key/value"
        return None

    def _exact_refusal(self, call: SDPACall) -> str | None:
        if call.query.device.type != "cuda" or self.kernel is _SDPAKernel.MATH:
            return None
        predicate = {_SDPAKernel.FLASH: "can_use_flash_attention", _SDPAKernel.EFFICIENT: "can_use_efficient_attention",
                     _SDPAKernel.CUDNN: "can_use_cudnn_attention"}[self.kernel]
        check = getattr(torch.backends.cuda, predicate, None)
        params_class = getattr(torch.backends.cuda, "SDPAParams", None)
        if check is None or params_class is None:
            return None
        params = params_class(call.query, call.key, call.value, call.attn_mask, float(call.dropout_p),
                              bool(call.is_causal), bool(call.enable_gqa))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ok = check(params, True)
        if ok:
            return None
        reasons = [str(item.message).strip().splitlines()[0] for item in caught if str(item.message).strip()]
        detail = "; ".join(reasons[:3]) or "no reason given"
        return f"PyTorch's {self.kernel.value} kernel refuses this call: {detail}"

    def run(self, call: SDPACall) -> torch.Tensor:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if call.query.device.type == "cuda" and _SDPA_KERNEL_SET_PRIORITY:
            order = [self.backend] + [b for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                                  SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION) if b != self.backend]
            context = sdpa_kernel(order, set_priority=True)
        else:
            # CPU kernel selection ignores the priority order (and older torch has none): pin the one kernel.
            context = sdpa_kernel([self.backend])
        with context:
            return ORIGINAL_SDPA(call.query, call.key, call.value, **call.kwargs())

    def _state(self) -> dict:
        return {"backend": self.kernel.value}


# --------------------------------------------------------------------------------------------- SageAttention

# Head dims SageAttention 1.0.6 ``sageattn`` takes (its README and its ``assert headdim in [64, 96, 128]``).
SAGE_HEAD_DIMS = (64, 96, 128)
SAGE_MIN_CAPABILITY = (8, 0)

_SAGE_OP = None


def _sage_op():
    """``aitune::sageattn`` custom op around ``sageattention.sageattn`` (created on first use).

    A custom op keeps the Triton kernel opaque to ``torch.compile`` (the compiled graph calls it as one
    node, with a fake implementation for shapes), instead of dynamo tracing SageAttention's Python.
    """
    global _SAGE_OP
    if _SAGE_OP is not None:
        return _SAGE_OP

    @torch.library.custom_op("aitune::sageattn", mutates_args=(), device_types="cuda")
    def sageattn_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool,
                    sm_scale: float) -> torch.Tensor:
        from sageattention import sageattn

        # NOTE [sage smooth_k]: sageattention 1.0.6 smooths K with ``k -= k.mean(...)``, in place on the
        # caller's tensor. Subtracting a per-(batch, head) constant row from K shifts every logit of a
        # query row by the same amount, which softmax ignores; so we smooth out of place here and pass
        # smooth_k=False: same result, the caller's key is left untouched.
        key = key - key.mean(dim=2, keepdim=True)
        return sageattn(query, key, value, tensor_layout="HND", is_causal=is_causal, sm_scale=sm_scale,
                        smooth_k=False)

    @sageattn_op.register_fake
    def _(query, key, value, is_causal, sm_scale):
        return query.new_empty((*query.shape[:-1], value.shape[-1]))

    _SAGE_OP = sageattn_op
    return _SAGE_OP


class SageAttentionKernelProvider(KernelProvider):
    """SageAttention (package ``sageattention``, Triton kernels; INT8 Q·K with FP16 P·V) in place of SDPA.

    Extra: ``pip install 'aitune[sage]'`` (sageattention >= 1.0.6, needs triton). Hardware: CUDA GPUs
    of compute capability >= 8.0 (the SageAttention README targets Ampere, Ada and Hopper).

    Calls refused by :meth:`supports` (they run on the original SDPA): not CUDA; dtype other
    than float16/bfloat16; not 4-D ``[B, H, L, E]``; head dim not in 64/96/128 (sageattention 1.0.6
    ``assert headdim in [64, 96, 128]``; thu-ml/SageAttention#119, #134 report 160 and 512 failing);
    value head dim different from the query's; any ``attn_mask`` (the kernel has none); ``dropout_p > 0``;
    ``is_causal`` with different query and key lengths (sageattn's causal mask needs ``L == S``); query
    heads differing from key/value heads unless ``enable_gqa`` and divisible.

    The kernel quantizes Q and K to INT8, so its output differs from SDPA by more than fp16 rounding;
    the optimizer keeps it only where it passes the attention tolerance.
    """

    requirements = (
        Requirement("sageattention", ("sageattention",), "sage", "1.0.6"),
        Requirement("triton", ("triton", "pytorch-triton"), "sage"),
    )

    @property
    def name(self) -> str:
        return "sage_attention"

    def _check_device(self, device: torch.device) -> Check:
        if device.type != "cuda":
            return Check(False, f"SageAttention runs on CUDA GPUs only, not {device.type}")
        capability = _device_capability(device)
        if capability is None:
            return Check(False, "SageAttention needs CUDA, which is not available in this process")
        if capability < SAGE_MIN_CAPABILITY:
            return Check(False, f"SageAttention needs compute capability >= 8.0; this GPU is sm_{capability[0]}"
                                f"{capability[1]}")
        return Check(True)

    def _refusal(self, call: SDPACall) -> str | None:
        query, key, value = call.query, call.key, call.value
        if query.dtype not in (torch.float16, torch.bfloat16):
            return f"SageAttention takes float16/bfloat16 inputs, not {dtype_name(query.dtype)}"
        if key.dtype != query.dtype or value.dtype != query.dtype:
            return "SageAttention needs query, key and value of one dtype"
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            return "SageAttention takes 4-D [batch, heads, length, head_dim] inputs only"
        if call.attn_mask is not None:
            return "SageAttention has no attn_mask support"
        if call.dropout_p != 0.0:
            return "SageAttention has no dropout (dropout_p must be 0)"
        if call.head_dim not in SAGE_HEAD_DIMS:
            return f"SageAttention takes head_dim 64, 96 or 128, not {call.head_dim}"
        if call.value_head_dim != call.head_dim or key.shape[-1] != call.head_dim:
            return "SageAttention needs equal query, key and value head dims"
        if call.is_causal and query.shape[-2] != key.shape[-2]:
            return "SageAttention's causal mask needs equal query and key lengths"
        if query.shape[0] != key.shape[0] or key.shape[0] != value.shape[0]:
            return "SageAttention needs one batch size for query, key and value"
        if key.shape[1] != value.shape[1] or key.shape[2] != value.shape[2]:
            return "SageAttention needs key and value of one shape"
        if query.shape[1] != key.shape[1]:
            if not call.enable_gqa:
                return "query and key/value head counts differ without enable_gqa"
            if query.shape[1] % key.shape[1] != 0:
                return "query heads must be a multiple of key/value heads"
        if query.device.type != "cuda":
            return f"SageAttention runs on CUDA only, not {query.device.type}"
        if query.device != key.device or key.device != value.device:
            return "SageAttention needs query, key and value on one device"
        return None

    def run(self, call: SDPACall) -> torch.Tensor:
        query, key, value = call.query, call.key, call.value
        if query.stride(-1) != 1:
            query = query.contiguous()
        if key.stride(-1) != 1:
            key = key.contiguous()
        if value.stride(-1) != 1:
            value = value.contiguous()
        scale = call.scale if call.scale is not None else 1.0 / math.sqrt(call.head_dim)
        return _sage_op()(query, key, value, bool(call.is_causal), float(scale))


__all__ = [
    "FAMILY_FIELDS",
    "KernelProvider",
    "ORIGINAL_SDPA",
    "SDPACall",
    "SageAttentionKernelProvider",
    "TorchSDPAKernelProvider",
    "kernel_provider_from_dict",
    "registered_kernel_providers",
]
