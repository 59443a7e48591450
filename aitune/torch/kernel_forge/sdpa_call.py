"""One call of ``scaled_dot_product_attention`` (:class:`SDPACall`) and its family: the shape/dtype/flag
key a kernel plan matches calls by (:data:`FAMILY_FIELDS`, :func:`family_to_dict`, :func:`family_from_dict`)."""

from __future__ import annotations

import torch

from aitune.errors import ConfigError


# The builtin that ``torch.nn.functional.scaled_dot_product_attention`` is bound to. Taken from
# ``torch._C._nn`` so that a global monkey-patch of ``F`` made by someone else is not mistaken for it.
ORIGINAL_SDPA = torch._C._nn.scaled_dot_product_attention

SDPA_FUNCTION = "scaled_dot_product_attention"


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
