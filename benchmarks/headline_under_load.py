"""How far the report's headline speed-up lands from the truth on a busy machine, in one process.

For a small CNN and a small transformer encoder (random weights, CPU):

1. ``ait.tune`` with Inductor JIT and ONNX Runtime while a second process loads the CPU in bursts (busy for a
   random 20-200 ms, idle for a random 20-200 ms: another job on a shared machine), or without load
   (``--load none``);
2. the load stops; the tuned module and eager are then timed round-robin, one call each per round, and the
   median over rounds of eager's time over the tuned module's is taken: the *re-timed* figure, the truth the
   headline should be near;
3. printed per model: the selected row's headline (``row.speedup``, the paired median, with its quartiles and
   whether it was marked noisy), the ratio of separately timed throughputs the headline used to be (kept in
   the row's measurements), the re-timed figure, headline / re-timed, and the run-time guard's "one call in N".

Usage (repository root)::

    python -m benchmarks.headline_under_load [--load bursty|none] [--json results/headline_under_load.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import tempfile
import time

import torch
import torch.nn as nn

import aitune.torch as ait
from aitune.torch.backend import ONNXRuntimeBackend, TorchInductorJitBackend
from aitune.torch.measure.profiling import ProfilingConfig, interleaved_round_ms, paired_speedup


def burn_in_bursts(stop, seed: int) -> None:
    """Busy for a random 20-200 ms, idle for a random 20-200 ms, until ``stop`` is set."""
    generator = random.Random(seed)
    while not stop.is_set():
        until = time.perf_counter() + generator.uniform(0.02, 0.2)
        value = 0.0
        while time.perf_counter() < until:
            value += 1.0
        time.sleep(generator.uniform(0.02, 0.2))


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        layers, channels = [], 3
        for width in (16, 32, 32):
            layers += [nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
            channels = width
        self.body = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10))

    def forward(self, x):
        return self.body(x)


class SmallEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=256, batch_first=True)
        self.body = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)

    def forward(self, x):
        return self.body(x)


def models():
    torch.manual_seed(0)
    return [("small CNN", SmallCNN().eval(), [torch.randn(b, 3, 32, 32) for b in (4, 8)]),
            ("transformer encoder", SmallEncoder().eval(), [torch.randn(b, 32, 128) for b in (4, 8)])]


def measure_one(name: str, model: nn.Module, batches: list, load: str, retime_s: float) -> dict:
    with tempfile.TemporaryDirectory() as cache:  # the tuned artifacts live there until the re-timing is done
        return _measure_one(name, model, batches, load, retime_s, cache)


def _measure_one(name: str, model: nn.Module, batches: list, load: str, retime_s: float, cache: str) -> dict:
    strategy = ait.MaxThroughputStrategy([TorchInductorJitBackend(), ONNXRuntimeBackend()])
    tuned = ait.Module(model, name.replace(" ", "_"), strategy=strategy)
    stop = multiprocessing.Event()
    burner = None
    if load == "bursty":
        burner = multiprocessing.Process(target=burn_in_bursts, args=(stop, 0), daemon=True)
        burner.start()
    try:
        report = ait.tune(tuned, batches, ready_batches=True, cache_dir_path=cache)
    finally:
        stop.set()
        if burner is not None:
            burner.join()
    row = next(r for r in report.rows if r.status == "selected")
    eager_row = next(r for r in report.rows if r.backend == "eager" and r.description == "TorchEagerBackend()")
    separate = None
    if row.measurement and eager_row.measurement and eager_row.measurement.get("throughput"):
        separate = row.measurement["throughput"] / eager_row.measurement["throughput"]
    x = batches[-1]
    with torch.no_grad():
        eager_ms, tuned_ms = interleaved_round_ms(
            [lambda: model(x), lambda: tuned(x)], torch.device("cpu"),
            ProfilingConfig(min_rounds=20, max_rounds=100000, time_budget_s=retime_s, stable_rel_error=0.0))
    retimed = paired_speedup(eager_ms, tuned_ms).median
    guard = (tuned.stats.get("guard") or {}).get("graph0") or {}
    if tuned.stats.get("eager_fallbacks"):
        raise RuntimeError(f"{name}: the tuned module ran eager during the re-timing: "
                           f"{tuned.stats['eager_fallbacks']}")
    return {"model": name, "selected": row.description, "headline": row.speedup,
            "spread": row.speedup_spread, "separately_timed_ratio": separate, "retimed": retimed,
            "headline_over_retimed": (row.speedup / retimed) if row.speedup else None,
            "guard_check_every": guard.get("check_every"), "rounds_retimed": len(eager_ms)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", choices=["bursty", "none"], default="bursty")
    parser.add_argument("--retime-s", type=float, default=10.0, help="seconds of round-robin re-timing per model")
    parser.add_argument("--json")
    args = parser.parse_args()
    results = [measure_one(name, model, batches, args.load, args.retime_s) for name, model, batches in models()]
    print(f"\n## headline vs re-timed, load={args.load}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| model | selected | headline (quartiles) | separately timed ratio | re-timed, paired | headline / re-timed "
          "| guard: one call in N |")
    print("|---|---|---|---|---|---|---|")
    for result in results:
        spread = result["spread"] or {}
        quartiles = f" ({spread.get('q25', float('nan')):.2f}-{spread.get('q75', float('nan')):.2f})" if spread else ""
        noisy = " noisy" if spread.get("noisy") else ""
        headline = "-" if result["headline"] is None else f"{result['headline']:.2f}x{quartiles}{noisy}"
        separate = "-" if result["separately_timed_ratio"] is None else f"{result['separately_timed_ratio']:.2f}x"
        ratio = "-" if result["headline_over_retimed"] is None else f"{result['headline_over_retimed']:.2f}"
        print(f"| {result['model']} | {result['selected']} | {headline} | {separate} | {result['retimed']:.2f}x "
              f"| {ratio} | {result['guard_check_every']} |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"load": args.load, "torch": torch.__version__, "results": results}, handle, indent=2)


if __name__ == "__main__":
    main()
