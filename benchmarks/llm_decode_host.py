"""Where a tuned decoder's host time per decode call goes (cProfile of ``generate`` with the tiny model).

Tunes the tiny Llama decoder (static cache; its decode graph with Inductor reduce-overhead on CUDA, default mode on
CPU; prefill eager), then
profiles a few ``generate`` runs and prints aitune's functions by cumulative time and the calls that read a
device value back to the host (``item``, ``__bool__``, ``tolist``, ``synchronize``)::

    python -m benchmarks.llm_decode_host --device cuda
    python -m benchmarks.llm_decode_host --device cuda --dtype bfloat16 --model qwen2-0.5b   # 24 layers
    python -m benchmarks.llm_decode_host --stages 500    # + one decode call's host time, stage by stage
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys

import torch

import aitune.torch as ait
from aitune.torch.backend import TorchInductorJitBackend, TorchInductorJitBackendConfig
from aitune.torch.backend.eager import TorchEagerBackend
from aitune.torch.record.llm import rewind_cache
from benchmarks.dispatch_stages import print_stages, stages
from benchmarks.llm_generate import build, generate, last_decode_call


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", default="tiny", help="a model of benchmarks/llm_generate.py's MODELS")
    parser.add_argument("--stages", type=int, default=0, metavar="CALLS",
                        help="also time one decode call's stages over CALLS calls (benchmarks/dispatch_stages.py)")
    args = parser.parse_args(argv)
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
    prompts = [torch.randint(1, vocab, (1, n), generator=generator).to(args.device) for n in (5, 7)]
    ait.tune(lambda ids: generate(model, ids, 8, static=True), prompts, ready_batches=True)
    measured = torch.randint(1, vocab, (1, 9), generator=generator).to(args.device)
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


if __name__ == "__main__":
    sys.exit(main())
