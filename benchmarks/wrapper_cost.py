"""Host time per call of a tuned ``ait.Module`` against the chosen backend, its compiled callable and a
hand-picked ``torch.compile`` of the same model, side by side in one process.

Paths, timed call by call (``perf_counter_ns``), interleaved in rounds (each round times every path in turn,
the order rotating), median and p90 over all rounds:

- ``tuned``: the tuned module, as users call it;
- ``backend_run``: the chosen backend's ``run`` on the normalised call (what the module dispatches to);
- ``direct``: the backend's compiled callable called directly (under ``no_grad`` and, for a frozen build,
  the freezing flag, as ``run`` calls it; no output copy, no CUDA-graph step marker), with the call in the
  canonical form the backend was built and warmed up on (keyword arguments: ``input=x`` for ``nn.Sequential``).
  Dynamo keys a compiled entry on how the frame's arguments arrive, so ``compiled(x)`` would compile and time
  another entry (~2 µs cheaper per call on this project's CPU): the hand-picked compile below is called that way;
- ``torch_compile``: a hand-picked ``torch.compile`` of the same module (CPU: default mode; CUDA:
  ``reduce-overhead``), called the same way as the tuned module;

and ``tuned - direct``, the dispatch's own cost (budget: <= 15 µs). On CUDA with CUDA graphs also
``direct+copy``: the compiled callable plus the output copy that keeps its outputs from being overwritten by
the next replay (what ``run`` adds). Means are printed too: the tuned module's includes the run-time guard's
periodic checks against eager (one call in N re-runs eager and compares), which the median leaves out. Each backend configuration
is timed with grad mode off (``torch.no_grad()``) and on; with grad on, the parameters are frozen
(``requires_grad_(False)``) — with parameters that require grad the tuned module runs eager by design.

On CUDA the GPU is synchronised (idle) before every timed call and the time is until the call returns:
the host cost to launch it, which a CUDA-graph replay does not hide.

Usage (repo root)::

    PYTHONPATH=. python -m benchmarks.wrapper_cost                      # small MLP, CPU, fp32
    PYTHONPATH=. python -m benchmarks.wrapper_cost --profile            # + cProfile of the tuned path
    PYTHONPATH=. python -m benchmarks.wrapper_cost --stages 2000        # + host µs stage by stage
    python3 -m benchmarks.wrapper_cost --device cuda --model resnet50   # ResNet-50 b1 fp16 (GPU machine)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import aitune.torch as ait
from aitune.torch.backend import TorchInductorJitBackend, TorchInductorJitBackendConfig
from aitune.torch.backend.compile_settings import parameter_freezing
from aitune.torch.backend.inductor_jit import clone_output, uses_cuda_graphs
from benchmarks.dispatch_stages import print_stages, profile_calls, stages


def small_mlp(device: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    return model.to(device).eval(), torch.randn(4, 64, device=device)


def resnet50(device: str, batch: int = 1, dtype: torch.dtype = torch.float16):
    """torchvision's ResNet-50 (random weights) with BatchNorm statistics calibrated on a few random batches in
    train mode (random init leaves mean 0 / variance 1 and fp16 activations then explode)."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50().to(device).to(dtype)
    model.train()
    with torch.no_grad():
        for _ in range(8):
            model(torch.randn(32, 3, 224, 224, device=device, dtype=dtype))
    return model.eval(), torch.randn(batch, 3, 224, 224, device=device, dtype=dtype)


def configs(device: str) -> dict[str, TorchInductorJitBackendConfig]:
    if device == "cuda":
        return {"reduce-overhead+freezing": TorchInductorJitBackendConfig(mode="reduce-overhead", freezing=True),
                "reduce-overhead": TorchInductorJitBackendConfig(mode="reduce-overhead"),
                "captured+freezing+cl": TorchInductorJitBackendConfig(capture_cuda_graphs=True, freezing=True,
                                                                      fullgraph=True, memory_format="channels_last")}
    return {"default": TorchInductorJitBackendConfig(), "freezing": TorchInductorJitBackendConfig(freezing=True)}


def timed_rounds(paths: dict, rounds: int, calls: int, cuda: bool,
                 contexts: dict | None = None) -> dict[str, list[float]]:
    """Per-call host µs of every path, interleaved: each round times ``calls`` calls of each path in turn (round
    ``r``'s are ``samples[label][r * calls:(r + 1) * calls]``). ``contexts``: label -> a function giving a context
    entered around that path's calls (its warm-up and each round's), outside the timed calls."""
    samples = {label: [] for label in paths}
    labels = list(paths)
    contexts = contexts or {}
    for label, function in paths.items():  # warm-up
        with contexts.get(label, contextlib.nullcontext)():
            for _ in range(50):
                function()
    clock = time.perf_counter_ns
    for round_ in range(rounds):
        order = labels[round_ % len(labels):] + labels[:round_ % len(labels)]
        for label in order:
            function, times = paths[label], samples[label]
            with contexts.get(label, contextlib.nullcontext)():
                for _ in range(calls):
                    if cuda:
                        torch.cuda.synchronize()
                    started = clock()
                    function()
                    times.append((clock() - started) / 1000)
    if cuda:
        torch.cuda.synchronize()
    return samples


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1]


def measure(label: str, config, model, x, args) -> list[dict]:
    device = x.device.type
    cuda = device == "cuda"
    strategy = ait.OneBackendStrategy(TorchInductorJitBackend(config)).enable_performance_validation(False)
    tuned = ait.Module(model, f"wrapper-cost-{label}", strategy=strategy)
    started = time.perf_counter()
    ait.tune(lambda batch: tuned(batch), [x], ready_batches=True, progress=False)
    print(f"  {label}: tuned in {time.perf_counter() - started:.1f} s", flush=True)
    backend = tuned.backends["graph0"]
    compiled = backend._compiled
    freezing = parameter_freezing(config.freezing)
    mode = "reduce-overhead" if cuda else None
    hand_picked = torch.compile(copy.deepcopy(model), mode=mode)

    graphs = uses_cuda_graphs(config.mode, config.options)

    canonical_args, canonical_kwargs = tuned._self_dispatch.signature.normalize((x,), {})

    def direct():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad(), freezing:
            return compiled(*canonical_args, **canonical_kwargs)

    paths = {"tuned": lambda: tuned(x), "backend_run": lambda: backend.run(canonical_args, canonical_kwargs),
             "direct": direct,
             "torch_compile": lambda: hand_picked(x)}
    if graphs:  # the output copy that protects CUDA-graph outputs from the next replay, on its own
        paths["direct+copy"] = lambda: clone_output(direct())
    rows = []
    for grad in args.grad:
        frozen = [p for p in model.parameters() if p.requires_grad] if grad else []
        for parameter in frozen:
            parameter.requires_grad_(False)
        try:
            with torch.set_grad_enabled(grad):
                before = tuned.backend_calls
                started = time.perf_counter()
                samples = timed_rounds(paths, args.rounds, args.calls, cuda)
                print(f"  {label}, grad {'on' if grad else 'off'}: timed in {time.perf_counter() - started:.1f} s "
                      "(the hand-picked compile's first calls included)", flush=True)
                served = tuned.backend_calls - before
                with torch.no_grad():
                    difference = float((tuned(x).float() - model(x).float()).abs().max())
        finally:
            for parameter in frozen:
                parameter.requires_grad_(True)
        row = {"backend": backend.describe(), "grad": "on (params frozen)" if grad else "no_grad",
               "served_by_backend": served, "max_abs_diff_vs_eager": difference,
               "guard": tuned.stats["guard"].get("graph0")}
        for path, values in samples.items():
            row[f"{path}_p50_us"] = statistics.median(values)
            row[f"{path}_p90_us"] = p90(values)
            row[f"{path}_mean_us"] = statistics.mean(values)
        rounds = [statistics.median(samples["tuned"][i:i + args.calls]) - statistics.median(samples["direct"][i:i + args.calls])
                  for i in range(0, len(samples["tuned"]), args.calls)]
        row["tuned_minus_direct_us"] = row["tuned_p50_us"] - row["direct_p50_us"]
        row["tuned_minus_direct_per_round_us"] = [round(value, 1) for value in rounds]
        rows.append(row)
        print_row(row, time.perf_counter() - started)  # as it is measured: a run cut short keeps it
        if args.profile and not grad:
            profile(tuned, x, cuda)
        if args.stages and not grad:
            print_stages(f"{args.model} on {device}, {label}", stages(tuned, backend, lambda: tuned(x),
                                                                       args.stages, cuda))
            medians = stages(tuned, backend, lambda: tuned(x), args.stages, cuda, median=True)
            print_stages(f"{args.model} on {device}, {label}; medians over the calls", medians)
            if cuda and args.events:
                events(tuned, backend, x, medians.get("before the launch (Dispatch.call entry to backend.run entry)"))
    return rows


def events(tuned, backend, x, before_launch_us: float | None) -> None:
    """CUDA-event ms per call (GPU synchronised after each; ``aitune.torch.measure.profiling.interleaved_round_ms``,
    call by call in alternation) of the tuned module, the backend's ``run`` and the ``run`` after the host spins for
    the dispatch's median time before the launch: where the last matches the tuned module, the host time before the
    launch is the whole gap."""
    from aitune.torch.measure.profiling import ProfilingConfig, interleaved_round_ms

    canonical_args, canonical_kwargs = tuned._self_dispatch.signature.normalize((x,), {})
    spin_ns = int((before_launch_us or 0.0) * 1e3)

    def spun_run():
        until = time.perf_counter_ns() + spin_ns
        while time.perf_counter_ns() < until:
            pass
        return backend.run(canonical_args, canonical_kwargs, accepted=True)

    config = ProfilingConfig(warmup_rounds=30, warmup_s=0.0, min_rounds=200, max_rounds=10**9, time_budget_s=6.0,
                             stable_rel_error=0.0)
    tuned_ms, run_ms, spun_ms = interleaved_round_ms(
        [lambda: tuned(x), lambda: backend.run(canonical_args, canonical_kwargs, accepted=True), spun_run],
        torch.device("cuda"), config)
    ratio = statistics.median(a / b for a, b in zip(tuned_ms, run_ms))
    spun = statistics.median(a / b for a, b in zip(spun_ms, run_ms))
    print(f"## CUDA events, ms per call, p50 of {len(tuned_ms)} rounds: tuned {statistics.median(tuned_ms):.4f}, run "
          f"{statistics.median(run_ms):.4f}, run after a {spin_ns / 1e3:.1f} µs host spin "
          f"{statistics.median(spun_ms):.4f}; per-round ratios to run (median): tuned {ratio:.4f}x, spun {spun:.4f}x")


def profile(tuned, x, cuda: bool, calls: int = 20000) -> None:
    stats = profile_calls(lambda: tuned(x), calls, cuda)
    print(f"## cProfile of {calls} tuned calls (own time)")
    stats.sort_stats("tottime").print_stats(25)
    print("## aitune's functions by cumulative time (where the dispatch's share goes)")
    stats.sort_stats("cumulative").print_stats("aitune", 30)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--model", default="mlp", choices=("mlp", "resnet50"))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=500, help="timed calls per path per round")
    parser.add_argument("--config", action="append", help="only these backend configurations (labels)")
    parser.add_argument("--profile", action="store_true", help="print cProfile's top functions of the tuned path")
    parser.add_argument("--stages", type=int, default=0, metavar="CALLS",
                        help="also time the tuned call's stages over CALLS calls (benchmarks/dispatch_stages.py)")
    parser.add_argument("--grad", default="off,on", help="grad modes to time: off, on or off,on")
    parser.add_argument("--events", action="store_true",
                        help="CUDA only, with --stages: the tuned module, run and run after the dispatch's host time "
                             "before the launch, timed by CUDA events call by call")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    args.grad = [{"off": False, "on": True}[mode] for mode in args.grad.split(",")]
    if args.device == "cuda":
        torch.backends.cudnn.benchmark = True
    model, x = resnet50(args.device) if args.model == "resnet50" else small_mlp(args.device)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    rows = []
    header = f"{'backend':44s} {'grad':18s} " + " ".join(f"{name:>17s}" for name in
                                                       ("tuned", "backend_run", "direct", "torch_compile")) + \
        f" {'tuned-direct':>13s}"
    print(f"# {args.model} on {args.device}, torch {torch.__version__}, load {load}; host µs per call, p50 / p90",
          flush=True)
    print(header, flush=True)
    for label, config in configs(args.device).items():
        if args.config and label not in args.config:
            continue
        if uses_cuda_graphs(config.mode, config.options) and args.device != "cuda":
            continue
        measured = measure(label, config, model, x, args)
        rows.extend(measured)
        if args.json:
            Path(args.json).write_text(json.dumps({"load": load, "rows": rows}, indent=2))
    return 0


def print_row(row: dict, seconds: float) -> None:
    cells = " ".join(f"{row[f'{path}_p50_us']:7.1f} / {row[f'{path}_p90_us']:7.1f}"
                     for path in ("tuned", "backend_run", "direct", "torch_compile"))
    print(f"{row['backend']:44s} {row['grad']:18s} {cells} {row['tuned_minus_direct_us']:13.1f}"
          f"   per round: {row['tuned_minus_direct_per_round_us']}"
          + ("" if row["served_by_backend"] else "   (tuned calls ran eager)"), flush=True)
    extra = f"   direct+copy p50 {row['direct+copy_p50_us']:.1f}" if "direct+copy_p50_us" in row else ""
    guard = row["guard"] or {}
    print(f"    means (µs; the tuned module's includes the run-time guard's periodic checks against eager): tuned "
          f"{row['tuned_mean_us']:7.1f}   direct {row['direct_mean_us']:7.1f}   guard: {guard.get('checks')} checks "
          f"in {guard.get('calls')} calls{extra}   max |tuned - eager| {row['max_abs_diff_vs_eager']:.2g}   "
          f"(configuration measured in {seconds:.0f} s, its tune and compiles included)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
