"""ONNX Runtime's transformer fusions: which modules are worth them, and what a fused model's statistics say."""

from __future__ import annotations

import torch


def looks_like_transformer_encoder(module: torch.nn.Module | None) -> bool:
    """A BERT-like encoder (attention + embeddings submodules, by class name): worth ONNX Runtime's
    transformer fusions. A heuristic only: a fusion that changes results is rejected by the value check."""
    if module is None:
        return False
    names = {type(sub).__name__ for sub in module.modules()}
    return any("Attention" in name for name in names) and any("Embedding" in name and name != "Embedding"
                                                              for name in names)


# Fusions ONNX Runtime's own graph optimizer also makes at level "extended"/"all" on CPU and CUDA (LayerNormFusion,
# SimplifiedLayerNormFusion, GeluFusion, BiasGeluFusion: ONNX Runtime's "Graph optimizations" documentation)
SESSION_FUSIONS = frozenset({"LayerNormalization", "SimplifiedLayerNormalization", "Gelu", "BiasGelu"})


def transformer_fusion_note(counts: dict) -> str:
    """What ONNX Runtime's transformer optimizer fused (``{operator: count}``), saying so when it fused only what
    the session's own optimizer fuses anyway: the variant then runs the same graph as plain ONNX Runtime."""
    fused = ", ".join(f"{name} {count}" for name, count in sorted(counts.items()))
    if set(counts) <= SESSION_FUSIONS:
        return (f"transformer optimizer fused no attention or skip/embed layer norm ({fused or 'nothing'}; ONNX "
                "Runtime's own optimizer makes these too): the same graph as the default variant")
    return f"transformer fusions: {fused}"
