"""Where a tuned decoder's host time per decode call goes (cProfile of ``generate`` with the tiny model).

Tunes the tiny Llama decoder (static cache; its decode graph with Inductor reduce-overhead on CUDA, default mode on
CPU; prefill eager), then
profiles a few ``generate`` runs and prints aitune's functions by cumulative time and the calls that read a
device value back to the host (``item``, ``__bool__``, ``tolist``, ``synchronize``)::

    python -m benchmarks.llm_decode_host --device cuda
    python -m benchmarks.llm_decode_host --device cuda --dtype bfloat16 --model qwen2-0.5b   # 24 layers
    python -m benchmarks.llm_decode_host --stages 500    # + one decode call's host time, stage by stage
    python -m benchmarks.llm_decode_host --compiled 300  # + where the compiled callable's own host time goes
    python -m benchmarks.llm_decode_host --device cuda --dtype bfloat16 --model qwen2-0.5b --batch 8 --device-profile 64

``--compiled N`` times the decode graph's compiled callable alone (what ``torch.compile`` gives: Dynamo's guard
check, cudagraph trees' input checks and copies, the replay), N calls per path, the paths alternating call by
call: as built; under ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)`` (Dynamo runs only the guards that
tell its compiled entries apart); then a cProfile and a torch.profiler table (CPU side) of N calls as built.
``--hf N`` (CUDA): the same table for transformers' own compiled decode step (its auto-compile of the whole
model under a static cache), over one ``generate`` of N new tokens, for comparison.
``--device-profile N`` (CUDA): one ``generate`` of N new tokens with the tuned decoder and one with transformers'
auto-compile (a second copy of the model), each after three warm-up runs: wall ms per generated step, device busy
µs per step (the kernel events' summed time, torch.profiler with CUDA activity) and the kernels by device time.
``--batch B`` sets the batch of every prompt (tuning and measured).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time

import torch

import aitune.torch as ait
from aitune.torch.backend import TorchInductorJitBackend, TorchInductorJitBackendConfig
from aitune.torch.backend.eager import TorchEagerBackend
from aitune.torch.record.llm import rewind_cache
from benchmarks.dispatch_stages import print_stages, stages
from benchmarks.llm_generate import build, generate, last_decode_call, sync


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", default="tiny", help="a model of benchmarks/llm_generate.py's MODELS")
    parser.add_argument("--stages", type=int, default=0, metavar="CALLS",
                        help="also time one decode call's stages over CALLS calls (benchmarks/dispatch_stages.py)")
    parser.add_argument("--compiled", type=int, default=0, metavar="CALLS",
                        help="also profile the decode graph's compiled callable alone over CALLS calls (docstring)")
    parser.add_argument("--hf", type=int, default=0, metavar="TOKENS",
                        help="also profile transformers' own compiled decode step over TOKENS new tokens (docstring)")
    parser.add_argument("--batch", type=int, default=1, help="prompts of this many sequences")
    parser.add_argument("--device-profile", type=int, default=0, metavar="TOKENS",
                        help="CUDA: device time per step, tuned vs transformers' auto-compile (docstring)")
    args = parser.parse_args(argv)
    if args.hf:
        profile_hf(args, args.hf)
    model = build(args.model, args.device, getattr(torch, args.dtype))
    mode = "reduce-overhead" if args.device.startswith("cuda") else "default"
    backend = TorchInductorJitBackend(TorchInductorJitBackendConfig(mode=mode))
    # prefill stays eager: only the decode call is measured here (and on the GPU machine's torch 2.11, Inductor's
    # prefill build of 5- and 7-token prompts failed: "indices must be int64, byte or bool. Got [torch.float64]")
    prefill = ait.OneBackendStrategy(TorchEagerBackend())
    model.model = ait.Module(model.model, "decoder", strategies={"prefill": prefill,
                                                                 "decode": ait.OneBackendStrategy(backend)})
    generator = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompts = [torch.randint(1, vocab, (args.batch, n), generator=generator).to(args.device) for n in (5, 7)]
    ait.tune(lambda ids: generate(model, ids, 8, static=True), prompts, ready_batches=True)
    measured = torch.randint(1, vocab, (args.batch, 9), generator=generator).to(args.device)
    if args.device_profile:
        profile_device(model, args, measured, args.device_profile)
        return 0
    if args.stages:
        wrapped = model.model
        call_args, call_kwargs, cache, cached = last_decode_call(model, wrapped, measured)
        graph = next(graph for graph in wrapped.graphs if getattr(graph, "phase", None) == "decode")
        for copies in (True, False):  # NOTE [output copies] in aitune/torch/config.py
            ait.config.copy_cuda_graph_outputs = copies
            print_stages(f"one decode call, {args.model}, {args.dtype} on {args.device}, output copies "
                         f"{'on' if copies else 'off'}",
                         stages(wrapped, wrapped.backends[graph.name], lambda: wrapped(*call_args, **call_kwargs),
                                args.stages, args.device.startswith("cuda"), lambda: rewind_cache(cache, cached)))
        ait.config.copy_cuda_graph_outputs = True
    if args.compiled:
        profile_compiled(model, args.compiled, measured)
    for _ in range(2):
        generate(model, measured, 64, static=True)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(5):
        generate(model, measured, 64, static=True)
    profile.disable()
    stats = pstats.Stats(profile)
    stats.sort_stats("cumulative").print_stats("aitune", 30)
    stats.sort_stats("tottime").print_stats("item|__bool__|tolist|synchronize|_local_scalar", 10)
    stats.print_callers("item|__bool__|_local_scalar")
    print("decoder stats:", model.model.stats)
    return 0


def profile_compiled(model, calls: int, prompt) -> None:
    """Where the decode graph's compiled callable spends its host time (``--compiled``; module docstring)."""
    wrapped = model.model
    call_args, call_kwargs, cache, cached = last_decode_call(model, wrapped, prompt)
    graph = next(graph for graph in wrapped.graphs if getattr(graph, "phase", None) == "decode")
    dispatch = wrapped._self_dispatch
    args, kwargs = dispatch.signature.normalize(call_args, call_kwargs)
    compiled = wrapped.backends[graph.name]._compiled
    cuda = prompt.is_cuda

    def call():
        if cuda:
            torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args, **kwargs)

    def skipping_guards():
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return call()

    paths = {"compiled": call, "compiled, differentiating guards only": skipping_guards}
    host = {name: [] for name in paths}
    with torch.no_grad():
        for function in paths.values():
            for _ in range(10):
                rewind_cache(cache, cached)
                function()
        for _ in range(calls):
            for name, function in paths.items():
                rewind_cache(cache, cached)
                if cuda:
                    torch.cuda.synchronize()
                started = time.perf_counter_ns()
                function()
                host[name].append((time.perf_counter_ns() - started) / 1e3)
        if cuda:
            torch.cuda.synchronize()
        print(f"## the decode graph's compiled callable alone, host µs per call (p50 of {calls}, alternating)")
        for name, values in host.items():
            print(f"  {name:44s} {statistics.median(values):9.1f}")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(calls):
            rewind_cache(cache, cached)
            call()
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(30)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                rewind_cache(cache, cached)
                call()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))


def profile_device(model, args, prompt, tokens: int) -> None:
    """Wall and device time per generated step, tuned decoder vs transformers' auto-compile (``--device-profile``)."""
    from torch.profiler import ProfilerActivity, profile

    reference = build(args.model, args.device, getattr(torch, args.dtype))
    runs = {"tuned": lambda: generate(model, prompt, tokens, static=True),
            "hf-compile": lambda: generate(reference, prompt, tokens, static=True, compile_=True)}
    for name, run in runs.items():
        for _ in range(3):
            run()
        sync(args.device)
        started = time.perf_counter()
        run()
        sync(args.device)
        wall_ms = (time.perf_counter() - started) * 1e3 / tokens
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
            sync(args.device)
        events = prof.key_averages()
        # the kernels alone: CPU-side rows (an annotated compiled-graph call) also carry the device time of the
        # kernels they launched, and summing them too counted those kernels twice
        busy = sum(event.self_device_time_total for event in events
                   if event.device_type == torch.autograd.DeviceType.CUDA) / tokens
        print(f"## {name}: batch {args.batch}, {tokens} new tokens: wall {wall_ms:.3f} ms per step, device busy "
              f"{busy:.1f} µs per step")
        print(events.table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=70))


def profile_hf(args, tokens: int) -> None:
    """transformers' auto-compiled decode step, CPU-side profile of one generate (``--hf``)."""
    model = build(args.model, args.device, getattr(torch, args.dtype))
    prompt = torch.randint(1, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))
    prompt = prompt.to(args.device)
    for _ in range(3):
        generate(model, prompt, tokens, static=True, compile_=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        generate(model, prompt, tokens, static=True, compile_=True)
    print(f"## transformers' auto-compiled decode steps, one generate of {tokens} new tokens (CPU side)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
    del model


if __name__ == "__main__":
    sys.exit(main())
