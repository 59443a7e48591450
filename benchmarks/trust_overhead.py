"""What trust costs: probes at tuning time, the run-time guard and the stale-weight watch per call (CPU).

Measured side by side in one process:

1. MiniLM sentence encoder, batch 8 x 128: the same forced candidate tuned with probes off and on; the
   extra tuning time is the difference (and the number of probes checked).
2. Per call, MiniLM 8 x 128: the tuned module with the default guard vs the guard off vs the chosen backend
   called directly (median ms), for a JIT backend (guard only) and a weight-baking one (guard + state watch).
3. Per call, a tiny module (backend time ~ nothing): the same three, in µs — the wrapper's own cost.

    python -m benchmarks.trust_overhead [--backend onnxruntime]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import aitune.torch as ait
from aitune.torch.backend import get_backend_class
from aitune.torch.measure.profiling import ProfilingConfig

PROFILING = ProfilingConfig(time_budget_s=0.5)


def interleaved_medians(functions: list, calls: int, warmup: int, rounds: int = 10) -> list[float]:
    """Median ms per call of each function, measured in ``rounds`` alternating blocks (A B C A B C ...) so that
    a change in machine load (2 shared cores) hits every variant alike."""
    for function in functions:
        for _ in range(warmup):
            function()
    samples: list[list[int]] = [[] for _ in functions]
    per_round = max(1, calls // rounds)
    for _ in range(rounds):
        for function, kept in zip(functions, samples):
            for _ in range(per_round):
                started = time.perf_counter_ns()
                function()
                kept.append(time.perf_counter_ns() - started)
    return [statistics.median(kept) / 1e6 for kept in samples]


def tune(model, backend_name: str, data, name: str, probes: bool, guard=None):
    strategy = ait.OneBackendStrategy(get_backend_class(backend_name)(), profiling_config=PROFILING,
                                      probe_config=ait.ProbeConfig(enabled=probes))
    tuned = ait.Module(model, name, strategy=strategy.enable_performance_validation(False), guard=guard)
    started = time.perf_counter()
    report = ait.tune(lambda batch: tuned(**batch), data, ignore_failing_modules=False, ready_batches=True)
    return tuned, time.perf_counter() - started, report.rows[0]


def per_call(model, backend_name, data, call, calls, warmup, unit):
    guarded, _, _ = tune(model, backend_name, data, "guarded", probes=False)
    unguarded, _, _ = tune(model, backend_name, data, "unguarded", probes=False,
                           guard=ait.GuardConfig(enabled=False))
    backend = guarded.backends["graph0"]
    kwargs = backend.graph.signature.normalize((), call)[1]
    with torch.no_grad():
        direct, off, on = interleaved_medians(
            [lambda: backend.run((), kwargs), lambda: unguarded(**call), lambda: guarded(**call)], calls, warmup)
    scale = 1000.0 if unit == "µs" else 1.0
    stats = guarded.stats["guard"].get("graph0", {"checks": 0, "calls": 0, "check_every": "-"})
    print(f"  {backend_name:12s} direct {direct * scale:8.3f} {unit}  guard off {off * scale:8.3f} {unit}  "
          f"guard on {on * scale:8.3f} {unit}  (guard adds {(on - off) * scale:+.3f} {unit}; wrapper total "
          f"{(on - direct) * scale:+.3f} {unit}; checks {stats['checks']}/{stats['calls']}, one in "
          f"{stats['check_every']}; watches weights: {backend.bakes_weights})")


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, input_ids, attention_mask=None):
        return self.fc(input_ids * attention_mask)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="onnxruntime", help="the weight-baking backend to measure")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    from benchmarks.harness import minilm

    model, inputs = minilm("cpu", torch.float32, 8, 128)
    data = [inputs]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, MiniLM 8 x 128 (CPU)")
    print("1. tuning time, probes off vs on (same forced candidate):")
    for backend_name in ("inductor_jit", args.backend):
        tune(model, backend_name, data, "warm_up", probes=False)  # compiler caches warm for both timed runs
        _, off_s, _ = tune(model, backend_name, data, "probes_off", probes=False)
        _, on_s, row = tune(model, backend_name, data, "probes_on", probes=True)
        print(f"  {backend_name:12s} probes off {off_s:6.1f} s   on {on_s:6.1f} s   extra {on_s - off_s:+6.1f} s "
              f"({row.probes['checked']} probes checked, kinds {', '.join(row.probes['kinds'])}; status {row.status})")
    print("2. per call, MiniLM 8 x 128 (median of 40, interleaved):")
    for backend_name in ("inductor_jit", args.backend):
        per_call(model, backend_name, data, inputs, calls=40, warmup=5, unit="ms")
    print("3. per call, tiny module (median of 20000, interleaved):")
    tiny = Tiny().eval()
    call = {"input_ids": torch.randn(4, 8), "attention_mask": torch.ones(4, 8)}
    for backend_name in ("eager", "inductor_jit", args.backend):
        per_call(tiny, backend_name, [call], call, calls=20000, warmup=500, unit="µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
