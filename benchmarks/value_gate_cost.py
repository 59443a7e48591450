"""Host cost per call of aitune's value gate (NOTE [value gate] in aitune/torch/backend/accepted.py).

Times ``ValueGate.rejects`` on ResNet-50-sized (one float32 image batch, 8x3x224x224) and BERT-sized (int64
``input_ids`` and ``attention_mask``, 8x128) inputs, for an ordinary and a quantizing backend, on the CPU
(and on CUDA when present: there each check waits for the device). Prints the median of many calls in µs.

    python benchmarks/value_gate_cost.py
"""

import statistics
import time

import torch

from aitune.torch.backend.accepted import ValueGate
from aitune.torch.record.samples import Recorder


class _Image(torch.nn.Module):
    def forward(self, images):
        return images.mean()


class _Tokens(torch.nn.Module):
    def forward(self, input_ids, attention_mask):
        return input_ids.sum() + attention_mask.sum()


def _median_us(gate: ValueGate, leaves: list, rounds: int = 300) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        assert gate.rejects(leaves) is None
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        images = torch.randn(8, 3, 224, 224, device=device)
        ids = torch.randint(0, 30522, (8, 128), device=device)
        mask = torch.ones(8, 128, dtype=torch.int64, device=device)
        for name, module, call in (("resnet50-sized", _Image(), (images,)), ("bert-sized", _Tokens(), (ids, mask))):
            recorder = Recorder(module)
            with torch.no_grad():
                recorder.record(module, call, {})
            graph = next(iter(recorder.graphs.values()))
            for quantizing in (False, True):
                gate = ValueGate.for_graph(graph, quantizing)
                if gate is None:
                    continue
                print(f"{device:5s} {name:15s} quantizing={quantizing!s:5s} {_median_us(gate, list(call)):8.1f} us")


if __name__ == "__main__":
    main()
