"""Where the wrapped module's time goes over the chosen backend called directly, on the GPU (issue "Search":
the wrapped module within 3 % of the chosen backend). ResNet-50 b1 fp16 (BatchNorm calibrated), one backend
(Inductor reduce-overhead + freezing, which bakes the weights in, so the stale-weight watch runs per call).

Times, A/B/A/B in one process with CUDA events (p50 over 2 s each), then each of the wrapped module, the module
without its watch and the compiled callable against the backend's ``run`` alternating call by call (the figure to
quote on a machine whose speed drifts: the median per-pair ratio): the wrapped module (guard on), the
wrapped module with the guard off, the same with its stale-weight watch detached, the backend's ``run`` and
the compiled callable; the host time of each call until it returns (GPU idle before each call); and the host cost of
one stale-weight check (``StateWatch.changed``) and of the freezing flag set/restore, with perf_counter. Also
``module_early_state``: the wrapped module with its module-state check moved back before the launch (NOTE [module
check after launch] in aitune/torch/dispatch.py switched off per call; the switch's ~0.3 µs counts against it),
paired call by call against the wrapped module as it is.

Usage (device tool, repo root)::

    python3 -m benchmarks.gpu_wrapper_cost --json $OUT/wrapper_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import aitune.torch as ait
from aitune.torch.backend import TorchInductorJitBackend, TorchInductorJitBackendConfig
from aitune.torch.backend.compile_settings import parameter_freezing
from aitune.torch.check.guard import GuardConfig, StateWatch
from benchmarks.gpu_search import p50_ms, paired_p50_ms, resnet50


def host_us(function, n: int = 5000) -> float:
    function()
    started = time.perf_counter()
    for _ in range(n):
        function()
    return (time.perf_counter() - started) / n * 1e6


def host_launch_us(function, n: int = 300) -> float:
    """p50 of the host time from a call to its return, with the GPU synchronised (idle) before each call."""
    times = []
    with torch.no_grad():
        for _ in range(n):
            torch.cuda.synchronize()
            started = time.perf_counter()
            function()
            times.append((time.perf_counter() - started) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--freezing", type=int, default=1)
    parser.add_argument("--profile", action="store_true",
                        help="print cProfile's top functions (own time) of 2000 calls of each path, GPU idle before each")
    args = parser.parse_args(argv)
    torch.backends.cudnn.benchmark = True
    model, inputs = resnet50(1)
    config = TorchInductorJitBackendConfig(mode="reduce-overhead", freezing=bool(args.freezing))
    modules = {}
    for label, guard in (("module", None), ("module_guard_off", GuardConfig(enabled=False))):
        strategy = ait.OneBackendStrategy(TorchInductorJitBackend(config)).enable_performance_validation(False)
        wrapped = ait.Module(model, f"wc-{label}", strategy=strategy, guard=guard)
        ait.tune(lambda item, wrapped=wrapped: wrapped(**item), [inputs], progress=False, ready_batches=True)
        modules[label] = wrapped
    backend = modules["module"].backends["graph0"]
    kwargs = backend.graph.signature.normalize((), inputs)[1]
    compiled = backend._compiled
    freezing = parameter_freezing(bool(args.freezing))

    def raw():
        torch.compiler.cudagraph_mark_step_begin()
        with freezing:
            return compiled(**kwargs)

    no_watch = modules["module_guard_off"]

    def module_no_watch():  # the guard-off module with its stale-weight watch detached for the call
        watch, no_watch._self_dispatch.watch = no_watch._self_dispatch.watch, None
        try:
            return no_watch(**inputs)
        finally:
            no_watch._self_dispatch.watch = watch

    early = modules["module"]._self_dispatch.graphs

    late = [tuned.late_state for tuned in early]

    def module_early_state():  # the module check before the launch (NOTE [module check after launch] switched off)
        for tuned in early:
            tuned.late_state = False
        try:
            return modules["module"](**inputs)
        finally:
            for tuned, value in zip(early, late):
                tuned.late_state = value

    calls = {"module": lambda: modules["module"](**inputs), "module_early_state": module_early_state,
             "module_guard_off": lambda: no_watch(**inputs),
             "module_no_watch": module_no_watch,
             "backend_run": lambda: backend.run((), kwargs), "compiled_raw": raw}
    result = {"freezing": bool(args.freezing)}
    for round_ in range(2):
        for label, call in calls.items():
            result[f"{label}_p50_ms_{round_}"] = p50_ms(call)
    for label in ("module", "module_no_watch", "compiled_raw"):  # each against backend run, call by call alternately
        first, second, ratio = paired_p50_ms(calls[label], calls["backend_run"])
        result[f"paired_{label}_vs_backend_run"] = {"p50_ms": first, "backend_run_p50_ms": second,
                                                    "ratio_p50": ratio}
    first, second, ratio = paired_p50_ms(calls["module_early_state"], calls["module"])
    result["paired_module_early_state_vs_module"] = {"p50_ms": first, "module_p50_ms": second, "ratio_p50": ratio}
    for label, call in calls.items():  # host time from the call to its return, the GPU idle before each call
        result[f"{label}_host_launch_us"] = host_launch_us(call)
    watch = StateWatch(model)
    result["state_tensors"] = len(watch.tensors)
    result["statewatch_changed_us"] = host_us(watch.changed)
    result["freezing_flag_us"] = host_us(lambda: freezing.__enter__() or freezing.__exit__(None, None, None))
    with torch.no_grad():
        result["module_host_us"] = host_us(lambda: modules["module"](**inputs), 2000)
        result["backend_run_host_us"] = host_us(lambda: backend.run((), kwargs), 2000)
    result["stats"] = modules["module"].stats
    if args.profile:
        import cProfile
        import pstats

        for label in ("module_no_watch", "backend_run"):
            profile = cProfile.Profile()
            with torch.no_grad():
                for _ in range(2000):
                    torch.cuda.synchronize()
                    profile.enable()
                    calls[label]()
                    profile.disable()
            print(f"## cProfile, {label}, 2000 calls")
            pstats.Stats(profile).sort_stats("tottime").print_stats(22)
    print(json.dumps(result, indent=1, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
