"""Host µs per call of the stale-weight watch (``StateWatch.changed``): the native reader against the Python path,
side by side in one process (NOTE [native watch] in aitune/torch/check/native_watch.py).

Two watches on the same model, one with the native reader and one without, timed in interleaved rounds of
``--calls`` calls each (``perf_counter_ns`` around each call); medians over every call of every round. The model is
torchvision's ResNet-50 (320 parameters and buffers; without torchvision, 53 convolutions with BatchNorm and a
head: the same 320 tensors) or a small MLP (4), on the CPU or CUDA (the watch reads host
memory only: the device does not matter beyond the tensors' facts).

    PYTHONPATH=. python -m benchmarks.state_watch_cost [--model resnet50|mlp] [--device cpu|cuda] [--finite]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from aitune.torch.check import native_watch
from aitune.torch.check.guard import StateWatch


def model_of(name: str, device: str) -> torch.nn.Module:
    if name == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    else:
        try:
            import torchvision

            model = torchvision.models.resnet50()
        except ImportError:  # the same 320 tensors: 53 convolutions with BatchNorm (2 parameters, 3 buffers), a head
            model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Conv2d(8, 8, 1, bias=False),
                                                              torch.nn.BatchNorm2d(8)) for _ in range(53)),
                                        torch.nn.Flatten(), torch.nn.Linear(8, 8))
    return model.to(device).eval()


def finite_check_costs(rounds: int) -> None:
    """The value gate's nan/inf check of a CPU float32 input: the extension's loop against torch's reduction (a sum
    and its read), per input size, interleaved; where the loop stops paying is ``ALL_FINITE_MAX_ELEMENTS``."""
    from aitune.torch.backend.accepted import _non_finite

    module = native_watch.native_module()
    if module is None:
        print("the native extension is not in use here: nothing to compare")
        return
    print(f"nan/inf check of a CPU float32 input, µs per call (median of {rounds} rounds, interleaved; "
          f"{torch.get_num_threads()} threads); the gate uses the loop up to {native_watch.ALL_FINITE_MAX_ELEMENTS}")
    for elements in (256, 4096, 16384, 65536, 3 * 224 * 224, 1 << 20):
        tensor = torch.randn(elements)
        calls = max(20, 200_000 // elements)
        paths = {"native loop": lambda: module.all_finite(tensor), "torch": lambda: _non_finite(tensor)}
        times: dict[str, list[float]] = {label: [] for label in paths}
        for _ in range(rounds):
            for label, path in paths.items():
                started = time.perf_counter_ns()
                for _ in range(calls):
                    path()
                times[label].append((time.perf_counter_ns() - started) / 1000 / calls)
        native, reduction = (statistics.median(times[label]) for label in paths)
        print(f"  {elements:8d} elements: native loop {native:8.2f}   torch {reduction:8.2f}   "
              f"torch / native {reduction / native:5.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50", choices=("resnet50", "mlp"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--finite", action="store_true", help="also the value gate's nan/inf check, per input size")
    args = parser.parse_args()
    model = model_of(args.model, args.device)
    print(f"torch {torch.__version__}; native watch: {native_watch.native_status()}")
    native = StateWatch(model)
    python = StateWatch(model)
    python.reader = None  # the Python path, as where the extension is unavailable
    watches = {"native": native, "python": python}
    if native.reader is None:
        print("the native reader is not in use here: only the Python path is timed")
        del watches["native"]
    samples: dict[str, list[float]] = {label: [] for label in watches}
    clock = time.perf_counter_ns
    for watch in watches.values():
        for _ in range(200):
            assert watch.changed() is None
    for round_ in range(args.rounds):
        labels = list(watches)[round_ % len(watches):] + list(watches)[:round_ % len(watches)]
        for label in labels:
            changed, times = watches[label].changed, samples[label]
            for _ in range(args.calls):
                started = clock()
                changed()
                times.append((clock() - started) / 1000)
    tensors = len(native.tensors)
    print(f"{args.model} on {args.device}: {tensors} parameters and buffers; host µs per StateWatch.changed call "
          f"(median of {args.rounds} x {args.calls}, interleaved)")
    medians = {label: statistics.median(times) for label, times in samples.items()}
    for label, median in medians.items():
        print(f"  {label:7s} {median:8.2f} µs   ({median * 1000 / max(tensors, 1):6.1f} ns per tensor)")
    if len(medians) == 2:
        print(f"  python / native: {medians['python'] / medians['native']:.1f}x")
    if args.finite:
        finite_check_costs(args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
