"""PyTorch's own SDPA pinned to one of its kernels (flash, efficient, cuDNN, math) as a kernel provider."""

from __future__ import annotations

import enum
import inspect
import warnings
from typing import Any

import torch
import torch.nn.attention

from aitune.errors import ConfigError
from aitune.torch.common.requirements import Check
from aitune.torch.kernel_forge.provider_base import KernelProvider
from aitune.torch.kernel_forge.sdpa_call import ORIGINAL_SDPA, SDPACall, dtype_name


# ``sdpa_kernel(..., set_priority=True)`` (a priority order rather than a set of enabled kernels) is not in
# every torch this package supports; read once here so the per-call path (traced by torch.compile) stays
# free of introspection. Without it, CUDA calls pin the one kernel too.
_SDPA_KERNEL_SET_PRIORITY = "set_priority" in inspect.signature(torch.nn.attention.sdpa_kernel).parameters


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
