"""What recording costs per call: a ``generate`` loop through an ``ait.Module`` while ``ait.tune`` records it, against
the same loop on an unwrapped copy of the model, in one process.

A Llama-architecture decoder is built from a config (random weights, seeded), its decoder stack wrapped and tuned
with the eager backend alone (so the tune after the recording is short), by running ``generate`` with a static
cache on ``--prompts`` prompts. The recording pass's wall time (``TuneReport.recording_s``) less the median wall time
of the same loop on the unwrapped copy, over the calls recorded, is the recorder's own cost per call: cloning each
call's inputs, reading their value ranges, checking what the call changed (inputs and module state).

Usage (from the repository root):
    python -m benchmarks.recording_cost                          # 24 thin layers on this CPU, 64 new tokens
    python -m benchmarks.recording_cost --model qwen2-0.5b --device cuda --dtype bfloat16 --new-tokens 256
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import aitune.torch as ait
from aitune.torch.backend import TorchEagerBackend
from benchmarks.llm_generate import MODELS

MODELS = {**MODELS, "deep-tiny": {**MODELS["tiny"], "num_hidden_layers": 24}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="deep-tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, nargs="+", default=[112, 128], help="prompt lengths recorded")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--loops", type=int, default=3, help="timed runs of the unwrapped loop (median)")
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODELS[args.model])).to(args.device, getattr(torch, args.dtype)).eval()
    model.generation_config.pad_token_id = 0
    plain = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, model.config.vocab_size, (1, length), generator=generator).to(args.device)
               for length in args.prompts]
    options = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, cache_implementation="static",
                   disable_compile=True)

    def loop(target) -> float:
        started = time.perf_counter()
        with torch.no_grad():
            for ids in prompts:
                target.generate(ids, **options)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - started

    loop(plain)  # warm-up
    plain_s = statistics.median(loop(plain) for _ in range(args.loops))
    model.model = ait.Module(model.model, "decoder", strategy=ait.OneBackendStrategy(TorchEagerBackend()))
    report = ait.tune(lambda ids: model.generate(ids, **options), prompts, ready_batches=True)
    calls = sum(graph.num_calls for graph in model.model.graphs)
    per_call_ms = (report.recording_s - plain_s) / calls * 1000
    print(f"{args.model} on {args.device} ({args.dtype}), prompts {args.prompts}, {args.new_tokens} new tokens: "
          f"{calls} decoder calls recorded")
    print(f"loop unwrapped {plain_s:.2f} s (median of {args.loops}); recording pass {report.recording_s:.2f} s; "
          f"recorder's cost {per_call_ms:.2f} ms per call")


if __name__ == "__main__":
    main()
