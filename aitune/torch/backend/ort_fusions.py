"""ONNX Runtime's transformer fusions: which modules are worth them, the export they need, and what a fused model's
statistics say.

NOTE [what attention fusion needs]: ONNX Runtime's transformer optimizer (``onnxruntime.transformers.optimizer``,
``model_type="bert"``, onnxruntime 1.32, transformers 5.24, torch 2.13) fused ``Attention`` and
``EmbedLayerNormalization`` on a Hugging Face ``BertModel`` only when all of these held: ``num_heads`` and
``hidden_size`` given (with 0 it logs "Failed to detect num_heads and hidden_size for Attention fusion"), the model's
attention implementation ``"eager"`` (the ``"sdpa"`` graph is not matched), the TorchScript exporter (not the
dynamo exporter's graph), and an attention mask input. Otherwise it fuses only skip/layer norms and BiasGelu. So the
fusion variant exports an eager-attention copy of the module with the TorchScript exporter
(:func:`export_for_fusions`) and passes the heads and width from the model's config (:func:`attention_shape`).
"""

from __future__ import annotations

import copy
import gc
import logging
from pathlib import Path

import torch

from aitune.errors import one_line
from aitune.torch.backend.onnx_export import OnnxExport, export_onnx
from aitune.torch.backend.onnx_file_io import onnx_for_backend
from aitune.torch.record.onnx_module import OnnxModule

logger = logging.getLogger(__name__)

# ``if`` statements of transformers' eager attention path that the TorchScript trace bakes and that compare sizes only
# (``onnx_export``'s NOTE [baked branches]): ``prepare_padding_mask`` in ``transformers/masking_utils.py`` pads an
# attention mask shorter than the keys; an encoder's mask has the keys' length, so every valid call takes the traced
# branch (no padding).
TRANSFORMERS_SHAPE_ONLY_BRANCHES = frozenset({
    ("transformers/masking_utils.py", "if (padding_length := kv_length + kv_offset - attention_mask.shape[-1]) > 0:"),
})


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


def fuse_transformer(onnx_path: Path, model_type: str, use_gpu: bool, fused_path: Path, external_data: bool,
                     num_heads: int = 0, hidden_size: int = 0) -> dict[str, int]:
    """Run ONNX Runtime's transformer optimizer (``onnxruntime.transformers.optimizer.optimize_model``) on the
    model at ``onnx_path`` and save the result to ``fused_path``; returns ``{fused operator: count}`` (counts > 0).

    ``use_gpu``: "If your model is intended for GPU inference only (especially float16 or mixed precision model),
    it is recommended to set use_gpu to be True" (``optimize_model``'s docstring). Its ``float16`` conversion is
    not used: it would turn an fp32 model into fp16 (an fp16 model is fused as it is). ``opt_level=0`` applies
    the Python fusions only; the session's own optimizer runs afterwards. ``num_heads``, ``hidden_size``: the
    attention heads and hidden width (:func:`attention_shape`); 0 lets the optimizer detect them from the graph,
    which failed on Hugging Face BERT exports (NOTE [what attention fusion needs]).
    """
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.fusion_options import FusionOptions

    # NOTE [raw attention mask]: by default the optimizer turns a BERT mask into per-row lengths
    # (AttentionMaskFormat.MaskIndexEnd), which assumes every row is ones then zeros; a left-padded row then gets
    # another answer than eager's, at shapes the value check may never see. The raw mask keeps any pattern.
    options = FusionOptions(model_type)
    options.use_raw_attention_mask(True)
    source = _with_inferred_shapes(onnx_path, fused_path)
    try:
        fused = optimizer.optimize_model(str(source), model_type=model_type, num_heads=num_heads,
                                         hidden_size=hidden_size, opt_level=0, use_gpu=use_gpu,
                                         optimization_options=options)
    finally:
        if source != onnx_path:
            source.unlink(missing_ok=True)
    fused.save_model_to_file(str(fused_path), use_external_data_format=external_data)
    return {name: count for name, count in fused.get_fused_operator_statistics().items() if count}


def _with_inferred_shapes(onnx_path: Path, fused_path: Path) -> Path:
    """A copy of the model at ``onnx_path`` with every tensor's shape ONNX can infer written into the graph
    (``onnx.shape_inference.infer_shapes_path`` with data propagation), beside it; ``onnx_path`` itself when
    that fails or when the model is not in ``fused_path``'s folder (an OnnxModule's own file: nothing is written
    beside it).

    NOTE [shapes for the fusions]: the transformer optimizer's attention and skip-layer-norm fusions read tensor
    shapes from its own symbolic shape inference. That inference failed (``TypeError`` in ``_infer_Expand``) on an
    encoder followed by ``F.normalize`` (a sentence encoder: masked mean, then L2 norm), and then nothing but
    BiasGelu and LayerNormalization fused. With ONNX's shapes in the graph first, attention fused there too
    (``tests/unit/test_ort_attention_fusion.py``). The copy holds the graph and, for a model without external data,
    its weights too: up to 2 GiB more on disk until the optimizer has read it."""
    import onnx

    if onnx_path.parent.resolve() != fused_path.parent.resolve():
        return onnx_path
    inferred = fused_path.with_name(f"shapes_{onnx_path.name}")  # beside the model: its external data resolves
    try:
        onnx.shape_inference.infer_shapes_path(str(onnx_path), str(inferred), data_prop=True)
    except Exception:  # noqa: BLE001 - the optimizer then infers shapes itself, as without this step
        logger.debug("onnxruntime: ONNX shape inference failed before the transformer fusions", exc_info=True)
        inferred.unlink(missing_ok=True)
        return onnx_path
    return inferred


def hf_models(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The Hugging Face models in ``module``: it and its submodules (in ``module.modules()`` order) that have a
    ``config`` with integer ``num_attention_heads`` and ``hidden_size`` (a ``PreTrainedModel``, also inside a
    ``SentenceTransformer`` or any wrapper), outermost only."""
    found: list[torch.nn.Module] = []
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if isinstance(getattr(config, "num_attention_heads", None), int) and \
                isinstance(getattr(config, "hidden_size", None), int) and \
                not any(any(inner is sub for inner in outer.modules()) for outer in found):
            found.append(sub)
    return found


def attention_shape(module: torch.nn.Module | None) -> tuple[int, int]:
    """``(num_heads, hidden_size)`` for :func:`fuse_transformer`: ``config.num_attention_heads`` and
    ``config.hidden_size`` of the Hugging Face model in ``module`` (:func:`hf_models`); ``(0, 0)`` (the optimizer
    detects them) when there is none or the models found disagree."""
    shapes = {(model.config.num_attention_heads, model.config.hidden_size) for model in hf_models(module)} \
        if isinstance(module, torch.nn.Module) else set()
    return shapes.pop() if len(shapes) == 1 else (0, 0)


def eager_attention_copy(module: torch.nn.Module) -> torch.nn.Module | None:
    """A deep copy of ``module`` whose Hugging Face models (:func:`hf_models`) use the ``"eager"`` attention
    implementation (``PreTrainedModel.set_attn_implementation``); None when ``module`` holds no model that can set
    it. ``module`` itself is not changed (the copy has its own configs).

    The copy holds a second set of the module's parameters and buffers (as much memory again, on the module's
    device) until the caller drops it.

    Raises:
        RuntimeError: a model in the copy did not switch to ``"eager"`` (transformers left it unchanged).
        Exception: whatever ``copy.deepcopy`` raises for a module that cannot be copied.
    """
    if not any(hasattr(model, "set_attn_implementation") for model in hf_models(module)):
        return None
    twin = copy.deepcopy(module)
    for model in hf_models(twin):
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation("eager")
            if getattr(model.config, "_attn_implementation", None) != "eager":
                raise RuntimeError(f"{type(model).__name__} kept attention implementation "
                                   f"{model.config._attn_implementation!r} after set_attn_implementation('eager')")
    return twin


def export_for_fusions(module: torch.nn.Module, graph, path: Path, *, fusions: str | None, use_dynamo: bool,
                       opset_version: int | None, device: torch.device) -> OnnxExport:
    """The ONNX file the ONNX Runtime backend builds from (:func:`~aitune.torch.backend.onnx_file_io.onnx_for_backend`);
    with ``fusions`` set and a Hugging Face model in ``module``, the export of an eager-attention copy
    (:func:`eager_attention_copy`) with the TorchScript exporter, which ONNX Runtime's optimizer fuses into
    ``Attention`` nodes (NOTE [what attention fusion needs]).

    The copy costs as much memory again as the module's parameters while it is exported; it is dropped right
    after. When copying or that export fails, the module is exported as without ``fusions`` and the export's
    notes (``build_info["export_notes"]``) say why. The module itself, its attention implementation included,
    is not changed. The value check compares the built graph against the module as it is.

    Raises:
        what :func:`~aitune.torch.backend.onnx_file_io.onnx_for_backend` raises for the plain export.
    """
    if fusions and not isinstance(module, OnnxModule):
        export, failure = _eager_attention_export(module, graph, path, fusions, opset_version, device)
        gc.collect()  # the copy's parameters (and, after a failure, the frames that held it), before what follows
        if export is not None:
            return export
        if failure is not None:
            export = onnx_for_backend(module, graph, path, use_dynamo=use_dynamo, opset_version=opset_version,
                                      device=device)
            export.notes.append(f"eager-attention export for ONNX Runtime's attention fusion failed ({failure}); "
                                "exported the module as it is")
            return export
    return onnx_for_backend(module, graph, path, use_dynamo=use_dynamo, opset_version=opset_version, device=device)


def _eager_attention_export(module, graph, path: Path, fusions: str, opset_version: int | None,
                            device: torch.device) -> tuple[OnnxExport | None, str | None]:
    """(the export of an eager-attention copy, None), (None, why it failed), or (None, None) when ``module`` holds
    no Hugging Face model. The copy and any traceback that holds it are gone once this returns. The traced size
    branch of ``prepare_padding_mask`` is allowed for ``"bert"`` (encoders) only: with a key/value cache (gpt2, t5,
    bart) its padding is real."""
    try:
        twin = eager_attention_copy(module)
        if twin is None:
            return None, None
        allowed = TRANSFORMERS_SHAPE_ONLY_BRANCHES if fusions == "bert" else frozenset()
        export = export_onnx(twin, graph, path, use_dynamo=False, opset_version=opset_version, device=device,
                             shape_only_branches=allowed)
    except Exception as exc:  # noqa: BLE001 - the caller exports the module as it is; the note says why
        logger.debug("onnxruntime: eager-attention export failed", exc_info=True)
        return None, one_line(exc, 240)
    export.notes.append("exported a copy with eager attention, TorchScript exporter (for ONNX Runtime's attention "
                        "fusion)")
    return export, None
