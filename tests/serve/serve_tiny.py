"""A tiny masked-pooling encoder, its builder and a quick checkpoint, for the Ray-free serve tests.

Importable as ``serve_tiny`` (pytest puts this folder on ``sys.path``), so ``ServeConfig.builder`` can name
``serve_tiny:build_tiny``.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import torch

import aitune.torch as ait
from aitune.torch.backend import ONNXRuntimeBackend
from aitune.torch.checkpoint import sums_path

VOCAB, WIDTH = 50, 16
# Batches of 1 and 4 rows, 4 and 8 tokens: batch axis 1..4, token axis 4..8.
TUNE_SHAPES = ((1, 4), (4, 8), (2, 6))


class TinyEncoder(torch.nn.Module):
    """``forward(input_ids [B, T] int64, attention_mask [B, T] int64)`` -> masked mean of embeddings ``[B, 16]``."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.proj = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, input_ids, attention_mask):
        states = torch.tanh(self.proj(self.embed(input_ids)))
        mask = attention_mask.unsqueeze(-1).to(states.dtype)
        return (states * mask).sum(1) / mask.sum(1).clamp_min(1.0)


def build_tiny() -> torch.nn.Module:
    """The same weights every time (the checkpoint's AOT artifact holds them; eager fallback needs them too)."""
    torch.manual_seed(1234)
    return TinyEncoder().eval()


BUILT_ON: list = []  # the devices build_tiny_on was given, in order


def build_tiny_on(device) -> torch.nn.Module:
    """A builder that takes the replica's device: records it and builds the tiny encoder there."""
    BUILT_ON.append(device)
    return build_tiny().to(device)


def tiny_batch(rows: int, tokens: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, VOCAB, (rows, tokens), generator=generator)
    attention_mask = torch.ones(rows, tokens, dtype=torch.int64)
    attention_mask[:, tokens - 1:] = 0 if tokens > 1 else 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def save_tiny_checkpoint(path: Path, profiling, cache_dir: Path, shapes=TUNE_SHAPES) -> Path:
    """Tune the tiny encoder with ONNX Runtime (no performance validation) on batches of ``shapes`` ((rows,
    tokens) each) and save it."""
    strategy = ait.OneBackendStrategy(ONNXRuntimeBackend(), profiling_config=profiling)
    strategy.enable_performance_validation(False)
    encoder = ait.Module(build_tiny(), "tiny", strategy=strategy)
    batches = [tiny_batch(rows, tokens, seed=i) for i, (rows, tokens) in enumerate(shapes)]
    ait.tune(lambda batch: encoder(**batch), batches, cache_dir_path=cache_dir, ready_batches=True)
    return ait.save(encoder, path)


def forge_manifest(source: Path, target: Path, edit) -> Path:
    """A copy of a checkpoint with ``edit(manifest)`` applied and its digests rewritten to match.

    The digests detect corruption, not edits by whoever can rewrite the sums too (README); this is how the
    tests make a checkpoint that names, say, a backend this machine lacks, without faking the machine.
    """
    with zipfile.ZipFile(source) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    manifest = json.loads(members["manifest.json"])
    edit(manifest)
    members["manifest.json"] = json.dumps(manifest, indent=1, sort_keys=True).encode()
    sums = "".join(f"{hashlib.sha256(data).hexdigest()}  {name}\n"
                   for name, data in sorted(members.items()) if name != "SHA256SUMS")
    members["SHA256SUMS"] = sums.encode()
    with zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    sums_path(target).write_text(sums)
    return target
