"""Small models from ../shared/cases/CASES.md (our own code), shared by the case, contract and unit tests.

Defined at module level in an importable module so checkpoints can name their output types and a fresh
process can import them before loading (aitune never imports a type by name itself).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


class FlattenHead(nn.Module):
    """A batch-1 sample must not pin the batch axis. x [B, 3, 16, 16] -> [B, 10]."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 16 * 16, 10)

    def forward(self, x):
        y = self.conv(x)
        return self.fc(y.reshape(y.shape[0], -1))


class SplitHeads(nn.Module):
    """Python-int sizes become constants when traced. x [B, T, 64] -> [B, 4, T * 16]."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64)

    def forward(self, x):
        b, t = int(x.shape[0]), int(x.shape[1])
        h = self.proj(x).view(b, t, 4, 16).transpose(1, 2)
        return F.scaled_dot_product_attention(h, h, h).reshape(b, 4, t * 16)


@dataclasses.dataclass
class HeadOut:
    """A dataclass output holding a dict with a nested tuple."""

    boxes: torch.Tensor
    scores: torch.Tensor
    extra: dict


class Detector(nn.Module):
    """x [B, 32] -> HeadOut(boxes [B, 4], scores [B], extra={logits [B, 12], stats ([B], [B])})."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 12)

    def forward(self, x):
        y = self.fc(x)
        return HeadOut(boxes=y[:, :4], scores=y[:, 4].sigmoid(),
                       extra={"logits": y, "stats": (y.amax(-1), y.mean(-1))})


@dataclasses.dataclass
class Pooled:
    """A dataclass output with a float constant leaf."""

    logits: torch.Tensor
    features: torch.Tensor
    temperature: float


class MaskedPool(nn.Module):
    """tokens [B, T, 8] and mask [B, T] -> Pooled(logits [B, 4], features [B, T, 16], temperature 0.5)."""

    def __init__(self):
        super().__init__()
        self.encode = nn.Linear(8, 16)
        self.classify = nn.Linear(16, 4)

    def forward(self, tokens, mask):
        features = torch.relu(self.encode(tokens)) * mask.unsqueeze(-1)
        pooled = features.sum(1) / mask.sum(1, keepdim=True).clamp_min(1.0)
        return Pooled(logits=self.classify(pooled), features=features, temperature=0.5)


class Ranker(nn.Module):
    """Keyword-only forward and **extra. input_ids [B, T] int64 -> [B, 1]."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1000, 32)
        self.out = nn.Linear(32, 1)

    def forward(self, *, input_ids, attention_mask=None, **extra):
        h = self.emb(input_ids)
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1).to(h.dtype)
        if "bias" in extra:
            h = h + extra["bias"]
        return self.out(h.mean(1))


class PairScore(nn.Module):
    """Strides matter. m [N, 3, 4] -> [N, 3]."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4))

    def forward(self, m):
        return (m * self.w).sum(-1).softmax(-1)


class MHA(nn.Module):
    """An attention block: x [B, T, C] -> [B, T, C], ``heads`` heads of C // heads."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.h, self.qkv = heads, nn.Linear(dim, 3 * dim)

    def forward(self, x, mask=None):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return o.transpose(1, 2).reshape(B, T, C)


class TwoTowers(nn.Module):
    """Tower ``a`` (no mask) and tower ``b`` (with a mask), e.g. head dims 128 and 160 on CUDA."""

    def __init__(self, dim_a: int = 1024, dim_b: int = 1280, heads: int = 8):
        super().__init__()
        self.a = MHA(dim_a, heads)
        self.b = MHA(dim_b, heads)

    def forward(self, x, y, mask):
        return self.a(x), self.b(y, mask)



@dataclasses.dataclass
class Attended:
    """AttentionPool's output: tensors, a dict holding a nested tuple, and a float constant."""

    logits: torch.Tensor
    features: torch.Tensor
    extra: dict
    temperature: float


class AttentionPool(nn.Module):
    """The backend contract suite's model (tests/contract/test_backend_contract.py).

    tokens [B, T, 8] float32 and mask [B, T] float32 (1 = keep) -> Attended(logits [B, 4], features [B, T, 16],
    extra={"pooled": [B, 16], "stats": ([B, T], [B])}, temperature=0.5). Linear layers (something to
    quantize), one SDPA call over 2 heads of 8 (something for a kernel selector to choose), a buffer, masked
    mean pooling; batch and length are dynamic axes.
    """

    def __init__(self):
        super().__init__()
        self.encode = nn.Linear(8, 16)
        self.qkv = nn.Linear(16, 48)
        self.classify = nn.Linear(16, 4)
        self.register_buffer("feature_scale", torch.linspace(0.5, 1.5, 16))

    def forward(self, tokens, mask):
        hidden = torch.relu(self.encode(tokens))
        batch, length, width = hidden.shape
        q, k, v = self.qkv(hidden).view(batch, length, 3, 2, width // 2).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, length, width)
        features = (hidden + attended) * self.feature_scale * mask.unsqueeze(-1)
        pooled = features.sum(1) / mask.sum(1, keepdim=True).clamp_min(1.0)
        return Attended(logits=self.classify(pooled), features=features,
                        extra={"pooled": pooled, "stats": (features.amax(-1), mask.sum(1))}, temperature=0.5)
