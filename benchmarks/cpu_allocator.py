"""Eager MiniLM 8 × 128 on this CPU before and after settling the host allocator (NOTE [host allocator steady
state], ``aitune/torch/measure/profiling.py``): p50 and minor page faults per call, in one fresh process.

Usage (repository root; needs a fresh process, so run it on its own)::

    python -m benchmarks.cpu_allocator [--seconds 12]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch

from aitune.torch.measure.profiling import settle_host_allocator


def p50_and_faults(function, seconds: float) -> tuple[float, float]:
    """Median ms per call and minor page faults per call of ``function()`` over ``seconds`` (after one call)."""
    with torch.no_grad():
        function()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        times, started = [], time.perf_counter()
        while time.perf_counter() - started < seconds:
            begin = time.perf_counter()
            function()
            times.append((time.perf_counter() - begin) * 1e3)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return statistics.median(times), faults / len(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=12.0)
    args = parser.parse_args(argv)
    from aitune.demo import SENTENCES, SentenceEncoder, load_minilm

    bert, tokenizer = load_minilm()
    model = SentenceEncoder(bert).eval()
    inputs = dict(tokenizer([SENTENCES[i % len(SENTENCES)] for i in range(8)], padding="max_length",
                            truncation=True, max_length=128, return_tensors="pt"))
    result = {}
    for phase in ("young process", "again", "settled", "settled again"):
        if phase == "settled":
            settle_host_allocator()
        p50, faults = p50_and_faults(lambda: model(**inputs), args.seconds)
        result[phase] = {"p50_ms": round(p50, 1), "page_faults_per_call": round(faults)}
        print(f"{phase:14s} eager p50 {p50:6.1f} ms, {faults:8.0f} minor page faults per call", flush=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
