"""Side-by-side speed harness: eager vs every candidate backend vs the tuned choice, in one process.

For each batch size the model is tuned on its own (one graph, one shape), so every figure in a row was
measured in the same run under the same conditions. Then, outside the tuner, the harness times again:
eager, the tuned ``ait.Module`` (wrapper included) and the chosen backend called directly, and prints:

* speed-up of every candidate vs eager (from the tuner's own measurements),
* tuned / best-correct-candidate ratio (target >= 0.97),
* tuned-module vs eager speed-up,
* wrapper overhead per call (tuned Module - chosen backend, median µs; target <= 20 µs on CPU).

Usage (from the repository root):
    python -m benchmarks.harness --model minilm --batch 8 --seq 128
    python -m benchmarks.harness --model resnet50 --device cuda --dtype float16 --batch 1 32
    python -m benchmarks.harness --model bert-base --device cuda --dtype float16 --batch 1 32
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

import aitune.torch as ait
from aitune.torch.backend import get_backend_class
from aitune.torch.measure.profiling import ProfilingConfig, Timer, settle_host_allocator


def minilm(device, dtype, batch, seq):
    from aitune.demo import SENTENCES, SentenceEncoder, load_minilm

    bert, tokenizer = load_minilm()
    model = SentenceEncoder(bert)
    sentences = [SENTENCES[i % len(SENTENCES)] for i in range(batch)]
    inputs = dict(tokenizer(sentences, padding="max_length", truncation=True, max_length=seq, return_tensors="pt"))
    return model.to(device, dtype).eval(), {k: v.to(device) for k, v in inputs.items()}


def bert_base(device, dtype, batch, seq):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig()).to(device, dtype).eval()  # bert-base-uncased shape, random weights
    ids = torch.randint(0, 30522, (batch, seq), device=device)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def resnet50(device, dtype, batch, seq):
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50().to(device, dtype).eval()  # random weights
    return model, {"x": torch.randn(batch, 3, 224, 224, device=device, dtype=dtype)}


MODELS = {"minilm": minilm, "bert-base": bert_base, "resnet50": resnet50}


def make_backend(spec: str):
    """``name``, ``name:field=value,...`` or ``inductor_jit:reduce-overhead`` (a compile mode) -> a backend."""
    name, _, options = spec.partition(":")
    backend_class = get_backend_class(name)
    if not options:
        return backend_class()
    if "=" not in options:
        return backend_class(backend_class.config_class(mode=options))
    fields = {}
    for item in options.split(","):
        key, _, value = item.partition("=")
        fields[key] = {"true": True, "false": False}.get(value.lower(), value)
    return backend_class(backend_class.config_class(**fields))


def time_calls(function, device, seconds: float = 2.0, warmup: int = 10) -> list[float]:
    """Per-call latencies (ms) of ``function()`` for about ``seconds`` after ``warmup`` calls (on CPU with the
    host allocator settled first, as aitune's own timing does: NOTE [host allocator steady state])."""
    timer = Timer(device)
    if not timer.cuda:
        settle_host_allocator()
    with torch.no_grad():
        for _ in range(warmup):
            function()
        latencies, started = [], time.perf_counter()
        while time.perf_counter() - started < seconds or len(latencies) < 20:
            latencies.append(timer(function))
    return latencies


def run(model_name: str, device: str, dtype: str, batch_sizes: list[int], seq: int, backends: list[str] | None,
        budget_s: float, tolerance: "ait.Tolerance | None" = None) -> list[dict]:
    device = torch.device(device)
    torch_dtype = getattr(torch, dtype)
    results = []
    for batch in batch_sizes:
        model, inputs = MODELS[model_name](device, torch_dtype, batch, seq)
        candidates = [make_backend(name) for name in backends] if backends else None
        strategy = ait.MaxThroughputStrategy(candidates, profiling_config=ProfilingConfig(time_budget_s=budget_s))
        if tolerance is not None:
            strategy.enable_correctness_check(True, tolerance)
        wrapped = ait.Module(model, f"{model_name}-b{batch}", strategy=strategy)
        report = ait.tune(lambda item: wrapped(**item), [inputs], ready_batches=True)
        rows = report.rows
        passing = [r for r in rows if r.status in ("passed", "selected") and r.measurement]
        best = max(passing, key=lambda r: r.measurement["throughput"])
        chosen_row = [r for r in rows if r.status == "selected"][0]
        chosen = next(iter(wrapped.backends.values()))

        eager_ms = time_calls(lambda: model(**inputs), device, budget_s)
        tuned_ms = time_calls(lambda: wrapped(**inputs), device, budget_s)
        direct_ms = time_calls(lambda: chosen.infer(**inputs), device, budget_s)
        eager_p50, tuned_p50, direct_p50 = (statistics.median(v) for v in (eager_ms, tuned_ms, direct_ms))
        result = {
            "model": model_name, "device": str(device), "dtype": dtype, "batch": batch, "seq": seq,
            "candidates": {r.description: {"status": r.status, "reason": r.reason, "speedup_vs_eager": r.speedup,
                                           "p50_ms": (r.measurement or {}).get("p50_ms"),
                                           "throughput": (r.measurement or {}).get("throughput")}
                           for r in rows},
            "selected": chosen_row.description,
            "tuned_over_best": chosen_row.measurement["throughput"] / best.measurement["throughput"],
            "eager_p50_ms": eager_p50, "tuned_module_p50_ms": tuned_p50, "chosen_direct_p50_ms": direct_p50,
            "tuned_speedup_vs_eager": eager_p50 / tuned_p50,
            "wrapper_overhead_us": (tuned_p50 - direct_p50) * 1000,
        }
        results.append(result)
        print(f"\n## {model_name} batch {batch} ({dtype}, {device})")
        print(report.table())
        print(f"selected: {result['selected']}  tuned/best-candidate throughput: {result['tuned_over_best']:.3f}")
        print(f"re-timed outside the tuner: eager {eager_p50:.3f} ms, tuned module {tuned_p50:.3f} ms, chosen "
              f"backend direct {direct_p50:.3f} ms -> tuned speed-up {result['tuned_speedup_vs_eager']:.2f}x, "
              f"wrapper overhead {result['wrapper_overhead_us']:.1f} µs")
        sys.stdout.flush()
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="minilm")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, nargs="+", default=[8])
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--backends", nargs="+", help="backend names (default: all available)")
    parser.add_argument("--budget-s", type=float, default=2.0, help="seconds of timing per candidate")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--atol", type=float, help="override the comparison's atol (all float dtypes)")
    parser.add_argument("--rtol", type=float, help="override the comparison's rtol (all float dtypes)")
    parser.add_argument("--min-sqnr-db", type=float, help="override the SQNR floor of quantized candidates (dB)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("torch", "onnxscript", "onnx_ir", "torchao", "transformers"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    tolerance = None
    if args.atol is not None or args.rtol is not None or args.min_sqnr_db is not None:
        fields = {}
        if args.atol is not None or args.rtol is not None:
            atol, rtol = args.atol if args.atol is not None else 1e-2, args.rtol if args.rtol is not None else 1e-2
            fields.update(atol=atol, rtol=rtol, low_precision_atol=atol, low_precision_rtol=rtol)
        if args.min_sqnr_db is not None:
            fields.update(min_sqnr_db=args.min_sqnr_db)
        tolerance = ait.Tolerance(**fields)
    results = run(args.model, args.device, args.dtype, args.batch, args.seq, args.backends, args.budget_s,
                  tolerance)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
