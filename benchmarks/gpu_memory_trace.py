"""Where the tuning peak GPU memory goes: one default tune with PyTorch's allocator
history recorded, then the blocks alive at the trace's highest point grouped by where they were allocated
(top two frames and the first aitune frames), and each candidate row's device peak and what it kept.

The AOTInductor candidate is left out (its package load crashes on the lent H200 and costs a minute; the other
default candidates are as ``ait.tune`` picks them). The trace starts after the model is built, so its figure is
over what was allocated then (the weights and the inputs): compare the rows and the report's peak, which count
everything.

Usage (device tool, repo root, wheels carried in .whl/)::

    python3 -m benchmarks.gpu_memory_trace resnet50      # or bert-base
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch

import aitune.torch as ait
from aitune.torch.backend import TorchInductorAotBackend
from benchmarks.gpu_search import bert_base, p50_ms, resnet50

GiB, MiB = 2**30, 2**20


class WithoutAot(ait.MaxThroughputStrategy):
    """The default candidates less TorchInductorAotBackend."""

    def candidates(self, device, module=None, graph=None):
        return [b for b in super().candidates(device, module, graph) if not isinstance(b, TorchInductorAotBackend)]


def live_at_peak(trace: list[dict]) -> tuple[int, dict]:
    """The highest total of the recorded allocations and the blocks alive then (address -> alloc event)."""
    live, total, best, best_index = {}, 0, 0, -1
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > best:
                best, best_index = total, index
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
    live = {}
    for event in trace[:best_index + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    return best, live


def where(event: dict) -> str:
    frames = [f for f in event.get("frames", []) if f["filename"].endswith(".py")]
    ours = [f"{f['filename'].split('/aitune/')[-1]}:{f['line']} {f['name']}" for f in frames if "/aitune/" in f["filename"]]
    top = [f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}" for f in frames[:2]]
    return " | ".join(top + ours[:3])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=["resnet50", "bert-base"])
    parser.add_argument("--batch", type=int)
    args = parser.parse_args(argv)
    torch.backends.cudnn.benchmark = True
    if args.model == "resnet50":
        model, inputs = resnet50(args.batch or 1)
    else:
        model, inputs = bert_base(args.batch or 32)
    torch.cuda.reset_peak_memory_stats()
    p50_ms(lambda: model(**inputs), seconds=0.5)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"eager inference peak {torch.cuda.max_memory_allocated() / GiB:.3f} GiB (weights {weights / GiB:.3f} GiB)")
    wrapped = ait.Module(model, args.model, strategy=WithoutAot())
    torch.cuda.memory._record_memory_history(max_entries=4_000_000)
    report = ait.tune(lambda item: wrapped(**item), [inputs], progress=False, ready_batches=True)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    print(f"tuning peak (report) {report.peak_memory['device_bytes'] / GiB:.3f} GiB")
    for row in report.rows:
        if row.details.get("device_peak_bytes") is not None:
            print(f"  {row.description[:60]:60s} {row.status[:10]:10s} peak {row.details['device_peak_bytes'] / GiB:.3f}"
                  f" kept {row.details['device_retained_bytes'] / GiB:.3f} GiB")
    best, live = live_at_peak(snapshot["device_traces"][0])
    print(f"trace's highest point {best / GiB:.3f} GiB over what was allocated before; blocks alive then by origin:")
    groups = collections.Counter()
    for event in live.values():
        groups[where(event)] += event["size"]
    for origin, size in groups.most_common(10):
        print(f"{size / MiB:8.1f} MiB  {origin}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
