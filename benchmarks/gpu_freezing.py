"""Does Inductor ``freezing`` pay on this GPU and torch build? One fresh process per variant.

Hand-picked ResNet-50 b1 fp16 figures showed freezing faster, while a ``gpu_search`` run measured it slower
after aitune's tune in the same process (see RESULTS.md). This script times each variant alone, in its own process
(no earlier compile, no tune before it), so the two can be told apart: a variant is the cuDNN benchmark flag,
how freezing is switched on (compile options vs the global Inductor config), and the memory format of the
model and input. ResNet-50 with BatchNorm statistics calibrated on random data (see ``gpu_search``).

Usage (device tool, repo root)::

    python3 -m benchmarks.gpu_freezing --json $OUT/freezing.json
    python3 -m benchmarks.gpu_freezing --model bert-base --batch 32 --variants ro,ro_freeze_global,ma --json ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {
    "eager": {},
    "ro": {"mode": "reduce-overhead"},
    "ro_nobench": {"mode": "reduce-overhead", "cudnn_benchmark": False},
    "ro_freeze_opts": {"mode": "reduce-overhead", "freezing": "options"},
    "ro_freeze_global": {"mode": "reduce-overhead", "freezing": "global"},
    "ro_freeze_opts_nobench": {"mode": "reduce-overhead", "freezing": "options", "cudnn_benchmark": False},
    "ro_freeze_global_cl_in": {"mode": "reduce-overhead", "freezing": "global", "channels_last": "both"},
    "ro_freeze_global_cl_model": {"mode": "reduce-overhead", "freezing": "global", "channels_last": "model"},
    "ro_cl_in": {"mode": "reduce-overhead", "channels_last": "both"},
    # the max-autotune modes and coordinate-descent tuning, with freezing on globally
    "ma_freeze_global": {"mode": "max-autotune", "freezing": "global"},
    "ma_freeze_global_cl_model": {"mode": "max-autotune", "freezing": "global", "channels_last": "model"},
    "ro_freeze_global_cdt": {"mode": "reduce-overhead", "freezing": "global", "coordinate_descent": True},
    "ma": {"mode": "max-autotune"},
}


def child(name: str, model_name: str = "resnet50", batch: int = 1) -> dict:
    import statistics

    import torch

    from benchmarks.gpu_search import bert_base, resnet50

    spec = VARIANTS[name]
    torch.backends.cudnn.benchmark = spec.get("cudnn_benchmark", True)
    model, inputs = resnet50(batch) if model_name == "resnet50" else bert_base(batch)
    x = next(iter(inputs.values()))
    rest = dict(list(inputs.items())[1:])

    def first_tensor(output):
        return output if isinstance(output, torch.Tensor) else output[0]

    with torch.no_grad():
        expected = first_tensor(model(x, **rest)).float()
    layout = spec.get("channels_last")
    if layout in ("model", "both"):
        model = model.to(memory_format=torch.channels_last)
    if layout == "both":
        x = x.contiguous(memory_format=torch.channels_last)
    function = model
    started = time.perf_counter()
    if "mode" in spec:
        import torch._inductor.config as inductor_config
        from torch._inductor import list_mode_options

        if spec.get("coordinate_descent"):
            inductor_config.coordinate_descent_tuning = True
        if spec.get("freezing") == "global":
            inductor_config.freezing = True
            function = torch.compile(model, mode=spec["mode"])
        elif spec.get("freezing") == "options":
            function = torch.compile(model, options={**list_mode_options(spec["mode"]), "freezing": True})
        else:
            function = torch.compile(model, mode=spec["mode"])

    def call():
        torch.compiler.cudagraph_mark_step_begin()
        return first_tensor(function(x, **rest))

    with torch.no_grad():
        for _ in range(30):
            out = call()
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - started
        error = float((out.float() - expected).abs().max())
        times = []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began = time.perf_counter()
        while time.perf_counter() - began < 2.0 or len(times) < 50:
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return {"variant": name, **spec, "p50_ms": statistics.median(times), "max_abs_error": error,
            "compile_and_warmup_s": compile_s}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per variant's process")
    parser.add_argument("--child")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--model", choices=["resnet50", "bert-base"], default="resnet50")
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps({"model": args.model, "batch": args.batch,
                                      **child(args.child, args.model, args.batch)}), flush=True)
        return 0
    results = []
    for name in args.variants.split(","):
        try:
            done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_freezing", "--child", name, "--model",
                                   args.model, "--batch", str(args.batch)],
                                  capture_output=True, text=True, env=dict(os.environ), timeout=args.timeout)
        except subprocess.TimeoutExpired:
            result = {"variant": name, "error": f"compile + timing did not finish within {args.timeout} s"}
        else:
            line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
            result = json.loads(line[7:]) if line else {"variant": name, "error": done.stderr[-2000:]}
        results.append(result)
        print(json.dumps(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
