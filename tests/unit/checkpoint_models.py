"""Models shared by test_checkpoint.py / test_cache.py and the fresh-process children they start.

The children import this file by name (``import checkpoint_models``), so the structure types below
(``Features``, ``EncoderOutput``) resolve at load exactly as in the parent: checkpoints look such types
up among imported modules only.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from torch import nn


class Features(NamedTuple):
    """tokens [B, T, 8] float32, mask [B, T] float32 (1 = keep)."""

    tokens: torch.Tensor
    mask: torch.Tensor


@dataclasses.dataclass
class EncoderOutput:
    """hidden [B, T, 16], pooled [B, 16] (float32) and the constant ``scale`` it was called with."""

    hidden: torch.Tensor
    pooled: torch.Tensor
    scale: float


class Encoder(nn.Module):
    """Features (a namedtuple) + constants ``pooling`` (str) and ``scale`` (float) -> EncoderOutput (a dataclass)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, features: Features, pooling: str = "mean", scale: float = 1.0) -> EncoderOutput:
        hidden = self.norm(torch.relu(self.embed(features.tokens))) * scale
        mask = features.mask.unsqueeze(-1)
        if pooling == "mean":
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)
        else:
            pooled = (hidden * mask).amax(1)
        return EncoderOutput(hidden=hidden, pooled=pooled, scale=scale)


class TiedHead(nn.Module):
    """x [B, 16] -> [B, 16]; ``out`` reuses ``proj``'s weight (tied weights are stored once)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.out = nn.Linear(16, 16, bias=False)
        self.out.weight = self.proj.weight

    def forward(self, x):
        return self.out(torch.tanh(self.proj(x)))


def c23_mlp() -> nn.Module:
    """Linear(256, 512) -> GELU -> Linear(512, 64) in bfloat16 (CPU here)."""
    return nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 64)).bfloat16().eval()


class Pipeline:
    """A plain object holding modules as attributes (a "pipeline"), as ait.save/load address them."""

    def __init__(self, seed: int):
        torch.manual_seed(seed)
        self.encoder = Encoder().eval()
        self.head = TiedHead().eval()
        self.mlp = c23_mlp()

    def __call__(self, batch):
        features, x = batch
        encoded = self.encoder(features, pooling="mean", scale=0.5)
        return {"encoder": encoded, "head": self.head(encoded.pooled), "mlp": self.mlp(x)}


def make_batch(batch: int, length: int, seed: int):
    """(Features(tokens [batch, length, 8], mask [batch, length]), x [batch, 256] bfloat16)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randn(batch, length, 8, generator=generator)
    mask = (torch.rand(batch, length, generator=generator) > 0.2).float()
    mask[:, 0] = 1.0
    x = torch.randn(batch, 256, generator=generator).bfloat16()
    return Features(tokens, mask), x


def dataset():
    """Two batches: batch 2/length 5 and batch 4/length 7 (dynamic batch and length axes)."""
    return [make_batch(2, 5, 0), make_batch(4, 7, 1)]


def probe():
    """A call inside the recorded ranges (batch 3, length 6) that was never recorded."""
    return make_batch(3, 6, 9)


def flatten_outputs(outputs: dict) -> dict[str, torch.Tensor]:
    """Pipeline outputs as named tensors (for safetensors files)."""
    return {"encoder.hidden": outputs["encoder"].hidden.contiguous(),
            "encoder.pooled": outputs["encoder"].pooled.contiguous(),
            "head": outputs["head"].contiguous(), "mlp": outputs["mlp"].contiguous()}
