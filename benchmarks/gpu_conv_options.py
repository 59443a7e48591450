"""Do Inductor's convolution options beat reduce-overhead + freezing on ResNet-50 fp16 (H200)?

Each variant is ``torch.compile`` with reduce-overhead's options + freezing + extra Inductor options
(``conv_1x1_as_mm``, ``coordinate_descent_tuning``, ``max_autotune_gemm``), compiled on its own copy of the model
(BatchNorm calibrated) and timed call by call against the hand-picked ``mode="reduce-overhead"`` run and against
plain reduce-overhead + freezing (``paired_p50_ms``). Then, unless ``--no-extras``: a second compile of
reduce-overhead + freezing in the same process (its wall time and Inductor's cache counters: what a re-tune's
rebuild costs) and the GPU kernel time per call of default-mode + freezing, grouped (convolutions vs Triton).

Usage (device tool, repo root)::

    python3 -m benchmarks.gpu_conv_options --json $OUT/conv_options.json
    python3 -m benchmarks.gpu_conv_options --batch 32 --variants ro_freeze,ro_freeze_1x1mm --no-extras
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

from aitune.torch.backend.compile_settings import parameter_freezing
from benchmarks.gpu_search import max_error, paired_p50_ms, resnet50

VARIANTS = {
    "ro_freeze": {},
    "ro_freeze_1x1mm": {"conv_1x1_as_mm": True},
    "ro_freeze_cdt": {"coordinate_descent_tuning": True},
    "ro_freeze_1x1mm_cdt": {"conv_1x1_as_mm": True, "coordinate_descent_tuning": True},
    "ro_freeze_1x1mm_mmautotune": {"conv_1x1_as_mm": True, "max_autotune_gemm": True,
                                   "max_autotune_gemm_backends": "ATEN,TRITON"},
}


def main(argv=None) -> int:
    from torch._inductor import list_mode_options

    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--no-extras", action="store_true", help="skip the cache probe and the kernel profile")
    args = parser.parse_args(argv)
    torch.backends.cudnn.benchmark = True
    model, inputs = resnet50(args.batch)
    result = {"batch": args.batch, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}

    def save():
        print(json.dumps(result), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))

    with torch.no_grad():
        expected = model(**inputs)
        hand = torch.compile(model, mode="reduce-overhead")

        def reduce_overhead():
            torch.compiler.cudagraph_mark_step_begin()
            return hand(**inputs)

        reduce_overhead(); reduce_overhead()
        calls = {}
        for name in args.variants.split(","):
            options = {**list_mode_options("reduce-overhead"), "freezing": True, **VARIANTS[name]}
            compiled = torch.compile(copy.deepcopy(model), options=options)

            def call(compiled=compiled):
                torch.compiler.cudagraph_mark_step_begin()
                with parameter_freezing(True):
                    return compiled(**inputs)

            started = time.perf_counter()
            try:
                for _ in range(3):
                    out = call()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001
                result[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                save()
                continue
            entry = {"compile_s": time.perf_counter() - started, "max_abs_error": max_error(out, expected)}
            hand_ms, ms, ratio = paired_p50_ms(reduce_overhead, call)
            entry.update(p50_ms=ms, hand_ro_ms=hand_ms, hand_ro_over_variant=ratio)
            if "ro_freeze" in calls:
                base_ms, ms2, ratio2 = paired_p50_ms(calls["ro_freeze"], call)
                entry.update(ro_freeze_over_variant=ratio2)
            calls[name] = call
            result[name] = entry
            save()
        if args.no_extras:
            return 0
        result["cache_probe"] = cache_probe(model, inputs)
        save()
        result["kernel_profile"] = kernel_profile(model, inputs)
        save()
    return 0


def cache_probe(model, inputs) -> dict:
    """RO + freezing compiled again on a fresh copy in the same process (as a second tune does): its wall time
    to the third call, Inductor's cache counters over it, and Dynamo's per-phase compile times."""
    from torch._dynamo.utils import compile_times, counters
    from torch._inductor import list_mode_options

    before = {k: dict(v) for k, v in counters.items()}
    compiled = torch.compile(copy.deepcopy(model), options={**list_mode_options("reduce-overhead"), "freezing": True})
    started = time.perf_counter()
    for _ in range(3):
        torch.compiler.cudagraph_mark_step_begin()
        with parameter_freezing(True):
            compiled(**inputs)
    torch.cuda.synchronize()
    wall = time.perf_counter() - started
    delta = {}
    for group, values in counters.items():
        for key, value in values.items():
            change = value - before.get(group, {}).get(key, 0)
            if change and any(k in key for k in ("cache", "bypass", "hit", "miss")):
                delta[f"{group}.{key}"] = change
    return {"wall_s": wall, "counters": delta, "compile_times": compile_times(repr="str", aggregate=True)[:3000]}


def kernel_profile(model, inputs) -> dict:
    """GPU kernel time of default-mode Inductor + freezing (no CUDA graphs), grouped: convolutions (cuDNN /
    CUTLASS kernels), Triton kernels (Inductor's fused pointwise), the rest; per call, microseconds."""
    from torch._inductor import list_mode_options
    from torch.profiler import ProfilerActivity, profile

    compiled = torch.compile(copy.deepcopy(model), options={**list_mode_options("default"), "freezing": True})

    def call():
        with parameter_freezing(True):
            return compiled(**inputs)

    for _ in range(5):
        call()
    torch.cuda.synchronize()
    calls = 20
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    groups: dict[str, float] = {}
    count: dict[str, int] = {}
    for event in prof.key_averages():
        if event.device_time_total <= 0:
            continue
        name = event.key
        convolution = any(k in name.lower() for k in ("conv", "xmma", "cudnn", "cutlass", "implicit", "sm90", "sm80",
                                                       "gemm"))
        group = "triton" if name.startswith("triton") else ("conv" if convolution else "other:" + name[:60])
        groups[group] = groups.get(group, 0.0) + event.device_time_total / calls
        count[group] = count.get(group, 0) + event.count // calls
    return {"us_per_call": groups, "kernels_per_call": count}


if __name__ == "__main__":
    sys.exit(main())
