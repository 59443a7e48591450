"""A decode step captured by hand into one ``torch.cuda.CUDAGraph`` against transformers' auto-compile, same process.

The experiment behind ``capture_cuda_graphs`` (NOTE [captured CUDA graphs] in aitune/torch/backend/decode_graphs.py),
without aitune: a Qwen2-0.5B-sized Llama (random weights, bf16), greedy ``generate`` with a static cache, prompt 128,
256 new tokens, batch 1 then 8; transformers' auto-compile (``reduce-overhead``, CUDA-graph trees) against the same
model whose decode calls go to ``torch.compile(model.forward, fullgraph=True)`` (no CUDA graphs) captured by hand per
cache (warm-up on a side stream, the cache's counters set back, capture, replay; the logits copied). Rounds alternate
the order; the JSON has the times, the median ratio and whether the tokens agree (both part from eager's at exact
top-2 ties, which this random model has early).

Usage (device tool, repo root)::

    PYTHONPATH=$PWD python3 benchmarks/llm_decode_by_hand.py    # writes $OUT/decode_graphs.json
"""
import copy
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from benchmarks.llm_generate import build  # noqa: E402


class DecodeGraphs:
    def __init__(self, fn):
        self.fn = fn
        self.graphs = {}
        self.pool = None
        self.captures = 0
        self.host = []

    @staticmethod
    def counters(cache):
        return [layer.cumulative_length for layer in getattr(cache, "layers", ())
                if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]

    def key(self, kw):
        parts = []
        for k, v in kw.items():
            if isinstance(v, torch.Tensor):
                parts.append((k, tuple(v.shape), v.dtype))
            elif hasattr(v, "layers"):
                parts.append((k, id(v), tuple(layer.keys.data_ptr() for layer in v.layers)))
            else:
                parts.append((k, v))
        return tuple(parts)

    def __call__(self, **kw):
        t0 = time.perf_counter_ns()
        key = self.key(kw)
        entry = self.graphs.get(key)
        if entry is None:
            cache = next(v for v in kw.values() if hasattr(v, "layers"))
            saved = [c.clone() for c in self.counters(cache)]
            static = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    self.fn(**static)
                    for c, v in zip(self.counters(cache), saved):
                        c.copy_(v)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out = self.fn(**static)
            for c, v in zip(self.counters(cache), saved):
                c.copy_(v)
            self.pool = g.pool()
            self.captures += 1
            entry = self.graphs[key] = (g, static, out)
        g, static, out = entry
        for k, v in kw.items():
            if isinstance(v, torch.Tensor):
                static[k].copy_(v)
        g.replay()
        result = copy.copy(out)
        result.logits = out.logits.clone()
        self.host.append(time.perf_counter_ns() - t0)
        return result


def generate(model, ids, new, compile_):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              cache_implementation="static", disable_compile=not compile_)


def main():
    out_dir = os.environ.get("OUT", "/tmp")
    results = {}
    model = build("qwen2-0.5b", "cuda", torch.bfloat16)
    orig_forward = model.forward
    compiled = torch.compile(orig_forward, fullgraph=True, dynamic=False)
    runner = DecodeGraphs(compiled)

    def patched(*args, **kw):
        ids = kw.get("input_ids")
        if not args and ids is not None and ids.shape[1] == 1 and any(hasattr(v, "layers") for v in kw.values()):
            return runner(**kw)
        return orig_forward(*args, **kw)

    for batch in (1, 8):
        torch.manual_seed(1)
        ids = torch.randint(1, 151936, (batch, 128), device="cuda")
        rec = {}

        def hf():
            model.__dict__.pop("forward", None)
            return generate(model, ids, 256, True)

        def manual():
            model.forward = patched
            try:
                return generate(model, ids, 256, False)
            finally:
                model.__dict__.pop("forward", None)

        def eager():
            model.__dict__.pop("forward", None)
            return generate(model, ids, 64, False)

        t = time.perf_counter()
        ref = eager()
        rec["eager64_s"] = time.perf_counter() - t
        for name, fn in (("hf", hf), ("manual", manual)):
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            rec[f"{name}_warm_s"] = time.perf_counter() - t
        times = {"hf": [], "manual": []}
        toks = {}
        for r in range(4):
            order = [("hf", hf), ("manual", manual)] if r % 2 == 0 else [("manual", manual), ("hf", hf)]
            for name, fn in order:
                torch.cuda.synchronize()
                t = time.perf_counter()
                o = fn()
                torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t)
                toks[name] = o
        rec["times"] = times
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        rec["tokens_per_s"] = {k: batch * 256 / v for k, v in med.items()}
        rec["manual_over_hf"] = med["hf"] / med["manual"]
        ratios = [h / m for h, m in zip(times["hf"], times["manual"])]
        rec["paired_ratios"] = ratios
        n = ref.shape[1]
        rec["manual_eq_eager_first64"] = bool(torch.equal(toks["manual"][:, :n], ref))
        rec["hf_eq_eager_first64"] = bool(torch.equal(toks["hf"][:, :n], ref))
        rec["manual_eq_hf_256"] = bool(torch.equal(toks["manual"], toks["hf"]))
        diff = (toks["manual"] != toks["hf"]).nonzero()
        rec["first_diff_manual_hf"] = diff[0].tolist() if len(diff) else None
        rec["captures"] = runner.captures
        host = sorted(runner.host[-200:])
        rec["manual_host_us_p50"] = host[len(host) // 2] / 1000
        results[f"b{batch}"] = rec
        print(batch, json.dumps(rec, default=str), flush=True)
    with open(os.path.join(out_dir, "decode_graphs.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
