"""CUDA graphs on the eager backend: latency with vs without graphs, ResNet-50 and BERT-base, fp16, batch 1.

Run on a CUDA machine with torchvision and transformers (random weights, nothing downloaded):

    python benchmarks/cuda_graphs_eager.py [--iterations 300] [--json OUT.json]

Both variants are the same :class:`TorchEagerBackend` built by aitune, one with
``use_cuda_graphs=True``; they are timed alternately in one process with CUDA events (median of
``--iterations`` calls after a warm-up), and the graph variant's outputs are checked against eager.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aitune.torch.backend import TorchEagerBackend, TorchEagerBackendConfig  # noqa: E402
from aitune.torch.record.samples import record_graphs  # noqa: E402


def resnet50():
    import torchvision

    model = torchvision.models.resnet50(weights=None).cuda().half().eval()
    return "ResNet-50", model, ((torch.randn(1, 3, 224, 224, device="cuda", dtype=torch.half),), {})


def bert_base():
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig()).cuda().half().eval()  # bert-base sizes: 12 layers, 768 hidden
    ids = torch.randint(0, 30522, (1, 128), device="cuda")
    return "BERT-base (seq 128)", model, ((), {"input_ids": ids, "attention_mask": torch.ones_like(ids)})


def time_call(function, iterations: int) -> list[float]:
    timings = []
    for _ in range(iterations):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        end.record()
        end.synchronize()
        timings.append(start.elapsed_time(end))
    return timings


def first_tensor(output):
    if isinstance(output, torch.Tensor):
        return output
    return output[0] if isinstance(output, (tuple, list)) else output["last_hidden_state"]


def bench(factory, iterations: int) -> dict:
    name, model, (args, kwargs) = factory()
    graph = record_graphs(model, [(args, kwargs)])[0]
    with tempfile.TemporaryDirectory() as workdir:
        plain = TorchEagerBackend().build(model, graph, "cuda", Path(workdir) / "plain")
        graphs = TorchEagerBackend(TorchEagerBackendConfig(use_cuda_graphs=True)).build(
            model, graph, "cuda", Path(workdir) / "graphs")
        for _ in range(20):  # warm-up, and the first call of graphs captures
            plain(*args, **kwargs)
            graphs(*args, **kwargs)
        torch.cuda.synchronize()
        with torch.no_grad():
            error = (first_tensor(graphs(*args, **kwargs)).float() - first_tensor(plain(*args, **kwargs)).float()).abs().max()
        plain_ms, graph_ms = [], []
        for _ in range(3):  # alternate to share clock/thermal drift
            plain_ms += time_call(lambda: plain(*args, **kwargs), iterations // 3)
            graph_ms += time_call(lambda: graphs(*args, **kwargs), iterations // 3)
        stats = dict(graphs._graphs.stats)
    plain_median, graph_median = statistics.median(plain_ms), statistics.median(graph_ms)
    return {"model": name, "dtype": "fp16", "batch": 1, "eager_ms": round(plain_median, 4),
            "eager_cuda_graphs_ms": round(graph_median, 4), "speedup": round(plain_median / graph_median, 2),
            "max_abs_diff": float(error), "graph_stats": stats, "timed_calls": len(plain_ms)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    rows = [bench(factory, args.iterations) for factory in (resnet50, bert_base)]
    device = torch.cuda.get_device_name()
    print(f"device: {device}, torch {torch.__version__}")
    print("| model | dtype | batch | eager median ms | eager + CUDA graphs median ms | speed-up | max abs diff |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['model']} | {row['dtype']} | {row['batch']} | {row['eager_ms']:.3f} | "
              f"{row['eager_cuda_graphs_ms']:.3f} | {row['speedup']:.2f}x | {row['max_abs_diff']:.2e} |")
    if args.json:
        args.json.write_text(json.dumps({"device": device, "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
