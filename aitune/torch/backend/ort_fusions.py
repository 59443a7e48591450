"""ONNX Runtime's transformer fusions: which modules are worth them, and what a fused model's statistics say."""

from __future__ import annotations

from pathlib import Path

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


def fuse_transformer(onnx_path: Path, model_type: str, use_gpu: bool, fused_path: Path,
                     external_data: bool) -> dict[str, int]:
    """Run ONNX Runtime's transformer optimizer (``onnxruntime.transformers.optimizer.optimize_model``) on the
    model at ``onnx_path`` and save the result to ``fused_path``; returns ``{fused operator: count}`` (counts > 0).

    ``use_gpu``: "If your model is intended for GPU inference only (especially float16 or mixed precision model),
    it is recommended to set use_gpu to be True" (``optimize_model``'s docstring). Its ``float16`` conversion is
    not used: it would turn an fp32 model into fp16 (an fp16 model is fused as it is). ``opt_level=0`` applies
    the Python fusions only; the session's own optimizer runs afterwards.
    """
    from onnxruntime.transformers import optimizer

    fused = optimizer.optimize_model(str(onnx_path), model_type=model_type, num_heads=0, hidden_size=0, opt_level=0,
                                     use_gpu=use_gpu)
    fused.save_model_to_file(str(fused_path), use_external_data_format=external_data)
    return {name: count for name, count in fused.get_fused_operator_statistics().items() if count}
