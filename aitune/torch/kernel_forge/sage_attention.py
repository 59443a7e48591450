"""SageAttention (package ``sageattention``) in place of SDPA as a kernel provider, through an opaque custom op."""

from __future__ import annotations

import functools
import math

import torch

from aitune.torch.common.requirements import Check, Requirement
from aitune.torch.kernel_forge.provider_base import KernelProvider
from aitune.torch.kernel_forge.sdpa_call import SDPACall, dtype_name


@functools.lru_cache(maxsize=None)
def cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _device_capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return cuda_capability(index)


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
