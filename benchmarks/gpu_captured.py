"""aitune's own CUDA graphs (``capture_cuda_graphs``, NOTE [captured CUDA graphs]) against reduce-overhead, on the
GPU, side by side in one process, for graphs without a cache (``CUDAGraphRunner``). The targets it checks: ResNet-50
b1 >= 1.25x hand-picked reduce-overhead and >= 1.0x the hand-picked composite; BERT-base b32 >= 1.05x hand-picked
reduce-overhead; the wrapper within 3 % and 15 µs of its backend.

One model (``benchmarks/gpu_search.py``'s: random weights, a convnet's BatchNorm statistics calibrated), then:

1. the hand-picked anchors: ``torch.compile(mode="reduce-overhead")`` and the composite (reduce-overhead + freezing,
   + channels-last for a convnet);
2. one tuned module per Inductor variant (``OneBackendStrategy``; the value check on, performance validation off):
   reduce-overhead + freezing (the default's first choice today), ``capture_cuda_graphs`` + freezing, and for a
   convnet both again with channels-last; each tune's wall time;
3. every path timed in the same interleaved rounds (CUDA events, GPU synchronised after each call, the order
   rotating every round; ``aitune.torch.measure.profiling.interleaved_round_ms``): p50 per path and the median
   per-round ratio of hand-picked reduce-overhead over each path (the figure to quote: the lent machine drifts);
4. per tuned module: its chosen backend's ``run`` called directly, alternating call by call with the module (the
   wrapper's share), and the host time from call to return with the GPU idle before each call.

Usage (device tool, repo root)::

    python3 -m benchmarks.gpu_captured --model resnet50 --batch 1 --json $OUT/captured_resnet50.json
    python3 -m benchmarks.gpu_captured --model bert-base --batch 32 --json $OUT/captured_bert.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import aitune.torch as ait
from aitune.torch.backend import TorchInductorJitBackend, TorchInductorJitBackendConfig
from aitune.torch.backend.compile_settings import parameter_freezing
from aitune.torch.measure.profiling import ProfilingConfig, interleaved_round_ms
from benchmarks.gpu_search import bert_base, max_error, paired_p50_ms, resnet50
from benchmarks.gpu_wrapper_cost import host_launch_us

VARIANTS = {
    "ro+freezing": dict(mode="reduce-overhead", freezing=True),
    "captured+freezing": dict(capture_cuda_graphs=True, freezing=True, fullgraph=True),
}
CONV_VARIANTS = {
    "ro+freezing+cl": dict(mode="reduce-overhead", freezing=True, memory_format="channels_last"),
    "captured+freezing+cl": dict(capture_cuda_graphs=True, freezing=True, fullgraph=True,
                                 memory_format="channels_last"),
}


def hand_picked(model, inputs, conv: bool) -> dict:
    """The anchors, each a callable (reduce-overhead steps marked, freezing switched on as PyTorch's docs do)."""
    def call_of(compiled, freezing):
        def call():
            torch.compiler.cudagraph_mark_step_begin()
            with parameter_freezing(freezing):
                return compiled(**inputs)
        return call

    composite_model = copy.deepcopy(model).to(memory_format=torch.channels_last) if conv else model
    return {"hand ro": call_of(torch.compile(model, mode="reduce-overhead"), False),
            "hand ro+freezing" + ("+cl" if conv else ""): call_of(
                torch.compile(composite_model, mode="reduce-overhead"), True)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["resnet50", "bert-base"], required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=6.0, help="timed rounds' budget (all paths together)")
    parser.add_argument("--variants", nargs="*", choices=[*VARIANTS, *CONV_VARIANTS],
                        help="aitune's variants to tune (default: all of them)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    def save() -> None:  # after every step: a run stopped at the device tool's limit keeps what it measured
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2, default=str))

    torch.backends.cudnn.benchmark = True
    conv = args.model == "resnet50"
    if not conv and set(args.variants or ()) & set(CONV_VARIANTS):
        parser.error(f"the channels-last variants ({', '.join(CONV_VARIANTS)}) are for a convnet (--model resnet50)")
    model, inputs = resnet50(args.batch) if conv else bert_base(args.batch)
    result = {"model": args.model, "batch": args.batch, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M")}
    with torch.no_grad():
        expected = model(**inputs)
    calls = {"eager": lambda: model(**inputs)}
    calls.update(hand_picked(model, inputs, conv))
    tuned = {}
    for label, kwargs in {**VARIANTS, **(CONV_VARIANTS if conv else {})}.items():
        if args.variants and label not in args.variants:
            continue
        strategy = ait.OneBackendStrategy(TorchInductorJitBackend(TorchInductorJitBackendConfig(**kwargs)))
        wrapped = ait.Module(model, f"captured-{label}", strategy=strategy.enable_performance_validation(False))
        started = time.perf_counter()
        try:
            report = ait.tune(lambda item, wrapped=wrapped: wrapped(**item), [inputs], progress=False,
                              ready_batches=True, ignore_failing_modules=False)
        except Exception as exc:  # noqa: BLE001 - one variant's failure leaves the others' figures
            result[f"{label} failed"] = repr(exc)
            print(label, "tune raised:", repr(exc), flush=True)
            save()
            continue
        result[f"{label} tune_s"] = round(time.perf_counter() - started, 1)
        save()
        row = next(r for r in report.rows if r.status == "selected")
        result[f"{label} selected"] = row.description
        print(label, f"tuned in {result[f'{label} tune_s']} s:", row.description, flush=True)
        backend = wrapped.backends["graph0"]
        if backend.name != "inductor_jit":  # the variant failed its checks: eager was kept; say why
            result[f"{label} failed"] = [f"{r.description}: {r.status} {r.reason}" for r in report.rows]
            print(label, "not built:", result[f"{label} failed"])
            continue
        kwargs_ = backend.graph.signature.normalize((), inputs)[1]
        tuned[label] = (wrapped, backend, kwargs_)
        calls[f"aitune {label}"] = lambda wrapped=wrapped: wrapped(**inputs)
        calls[f"backend {label}"] = lambda backend=backend, kwargs_=kwargs_: backend.run((), kwargs_)
    with torch.no_grad():
        for label, call in calls.items():
            result[f"{label} max_abs_error"] = max_error(call(), expected)
    config = ProfilingConfig(warmup_rounds=30, warmup_s=0.0, min_rounds=200, max_rounds=10**9,
                             time_budget_s=args.seconds, stable_rel_error=0.0)
    labels = list(calls)
    rounds = interleaved_round_ms([calls[label] for label in labels], torch.device("cuda"), config)
    reference = rounds[labels.index("hand ro")]
    composite = rounds[next(i for i, label in enumerate(labels) if label.startswith("hand ro+"))]
    for label, times in zip(labels, rounds):
        result[f"{label} p50_ms"] = statistics.median(times)
        result[f"{label} hand_ro_over"] = statistics.median(a / b for a, b in zip(reference, times))
        result[f"{label} hand_composite_over"] = statistics.median(a / b for a, b in zip(composite, times))
    save()
    for label in labels:  # (printed now too: the paired and host timings below take another ~10 s per path)
        print(f"{label:34s} p50 {result[f'{label} p50_ms']:.3f} ms, hand RO / it {result[f'{label} hand_ro_over']:.3f}",
              flush=True)
    for label, (wrapped, backend, kwargs_) in tuned.items():  # the wrapper's share, call by call
        _, _, ratio = paired_p50_ms(lambda: wrapped(**inputs), lambda: backend.run((), kwargs_))
        result[f"aitune {label} over_backend_paired"] = ratio
        result[f"aitune {label} stats"] = wrapped.stats
    for label, call in calls.items():
        result[f"{label} host_launch_us"] = host_launch_us(call)
    print(f"## {args.model} b{args.batch} on {result['gpu']} (torch {result['torch']}, fp16), {len(reference)} rounds")
    print(f"{'path':34s} {'p50 ms':>8s} {'hand RO /':>10s} {'composite /':>12s} {'host µs':>8s} {'max err':>9s}")
    for label in labels:
        print(f"{label:34s} {result[f'{label} p50_ms']:8.3f} {result[f'{label} hand_ro_over']:10.3f} "
              f"{result[f'{label} hand_composite_over']:12.3f} {result[f'{label} host_launch_us']:8.1f} "
              f"{result[f'{label} max_abs_error']:9.3g}")
    for label in tuned:
        print(f"aitune {label}: tune {result[f'{label} tune_s']} s, module/backend paired "
              f"{result[f'aitune {label} over_backend_paired']:.3f}")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
