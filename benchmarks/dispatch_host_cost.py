"""The tuned module's own host time per call, without a backend's time in the way: a CPU stand-in for issue 27's
GPU measurement (ResNet-50 b1 served by a CUDA-graph replay, whose host time is a few tens of µs).

A ResNet-50-sized module (transformers' ``ResNetModel`` from its default config, random weights: 282
submodules, 318 parameters and buffers, the counts the per-call checks walk) is tuned with one backend that
stands for a baked artifact (``StoredOutput``: bakes the weights and the module in, runs its own copy, like
Inductor JIT with freezing and channels-last captured in CUDA graphs) whose ``run`` returns the output eager
gave at build. ``tuned - run`` is then the dispatch's whole host cost per call: the route, the checks before
the launch, the weight watch and the module check after it, the guard's bookkeeping. Timed call by call
(``perf_counter_ns``) in interleaved rounds, p50 over all rounds; ``--stages N`` adds the stage-by-stage view
(``benchmarks/dispatch_stages.py``).

The model's input is on the CPU, where the value gate would read it for nan/inf (~15 µs for its 150528 elements,
torch's multi-threaded reduction, and noisy); on a GPU route it is skipped (the route holds no CPU tensor), and so
it is here unless ``--value-gate`` is given.

``--flush MB`` writes an MB-sized buffer before every timed call of both paths (untimed), evicting the caches as a
CUDA-graph launch's driver work and the wait for the GPU do between a served GPU call and the next: the dispatch's
reads (the weight watch's walk over every parameter and buffer above all) then miss the caches, as on the GPU host.

Usage (repo root)::

    PYTHONPATH=. python -m benchmarks.dispatch_host_cost --rounds 5 --calls 2000 --stages 5000
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import aitune.torch as ait
from aitune.torch.backend.eager import TorchEagerBackend
from benchmarks.dispatch_stages import print_stages, stages


class StoredOutput(TorchEagerBackend):
    """Stands for a baked artifact whose launch costs nothing: for the input the benchmark times (set as
    ``timed``), the output eager gave for it; for any other (the tune's checks), eager's."""

    name = "stored_output"
    passthrough = False

    @property
    def bakes_weights(self) -> bool:
        return True

    @property
    def bakes_module_state(self) -> bool:
        return True

    @property
    def runs_own_copy(self) -> bool:
        return True

    timed: torch.Tensor | None = None
    _output = None

    def time_with(self, x: torch.Tensor) -> None:
        with torch.no_grad():
            self._output = self._callable(x)
        self.timed = x

    def _infer(self, args, kwargs):
        if self.timed is not None and [*args, *kwargs.values()][0] is self.timed:
            return self._output
        return super()._infer(args, kwargs)


def resnet50() -> tuple[torch.nn.Module, torch.Tensor]:
    from transformers import ResNetConfig, ResNetModel

    torch.manual_seed(0)
    return ResNetModel(ResNetConfig()).eval(), torch.randn(1, 3, 224, 224)


class Plain(torch.nn.Module):
    """The model's output as a plain tensor (a ModelOutput is a dict the guard compares field by field)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values).pooler_output


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per path per round")
    parser.add_argument("--stages", type=int, default=0, metavar="CALLS")
    parser.add_argument("--value-gate", action="store_true", help="keep the value gate's read of the CPU input")
    parser.add_argument("--flush", type=float, default=0.0, metavar="MB",
                        help="write a buffer of MB megabytes before every timed call (untimed): cold caches")
    args = parser.parse_args(argv)
    model, x = resnet50()
    model = Plain(model).eval()
    strategy = ait.OneBackendStrategy(StoredOutput()).enable_performance_validation(False)
    tuned = ait.Module(model, "dispatch-host-cost", strategy=strategy)
    ait.tune(lambda batch: tuned(batch), [x], ready_batches=True, progress=False)
    backend = tuned.backends["graph0"]
    backend.time_with(x)
    if not args.value_gate:  # as on a GPU route, which holds no CPU tensor (NOTE [value gate])
        for graph in tuned._self_dispatch.graphs:
            graph.values = None
    canonical = tuned._self_dispatch.signature.normalize((x,), {})
    paths = {"tuned": lambda: tuned(x), "run": lambda: backend.run(*canonical, accepted=True)}
    samples: dict[str, list[float]] = {path: [] for path in paths}
    flush = torch.zeros(int(args.flush * 1e6) // 4) if args.flush else None
    if flush is not None:  # the timed calls run no torch op; one thread writes the buffer, so the calling core's own
        torch.set_num_threads(1)  # caches are evicted on a host of many cores too
    clock = time.perf_counter_ns
    with torch.no_grad():
        for _ in range(200):
            for call in paths.values():
                call()
        for index in range(args.rounds):
            order = list(paths.items())
            order = order[index % len(order):] + order[:index % len(order)]
            for path, call in order:
                values = samples[path]
                for _ in range(args.calls):
                    if flush is not None:
                        flush.add_(1.0)
                    started = clock()
                    call()
                    values.append((clock() - started) / 1e3)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    tuned_p50, run_p50 = statistics.median(samples["tuned"]), statistics.median(samples["run"])
    per_round = [round(statistics.median(samples["tuned"][i:i + args.calls])
                       - statistics.median(samples["run"][i:i + args.calls]), 2)
                 for i in range(0, len(samples["tuned"]), args.calls)]
    gate = "with" if args.value_gate else "without"
    cold = f", a {args.flush:g} MB buffer written before each call" if flush is not None else ""
    print(f"# ResNet-50-sized module on the CPU ({gate} the value gate{cold}), torch {torch.__version__}, load {load}; "
          "host µs per call, p50")
    print(f"tuned {tuned_p50:.2f}   run {run_p50:.2f}   tuned - run {tuned_p50 - run_p50:.2f}   per round {per_round}"
          f"   served by the backend: {tuned.backend_calls}   guard: {tuned.stats['guard'].get('graph0')}")
    if args.stages:
        print_stages("ResNet-50-sized module, StoredOutput; medians over the calls",
                     stages(tuned, backend, lambda: tuned(x), args.stages, median=True,
                            before=(lambda: flush.add_(1.0)) if flush is not None else None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
