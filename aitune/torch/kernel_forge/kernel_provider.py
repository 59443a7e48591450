"""Kernel providers: replacement implementations of ``torch.nn.functional.scaled_dot_product_attention``.

A :class:`KernelProvider` says whether it can run here (:meth:`~KernelProvider.availability`, packages;
:meth:`~KernelProvider.check_device`, hardware) and whether it can take one actual call
(:meth:`~KernelProvider.supports`, from the call's shapes, dtypes, device, ``attn_mask``, ``is_causal``,
``dropout_p``, ``scale`` and ``enable_gqa``). Calls it cannot take are refused there, never discovered
as a crash in the middle of inference (thu-ml/SageAttention#134: an unsupported head dim or mask).

Providers are plain data: ``to_dict()`` gives ``{"type": <class name>, "data": {...}}`` and
:func:`kernel_provider_from_dict` rebuilds it among the registered provider classes only (no pickle).

Optional packages (``sageattention``, ``triton``) are imported only inside methods.

Modules: :mod:`~aitune.torch.kernel_forge.sdpa_call` (the call and its family),
:mod:`~aitune.torch.kernel_forge.provider_base` (the base class and its registry),
:mod:`~aitune.torch.kernel_forge.torch_sdpa` and :mod:`~aitune.torch.kernel_forge.sage_attention` (the
providers). Every name stays importable from here (a public path of the reference interface).
"""

from aitune.torch.kernel_forge.provider_base import (
    KernelProvider,
    kernel_provider_from_dict,
    registered_kernel_providers,
)
from aitune.torch.kernel_forge.sage_attention import (  # noqa: F401 - re-exported
    SAGE_HEAD_DIMS,
    SAGE_MIN_CAPABILITY,
    SageAttentionKernelProvider,
    cuda_capability,
)
from aitune.torch.kernel_forge.sdpa_call import (  # noqa: F401 - re-exported
    FAMILY_FIELDS,
    ORIGINAL_SDPA,
    SDPA_FUNCTION,
    SDPACall,
    dtype_name,
    family_from_dict,
    family_to_dict,
)
from aitune.torch.kernel_forge.torch_sdpa import TorchSDPAKernelProvider


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
