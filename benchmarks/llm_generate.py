"""Text generation side by side: eager ``generate`` vs the tuned decoder vs hand-picked anchors, in one process.

A Llama-architecture model is built from a config (random weights, seeded: nothing is downloaded), its decoder
stack (``model.model``) wrapped with ``ait.Module`` and tuned by running ``generate`` on two prompts with a
static key/value cache. Then, in interleaved rounds, each variant generates ``--new-tokens`` greedy tokens from
a prompt of a length the tune never recorded, and the script prints tokens/s, ratios against eager with the
same cache, time to first token, and whether the tokens equal eager's (else where the first difference falls
and the top-2 logit gap there).

Variants:
    eager-dynamic   eager ``generate`` with the default (dynamic) cache
    eager-static    eager ``generate`` with ``cache_implementation="static"`` and HF's auto-compile off
    tuned           the tuned decoder, static cache, auto-compile off
    hf-compile      (CUDA only) HF's own recipe: static cache with its auto-compile of the decode step
    hand-decoder    (CUDA only) the hand-picked equivalent of a tuned decoder: ``torch.compile(model.model,
                    mode="reduce-overhead", fullgraph=True)``, static cache, auto-compile off (the head runs
                    eager, as with the tuned decoder; the gap to hf-compile is what compiling the head costs)

Usage (from the repository root):
    python -m benchmarks.llm_generate                       # tiny model on this CPU, 32 new tokens
    python -m benchmarks.llm_generate --model qwen2-0.5b --device cuda --dtype bfloat16 --new-tokens 256
    python -m benchmarks.llm_generate ... --batch 8
    python -m benchmarks.llm_generate ... --decode-calls 200   # + one decode step timed call by call

``--decode-calls N`` also times one decode call (the last of a short ``generate``, replayed with the same
inputs: it rewrites the same cache position) call by call, N calls per path per round, interleaved: the tuned
decoder as ``generate`` calls it, the decode graph's backend ``run`` on the normalised call, its compiled
callable alone (CUDA-graph step marker included, no output copy) and, on CUDA, the hand-picked decoder (decoder
scope) or transformers' own compiled call of the model on the same inputs (model scope, ``hf-compiled``; on
the CPU, where transformers' auto-compile is off by default, ``hand-model``: ``torch.compile(model.__call__,
fullgraph=True, dynamic=False)`` with the tuned decode graph's compile options, its recipe done by hand). Per
path: host µs until the call returns (device idle before it) and µs until the device is done. The tuned
decoder minus the compiled callable is what aitune's dispatch costs per generated token. On CUDA aitune's paths
(tuned, run, compiled) are timed again with ``config.copy_cuda_graph_outputs = False`` (NOTE [output copies] in
aitune/torch/config.py). With it, ``--stages N`` adds the tuned call's host time stage by stage
(``benchmarks/dispatch_stages.py``) and ``--profile-decode FILE`` a cProfile of the decode-call count's tuned calls.
``--scope model`` wraps the whole causal LM instead of its decoder stack (``ait.Module(model, "model")``, then
``wrapped.generate(...)``: README, "Text generation"), head included; the gap between the two scopes is what
running the head and the model's forward eagerly costs per token.
``--loop-split ROUNDS`` (with ``--scope model``) times the decode calls where ``generate`` makes them, ROUNDS runs
per path (tuned, tuned-bare: its decode calls past the dispatch to the decode backend, hf-compile, eager-static,
and on CUDA four crossed paths): the loop's time per token split into the model call and the rest of the step, and
on CUDA the device's span of the call (``benchmarks/generate_loop.py``): the isolated call of ``--decode-calls``
starts with the device idle and the host's caches warm, the loop's does not; ``--loop-profile DIR`` adds one
generate run per path under cProfile (``DIR/loop_<path>.txt``).
``--skip`` leaves variants out (``eager-dynamic``, ``hf-compile``, ``hand-decoder``) where device time is short.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import aitune.torch as ait
from aitune.torch.record.llm import find_cache, rewind_cache
from benchmarks.dispatch_stages import print_stages, profile_calls, stages
from benchmarks.generate_loop import decode_backend, loop_split, print_split

MODELS = {
    # the tests' tiny model: 2 layers, hidden 64
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512),
    # Qwen2-0.5B's shape (config.json of Qwen/Qwen2-0.5B) as a Llama architecture
    "qwen2-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True),
}


def build(name: str, device: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODELS[name])).to(device, dtype).eval()
    model.generation_config.pad_token_id = 0
    return model


def generate(model, ids, new_tokens: int, static: bool, compile_: bool = False):
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  return_dict_in_generate=True, output_scores=True)
    if static:
        kwargs.update(cache_implementation="static", disable_compile=not compile_)
    with torch.no_grad():
        return model.generate(ids, **kwargs)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def first_difference(reference, other, prompt_len: int) -> dict | None:
    """Where ``other``'s tokens first differ from ``reference``'s, and the top-2 logit gap of the reference there."""
    a, b = reference.sequences[:, prompt_len:], other.sequences[:, prompt_len:]
    if torch.equal(a, b):
        return None
    step = int((a != b).any(dim=0).nonzero()[0])
    scores = reference.scores[step].float()
    top2 = scores.topk(2, dim=-1).values
    return {"step": step, "top2_gap": float((top2[:, 0] - top2[:, 1]).min())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=9, help="prompt length measured (never recorded by default)")
    parser.add_argument("--tune-prompts", type=int, nargs="+", default=[5, 7], help="prompt lengths the tune records")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--once", nargs="*", default=[], help="variants timed by their warm-up run only (slow ones)")
    parser.add_argument("--decode-calls", type=int, default=0, help="also time one decode call, N calls per path "
                                                                    "per round (0: not timed)")
    parser.add_argument("--skip", nargs="*", default=[], help="variants not run (eager-dynamic, hf-compile, "
                                                                   "hand-decoder)")
    parser.add_argument("--no-output-copies", action="store_true",
                        help="config.copy_cuda_graph_outputs = False (NOTE [output copies] in aitune/torch/config.py)")
    parser.add_argument("--compile-times", action="store_true",
                        help="after the tune, print Dynamo/Inductor's compile-time table (torch._dynamo.utils)")
    parser.add_argument("--tune-only", action="store_true", help="tune, print the report and stop (e.g. to time a "
                                                                 "re-tune with the compile caches warm)")
    parser.add_argument("--scope", choices=("decoder", "model"), default="decoder",
                        help="what is wrapped: the decoder stack (model.model) or the whole causal LM, head "
                             "included (README, 'Text generation')")
    parser.add_argument("--stages", type=int, default=0, metavar="CALLS",
                        help="with --decode-calls: also the tuned decode call's host time stage by stage, mean over "
                             "CALLS calls (benchmarks/dispatch_stages.py)")
    parser.add_argument("--profile-decode", metavar="FILE",
                        help="with --decode-calls: write a cProfile of that many tuned decode calls here (text, by "
                             "own time), to see where the dispatch's host time goes")
    parser.add_argument("--loop-split", type=int, default=0, metavar="ROUNDS",
                        help="also split a generate loop's step into the model call and the rest, per path, over "
                             "ROUNDS runs each (benchmarks/generate_loop.py)")
    parser.add_argument("--loop-profile", metavar="DIR",
                        help="with --loop-split: one more generate run per path under cProfile, written to "
                             "DIR/loop_<path>.txt")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args(argv)
    if (args.stages or args.profile_decode) and not args.decode_calls:
        parser.error("--stages and --profile-decode time the decode call of --decode-calls N: give N too")
    if args.loop_profile and not args.loop_split:
        parser.error("--loop-profile profiles the paths of --loop-split ROUNDS: give ROUNDS too")
    if args.loop_split and args.scope != "model":
        parser.error("--loop-split times the model's call in every path: give --scope model too")
    if args.loop_profile:  # before the tune: a directory that cannot be made must not cost a whole run
        try:
            os.makedirs(args.loop_profile, exist_ok=True)
        except OSError as exc:
            parser.error(f"--loop-profile {args.loop_profile}: {exc}")
    ait.config.copy_cuda_graph_outputs = not args.no_output_copies
    dtype = getattr(torch, args.dtype)
    device = args.device
    model = build(args.model, device, dtype)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, vocab, (args.batch, n), generator=generator).to(device) for n in args.tune_prompts]
    measured = torch.randint(1, vocab, (args.batch, args.prompt), generator=generator).to(device)

    eager_decoder = model.model
    if args.scope == "model":  # generate reached through the wrapper calls it at every step (NOTE [own calls])
        wrapped = ait.Module(model, "model")

        def use(tuned: bool):
            model.model = eager_decoder  # (the hand-picked variant swaps it)
            return wrapped if tuned else model
    else:
        wrapped = ait.Module(eager_decoder, "decoder")

        def use(tuned: bool):
            model.model = wrapped if tuned else eager_decoder
            return model
    started = time.perf_counter()
    report = ait.tune(lambda ids: generate(use(True), ids, args.new_tokens, static=True), prompts,
                      ready_batches=True)
    tune_s = time.perf_counter() - started
    print(report.describe())
    if args.compile_times:
        from torch._dynamo.utils import compile_times, counters

        print(compile_times(repr="str", aggregate=True))
        print("dynamo counters:", {key: dict(value) for key, value in counters.items() if key in ("stats", "frames")})
    if args.tune_only:
        print(f"tune: {tune_s:.1f} s")
        return 0

    def variant(name):
        target = use(name == "tuned")
        if name == "eager-dynamic":
            return lambda: generate(target, measured, args.new_tokens, static=False)
        if name in ("eager-static", "tuned"):
            return lambda: generate(target, measured, args.new_tokens, static=True)
        if name == "hand-decoder":
            model.model = hand_decoder
            return lambda: generate(target, measured, args.new_tokens, static=True)
        return lambda: generate(target, measured, args.new_tokens, static=True, compile_=True)

    names = ["eager-dynamic", "eager-static", "tuned"] + (["hf-compile", "hand-decoder"]
                                                          if device.startswith("cuda") else [])
    names = [name for name in names if name not in args.skip or name in ("eager-static", "tuned")]
    hand_decoder = torch.compile(eager_decoder, mode="reduce-overhead", fullgraph=True)
    outputs, times, first_token = {}, {n: [] for n in names}, {n: [] for n in names}
    for name in names:  # warm-up (HF's auto-compile compiles here)
        start = time.perf_counter()
        outputs[name] = variant(name)()
        sync(device)
        elapsed = time.perf_counter() - start
        if name in args.once:
            times[name].append(elapsed)
        print(f"warm-up {name}: {elapsed:.1f} s", flush=True)
    for _ in range(args.rounds):
        for name in names:
            if name in args.once:
                continue
            run = variant(name)
            sync(device)
            start = time.perf_counter()
            run()
            sync(device)
            times[name].append(time.perf_counter() - start)
            if name in ("eager-static", "tuned"):  # time to first token: a generate of one new token
                target = use(name == "tuned")
                sync(device)
                start = time.perf_counter()
                generate(target, measured, 1, static=True)
                sync(device)
                first_token[name].append(time.perf_counter() - start)
    use(True)  # (the decoder scope's wrapper back in place)
    stats = json.loads(json.dumps(wrapped.stats))  # (a copy, before the decode calls below replay calls of their own)
    graph_stats = {name: backend.cuda_graph_stats for name, backend in wrapped.backends.items()
                   if getattr(backend, "cuda_graph_stats", None) is not None}  # aitune's own CUDA graphs
    loop = None
    if args.loop_split:  # (the whole model is the tuned scope: checked with the arguments)
        split_paths = {name: variant(name) for name in ("tuned", "hf-compile", "eager-static") if name in names}
        split_paths["tuned-bare"] = split_paths["tuned"]  # (the same runs, their decode calls served otherwise)
        if "hf-compile" in split_paths:
            split_paths["tuned-via-hf"] = split_paths["tuned"]
            for name in ("hf-loop-ours", "hf-loop-callable", "hf-loop-marker"):
                split_paths[name] = split_paths["hf-compile"]
        loop, roots = loop_split(model, wrapped, split_paths, args.loop_split, device.startswith("cuda"),
                                 args.loop_profile)
        print_split(loop, roots)
    caller = wrapped if args.scope == "model" else None
    hand = hand_decoder if "hand-decoder" in names and args.scope == "decoder" else None
    decode_cost = stage_means = decode_cost_uncopied = None
    if args.decode_calls:
        decode_cost, stage_means = decode_call_cost(model, wrapped, hand, measured, args.decode_calls, args.rounds,
                                                    caller, args.profile_decode, args.stages)
    if args.decode_calls and not args.no_output_copies and device.startswith("cuda"):  # the same without copies
        ait.config.copy_cuda_graph_outputs = False
        decode_cost_uncopied, _ = decode_call_cost(model, wrapped, None, measured, args.decode_calls, args.rounds,
                                                   caller, anchors=False)
        ait.config.copy_cuda_graph_outputs = True
    tokens = args.batch * args.new_tokens
    result = {"model": args.model, "scope": args.scope, "device": device, "dtype": args.dtype, "batch": args.batch,
              "prompt": args.prompt, "new_tokens": args.new_tokens, "tune_s": round(tune_s, 1), "variants": {}}
    base = statistics.median(times["eager-static"])
    for name in names:
        median = statistics.median(times[name])
        entry = {"tokens_per_s": round(tokens / median, 1), "vs_eager_static": round(base / median, 3)}
        if first_token[name]:
            entry["first_token_ms"] = round(1e3 * statistics.median(first_token[name]), 2)
        reference = outputs["eager-dynamic" if name == "eager-dynamic" else "eager-static"]
        entry["first_difference_vs_eager"] = first_difference(reference, outputs[name], args.prompt)
        result["variants"][name] = entry
    for anchor in ("hf-compile", "hand-decoder"):
        if anchor in result["variants"] and anchor not in args.once:  # paired: the median of per-round ratios
            result[f"tuned_vs_{anchor.replace('-', '_')}"] = round(statistics.median(
                other / mine for other, mine in zip(times[anchor], times["tuned"])), 3)
    result["backend_calls"], result["eager_fallbacks"] = stats["backend_calls"], stats["eager_fallbacks"]
    result["cuda_graph_stats"] = graph_stats
    graphs_line = f"; aitune's CUDA graphs (the tune's calls included) {graph_stats}" if graph_stats else ""
    print(f"tune: {tune_s:.1f} s; tuned decoder calls: {stats['backend_calls']} by a backend, eager fallbacks "
          f"{stats['eager_fallbacks']}{graphs_line}")
    print(f"tuned module's stats: {stats}")
    for name, entry in result["variants"].items():
        first = f"{entry['first_token_ms']} ms" if "first_token_ms" in entry else "not timed"
        print(f"{name:14s} {entry['tokens_per_s']:9.1f} tokens/s  {entry['vs_eager_static']:6.3f}x eager-static  "
              f"first token {first}  tokens vs eager: "
              f"{'identical' if entry['first_difference_vs_eager'] is None else entry['first_difference_vs_eager']}")
    for key in ("tuned_vs_hf_compile", "tuned_vs_hand_decoder"):
        if key in result:
            print(f"{key}: {result[key]} (median of per-round ratios of tokens/s)")
    for key, cost, title in (
            ("decode_call_us", decode_cost,
             "one decode call, µs (p50 over all rounds): host until it returns / until the device is done"),
            ("decode_call_us_without_output_copies", decode_cost_uncopied,
             "the same with config.copy_cuda_graph_outputs = False")):
        if cost is not None:
            result[key] = cost
            print(title)
            for name, entry in cost.items():
                print(f"  {name:24s} {entry['host_p50_us']:9.1f} / {entry['done_p50_us']:9.1f}")
    if stage_means is not None:
        result["decode_call_stages_us"] = stage_means
        print_stages(f"the tuned decode call ({args.scope} scope)", stage_means)
    if loop is not None:
        result["generate_loop_step_us"] = loop
        result["generate_loop_compiled_entries"] = roots  # (CUDA graphs per compiled function, Dynamo entries)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    return 0


class _Spy(torch.nn.Module):
    """Passes calls to ``inner`` and keeps every call's arguments (``calls``; the last one: ``last``)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.calls: list[tuple[tuple, dict]] = []
        self.last = None

    def forward(self, *args, **kwargs):
        self.last = (args, dict(kwargs))
        self.calls.append(self.last)
        return self.inner(*args, **kwargs)


def last_decode_call(model, wrapped, prompt, caller=None) -> tuple[tuple, dict, object, int]:
    """``(args, kwargs, cache, tokens cached before it)`` of the last call of ``wrapped`` (an ``ait.Module``: the
    decoder ``model.model``, or the whole model) in a 3-token generate from ``prompt`` run on ``caller`` (default
    ``model``); rewinding the cache to that count repeats the call."""
    dispatch = wrapped._self_dispatch
    calls = []
    serve = type(dispatch).call

    def spy(self, args, kwargs):
        if self is dispatch:
            calls.append((args, dict(kwargs)))
        return serve(self, args, kwargs)

    type(dispatch).call = spy
    try:
        generate(caller if caller is not None else model, prompt, 3, static=True)
    finally:
        type(dispatch).call = serve
    if not calls:
        raise RuntimeError(f"{wrapped!r}: generate never called the wrapper's dispatch (not tuned?), so there is no "
                           "decode call to time")
    args, kwargs = calls[-1]
    cache = find_cache(kwargs, args)
    tokens = kwargs.get("input_ids")
    cached = int(cache.get_seq_length()) - (tokens.shape[1] if tokens is not None else 1)  # before that call
    return args, kwargs, cache, cached


def decode_call_cost(model, wrapped, hand_decoder, prompt, calls: int, rounds: int, caller=None,
                     profile: str | None = None, stage_calls: int = 0,
                     anchors: bool = True) -> tuple[dict, dict | None]:
    """Host and device µs of one decode call per path (see the module docstring), p50 over all calls, and the tuned
    call's mean host µs stage by stage (None without ``stage_calls``); the paths alternate call by call,
    ``rounds * calls`` calls each. With the whole model wrapped (``caller``: the wrapper),
    transformers' own compiled call (``model._compiled_call``, made by the hf-compile variant) is a path too.
    ``profile``: a file to write a cProfile of ``calls`` tuned calls to (sorted by own time; after the timing).
    ``stage_calls``: calls the stage-by-stage means are taken over.
    ``anchors=False``: no path of transformers' recipe (``hf-compiled``, ``hand-model``), e.g. where only aitune's
    setting changed between two runs."""
    args, kwargs, cache, cached = last_decode_call(model, wrapped, prompt, caller)
    dispatch = wrapped._self_dispatch
    _, backend = decode_backend(wrapped)
    normal_args, normal_kwargs = dispatch.signature.normalize(args, kwargs)
    cuda = prompt.is_cuda
    compiled = getattr(backend, "_compiled", None)

    def compiled_call():
        if cuda:
            torch.compiler.cudagraph_mark_step_begin()
        return compiled(*normal_args, **normal_kwargs)

    def hand_call():
        torch.compiler.cudagraph_mark_step_begin()
        return hand_decoder(*args, **kwargs)

    hf_compiled = vars(model).get("_compiled_call") if caller is not None and anchors else None

    def hf_call():
        torch.compiler.cudagraph_mark_step_begin()
        return hf_compiled(*args, **kwargs)

    paths = {"tuned": lambda: wrapped(*args, **kwargs),
             "backend_run": lambda: backend.run(normal_args, normal_kwargs, accepted=True)}  # (as served)
    if compiled is not None:
        paths["compiled"] = compiled_call
    if hand_decoder is not None:
        paths["hand-decoder"] = hand_call
    if hf_compiled is not None and cuda:
        paths["hf-compiled"] = hf_call
    if caller is not None and not cuda and compiled is not None and anchors:
        # transformers does not auto-compile on the CPU by default: its recipe done by hand here, with the options of
        # the tuned decode graph's compile (the C++ wrapper's, where that variant was chosen)
        hand_model = torch.compile(model.__call__, fullgraph=True, dynamic=False,
                                   options=dict(getattr(backend.config, "options", None) or {}) or None)
        paths["hand-model"] = lambda: hand_model(*args, **kwargs)
    host, done = {name: [] for name in paths}, {name: [] for name in paths}
    clock = time.perf_counter_ns

    def rewind():  # before every call: it writes where the recorded one did
        rewind_cache(cache, cached)

    with torch.no_grad():
        for function in paths.values():  # warm-up
            for _ in range(20):
                rewind()
                function()
        names = list(paths)
        for call in range(rounds * calls):  # call by call, the order rotating: drift hits every path alike
            for name in names[call % len(names):] + names[:call % len(names)]:
                rewind()
                sync("cuda" if cuda else "cpu")
                started = clock()
                paths[name]()
                returned = clock()
                sync("cuda" if cuda else "cpu")
                host[name].append((returned - started) / 1e3)
                done[name].append((clock() - started) / 1e3)
    if profile:
        with open(profile, "w") as handle:
            handle.write(f"{calls} tuned decode calls\n")
            stats = profile_calls(paths["tuned"], calls, cuda, before=rewind)
            stats.stream = handle
            stats.sort_stats("tottime").print_stats(45)
    stage_means = stages(wrapped, backend, paths["tuned"], stage_calls, cuda, before=rewind) if stage_calls else None
    base = "compiled" if "compiled" in paths else "backend_run"
    result = {name: {"host_p50_us": round(statistics.median(host[name]), 1),
                     "done_p50_us": round(statistics.median(done[name]), 1)} for name in paths}
    # aitune's dispatch per decode call, and an anchor's call against the same compiled callable: medians of the
    # call-by-call differences
    for name in ("tuned", "hf-compiled", "hand-model"):
        if name in paths:
            result[f"{name} - {base}"] = {key: round(statistics.median(mine - other for mine, other in
                                                                       zip(times[name], times[base])), 1)
                                          for key, times in (("host_p50_us", host), ("done_p50_us", done))}
    return result, {label: round(value, 2) for label, value in stage_means.items()} if stage_means else None


if __name__ == "__main__":
    sys.exit(main())
