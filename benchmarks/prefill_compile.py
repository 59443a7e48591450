"""Compile time of a Llama decoder's prefill graph: ``dynamic=True`` against torch's automatic dynamic shapes and
against only the prompt-length axis marked dynamic (``torch._dynamo.mark_dynamic``).

Why aitune compiles a prefill graph with ``dynamic=True`` (``resolved_dynamic`` in
``aitune/torch/backend/compile_settings.py``): the alternative compiles no faster. Each setting runs in its own process with Inductor's caches off (``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``): the
decoder's two recorded prefill calls (prompts of 112 and 128 tokens, batch 8, a static cache) are compiled and
run, then a third, unseen length (120) is timed (median of 24 calls after the first).

    python -m benchmarks.prefill_compile                       # this CPU: 4 layers, hidden 256
    python -m benchmarks.prefill_compile --model qwen2-0.5b --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time

import torch

SMALL = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)


def prefill_calls(model, device: str, lengths=(112, 128, 120), batch: int = 8) -> list[dict]:
    """The decoder's prefill calls (keyword arguments, deep-copied) of a static-cache generate per prompt length."""
    calls = []

    def spy(module, args, kwargs):
        if kwargs.get("input_ids") is not None and kwargs["input_ids"].shape[1] > 1:
            calls.append({name: copy.deepcopy(value) for name, value in kwargs.items()})

    handle = model.model.register_forward_pre_hook(spy, with_kwargs=True)
    try:
        for length in lengths:
            # no pad token (0) in the prompt: every call then has the same attention-mask argument
            ids = torch.randint(1, model.config.vocab_size, (batch, length), device=device)
            model.generate(ids, max_new_tokens=2, do_sample=False, cache_implementation="static",
                           disable_compile=True)
    finally:
        handle.remove()
    return calls


def one(setting: str, model_name: str, device: str, dtype: str) -> dict:
    import transformers

    from benchmarks.llm_generate import MODELS

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**(SMALL if model_name == "small" else MODELS[model_name]))
    model = transformers.LlamaForCausalLM(config).to(device, getattr(torch, dtype)).eval()
    model.generation_config.pad_token_id = 0
    calls = prefill_calls(model, device)
    compiled = torch.compile(model.model, dynamic={"dynamic-true": True, "automatic": None, "marked": None}[setting])
    if setting == "marked":  # only the prompt-length axis symbolic from the first compile on
        for name in ("input_ids", "position_ids"):
            torch._dynamo.mark_dynamic(calls[0][name], 1)

    def call(kwargs) -> float:
        kwargs = {name: value if torch.is_tensor(value) else copy.deepcopy(value) for name, value in kwargs.items()}
        if device == "cuda":
            torch.cuda.synchronize()
        begin = time.perf_counter()
        compiled(**kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - begin

    with torch.no_grad():
        compile_s = [call(kwargs) for kwargs in calls[:2]]
        unseen = [call(calls[2]) for _ in range(25)]
    return {"setting": setting, "compile_s": compile_s, "unseen_first_ms": unseen[0] * 1e3,
            "unseen_median_ms": statistics.median(unseen[1:]) * 1e3,
            "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small", help="small (4 layers, hidden 256) or a benchmarks.llm_generate model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.model, args.device, args.dtype)))
        return
    env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    print(f"# prefill compile, {args.model} on {args.device} ({args.dtype}), torch {torch.__version__}")
    for setting in ("dynamic-true", "automatic", "marked"):
        out = subprocess.run([sys.executable, "-m", "benchmarks.prefill_compile", "--model", args.model, "--device",
                              args.device, "--dtype", args.dtype, "--one", setting], env=env, capture_output=True,
                             text=True, check=True).stdout.strip().splitlines()[-1]
        r = json.loads(out)
        print(f"{setting:13s} compiles {r['compile_s'][0]:.1f} + {r['compile_s'][1]:.1f} s (prompts 112, 128)  "
              f"unseen length 120: first call {r['unseen_first_ms']:.1f} ms, then {r['unseen_median_ms']:.2f} ms  "
              f"graphs {r['graphs']}")


if __name__ == "__main__":
    main()
