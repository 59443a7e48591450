"""A decoder's prefill and decode steps compiled by Inductor on this CPU, plain against ``cpp_wrapper=True`` (NOTE [a
C++ wrapper for phase graphs on CPU] in ``aitune/torch/backend/inductor_jit.py``), without aitune's dispatch.

One ``generate`` of the tiny Llama decoder (``benchmarks/llm_generate.py``'s models) with a static cache records the
decoder's keyword arguments; the chosen call (prefill: the first; decode: the fourth) is then compiled each way
(prefill ``dynamic=True``, decode ``dynamic=False``, as aitune compiles them) and timed call by call, the cache's
token counters put back after every call. Prints the first call's seconds (the compile), µs per call (p50 of
``--calls`` calls, repeated ``--rounds`` times, the two paths alternating by round) and the largest difference from
eager (eager's own call is not timed here: ``benchmarks/llm_generate.py`` times eager against the tuned decoder)::

    PYTHONPATH=. .venv/bin/python -m benchmarks.cpu_phase_steps
    PYTHONPATH=. .venv/bin/python -m benchmarks.cpu_phase_steps --model qwen2-0.5b --calls 20   # 24 layers, slow
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from aitune.torch.record.llm import counter_snapshot, find_cache, rewind_cache
from benchmarks.llm_generate import _Spy, build, generate

SETTINGS = {"plain": {}, "cpp_wrapper": {"cpp_wrapper": True}}


def recorded_calls(model, prompt: int) -> list[dict]:
    """The decoder's keyword arguments of every call of one static-cache ``generate`` of 64 new tokens."""
    spy, decoder = _Spy(model.model), model.model
    model.model = spy
    try:
        ids = torch.randint(1, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
        generate(model, ids, 64, static=True)
    finally:
        model.model = decoder
    return [kwargs for _, kwargs in spy.calls]


def timed(step, call: dict, cache, start, calls: int) -> float:
    """p50 µs of ``calls`` calls, the cache's counters put back to ``start`` after each."""
    samples = []
    with torch.no_grad():
        for _ in range(calls):
            began = time.perf_counter_ns()
            step(**call)
            samples.append((time.perf_counter_ns() - began) / 1e3)
            rewind_cache(cache, start)
    return statistics.median(samples)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--prompt", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    model = build(args.model, "cpu", torch.float32)
    calls = recorded_calls(model, args.prompt)
    decoder = model.model
    print(f"# {args.model} decoder on cpu, torch {torch.__version__}; µs per call, p50 of {args.calls} calls")
    for phase, index, dynamic in (("decode", 3, False), ("prefill", 0, True)):
        call = calls[index]
        cache = find_cache(call)  # the generate's own cache object, full by now: put back where this call began
        rewind_cache(cache, 0 if index == 0 else args.prompt + index - 1)
        start = counter_snapshot(cache)
        start = start.clone() if isinstance(start, torch.Tensor) else start
        with torch.no_grad():
            expected = decoder(**call).last_hidden_state
        rewind_cache(cache, start)
        steps, results = {}, {}
        for name, options in SETTINGS.items():
            steps[name] = torch.compile(decoder, dynamic=dynamic, options=options or None)
            began = time.perf_counter()
            with torch.no_grad():
                got = steps[name](**call).last_hidden_state
            rewind_cache(cache, start)
            results[name] = {"compile_s": time.perf_counter() - began,
                             "max_abs_err": float((got - expected).abs().max()), "us": []}
        for round_ in range(args.rounds):
            order = list(steps) if round_ % 2 == 0 else list(reversed(steps))
            for name in order:
                results[name]["us"].append(timed(steps[name], call, cache, start, args.calls))
        for name, result in results.items():
            extra = f"  first call {result['compile_s']:.1f} s  max |diff| vs eager {result['max_abs_err']:.2g}"
            print(f"{phase:8s} {name:12s} {statistics.median(result['us']):9.1f} µs  per round "
                  f"{[round(value, 1) for value in result['us']]}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
