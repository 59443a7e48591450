"""Issue "Search" on the GPU: aitune's default tune vs hand-picked ``torch.compile`` anchors, in one process.

For one model (random weights; a convnet's BatchNorm statistics are first calibrated on random data — a
few forward passes in train mode — because random init leaves mean 0 / variance 1 and fp16 activations then
explode, so the comparison would be about the init, not the backend):

1. hand-picked anchors, timed with CUDA events: eager, ``torch.compile(mode="reduce-overhead")``, and the
   best hand-picked composite of the issue (reduce-overhead + Inductor freezing, plus channels-last for
   convnets);
2. ``ait.tune`` with the default candidates (wall time, tuning peak GPU memory), then the tuned module, the
   chosen backend called directly and eager re-timed the same way;
3. a second tune of a fresh wrapper in the same environment (same cache dir): its wall time.

``--dtype float32`` runs the fp32 model instead (the default is fp16, as the issue's targets); it adds the
hand-picked anchor reduce-overhead + freezing + bf16 autocast, and ``--allow-reduced-precision`` lets the
tune select aitune's bf16-autocast variant.

Prints one table and writes JSON. Usage (device tool, repo root)::

    python3 -m benchmarks.gpu_search --model resnet50 --batch 1 --json $OUT/resnet50.json
    python3 -m benchmarks.gpu_search --model bert-base --batch 32 --json $OUT/bert.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

import aitune.torch as ait
from aitune.torch.backend.compile_settings import parameter_freezing
from aitune.torch.measure.profiling import ProfilingConfig, Timer, interleaved_round_ms


def resnet50(batch: int, dtype: torch.dtype = torch.float16):
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50().cuda().to(dtype)
    calibrate_batchnorm(model, (32, 3, 224, 224))
    return model.eval(), {"x": torch.randn(batch, 3, 224, 224, device="cuda", dtype=dtype)}


def bert_base(batch: int, seq: int = 128, dtype: torch.dtype = torch.float16):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig()).cuda().to(dtype).eval()
    ids = torch.randint(0, 30522, (batch, seq), device="cuda")
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def calibrate_batchnorm(model: torch.nn.Module, shape: tuple, passes: int = 8) -> None:
    """BatchNorm running statistics from a few train-mode passes on random data (weights untouched)."""
    model.train()
    with torch.no_grad():
        for _ in range(passes):
            model(torch.randn(*shape, device="cuda", dtype=next(model.parameters()).dtype))
    model.eval()


def p50_ms(function, seconds: float = 2.0, warmup: int = 30) -> float:
    timer = Timer(torch.device("cuda"))
    with torch.no_grad():
        for _ in range(warmup):
            function()
        torch.cuda.synchronize()
        times, started = [], time.perf_counter()
        while time.perf_counter() - started < seconds or len(times) < 50:
            times.append(timer(function))
    return statistics.median(times)


def paired_p50_ms(first, second, seconds: float = 4.0, warmup: int = 30) -> tuple[float, float, float]:
    """Two callables timed call by call in alternation (CUDA events, GPU synchronised after each call;
    ``aitune.torch.measure.profiling.interleaved_round_ms``): ``(p50 of first, p50 of second, p50 of first/second per
    pair)``. On a lent machine whose speed drifts by more than the difference measured (RESULTS.md: the same
    callable 0.51-0.55 ms across rounds), alternating every call puts both under the same conditions; the
    per-pair ratio's median is the figure to quote."""
    config = ProfilingConfig(warmup_rounds=warmup, warmup_s=0.0, min_rounds=100, max_rounds=10**9,
                             time_budget_s=seconds, stable_rel_error=0.0)
    a, b = interleaved_round_ms([first, second], torch.device("cuda"), config)
    return statistics.median(a), statistics.median(b), statistics.median(x / y for x, y in zip(a, b))


def max_error(a, b) -> float:
    first = a if isinstance(a, torch.Tensor) else a[0]
    second = b if isinstance(b, torch.Tensor) else b[0]
    return float((first.float() - second.float()).abs().max())


def anchors(model, inputs, conv: bool, bf16: bool = False) -> dict:
    """Hand-picked torch.compile runs (each its own compiled copy where the memory format changes)."""
    results = {}
    with torch.no_grad():
        expected = model(**inputs)

        def run_compiled(compiled, call_inputs, freezing=False, autocast=False):
            def call():  # freezing as the PyTorch docs switch it on: the global flag while tracing and running
                torch.compiler.cudagraph_mark_step_begin()
                with parameter_freezing(freezing), torch.autocast("cuda", torch.bfloat16, enabled=autocast):
                    return compiled(**call_inputs)
            return call

        reduce_overhead = torch.compile(model, mode="reduce-overhead")
        call = run_compiled(reduce_overhead, inputs)
        anchors.reduce_overhead_call = call  # timed again beside the tuned module, call by call
        results["hand-picked reduce-overhead"] = {"p50_ms": p50_ms(call), "max_abs_error": max_error(call(), expected)}
        if conv:
            composite_model = copy.deepcopy(model).to(memory_format=torch.channels_last)
            composite_inputs = inputs  # as aitune's variant: the compiled graph converts the input
            label = "hand-picked reduce-overhead + freezing + channels_last"
        else:
            composite_model, composite_inputs = model, inputs
            label = "hand-picked reduce-overhead + freezing"
        composite = torch.compile(composite_model, mode="reduce-overhead")
        anchors.compiled = composite
        call = run_compiled(composite, composite_inputs, freezing=True)
        results[label] = {"p50_ms": p50_ms(call), "max_abs_error": max_error(call(), expected)}
        if bf16:  # an fp32 model: the same composite under bf16 autocast
            call = run_compiled(torch.compile(copy.deepcopy(composite_model), mode="reduce-overhead"),
                                composite_inputs, freezing=True, autocast=True)
            results[label + " + bf16 autocast"] = {"p50_ms": p50_ms(call),
                                                   "max_abs_error": max_error(call(), expected)}
    return results


def row_facts(rows) -> list[dict]:
    """What the JSON keeps of each report row: status, reason, build seconds, seconds per later phase, p50, and
    the device memory's high-water mark during the candidate's evaluation and what it kept after it."""
    return [{"description": r.description, "status": r.status, "reason": r.reason, "build_s": r.build_s,
             "phase_s": r.details.get("phase_s"), "p50_ms": (r.measurement or {}).get("p50_ms"),
             "device_peak_bytes": r.details.get("device_peak_bytes"),
             "device_retained_bytes": r.details.get("device_retained_bytes"),
             "speedup": r.speedup} for r in rows]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["resnet50", "bert-base"], required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--json")
    parser.add_argument("--time-budget-s", type=float, help="ait.tune(time_budget_s=...) (default: none)")
    parser.add_argument("--atol", type=float, help="fp16 tolerance (default: aitune's)")
    parser.add_argument("--no-second-tune", action="store_true", help="skip the second tune (item 3)")
    parser.add_argument("--diagnose", action="store_true", help="time the chosen backend's layers separately")
    parser.add_argument("--dtype", choices=["float16", "float32"], default="float16")
    parser.add_argument("--allow-reduced-precision", action="store_true",
                        help="MaxThroughputStrategy(allow_reduced_precision=True)")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("aitune").setLevel(logging.INFO)  # the tune's timeline (building / passed lines) in the log
    torch.backends.cudnn.benchmark = True
    model, inputs = resnet50(args.batch, dtype) if args.model == "resnet50" else bert_base(args.batch, dtype=dtype)
    conv = args.model == "resnet50"
    result = {"model": args.model, "batch": args.batch, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "dtype": args.dtype,
              "allow_reduced_precision": args.allow_reduced_precision}

    torch.cuda.reset_peak_memory_stats()
    eager_ms = p50_ms(lambda: model(**inputs))
    result["eager_inference_peak_bytes"] = torch.cuda.max_memory_allocated()

    if conv:  # what cuDNN's autotuner (cudnn.benchmark) alone takes the first time a new memory format runs
        cl_model = copy.deepcopy(model).to(memory_format=torch.channels_last)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            cl_model(**inputs)
        torch.cuda.synchronize()
        result["eager_channels_last_first_call_peak_bytes"] = torch.cuda.max_memory_allocated()
        del cl_model
        torch.cuda.empty_cache()

    strategy, settings = None, {}
    if args.atol is not None:
        settings["tolerance"] = ait.Tolerance(low_precision_atol=args.atol, low_precision_rtol=args.atol)
    if args.allow_reduced_precision:
        settings["allow_reduced_precision"] = True
    if settings:
        strategy = ait.MaxThroughputStrategy(**settings)
    wrapped = ait.Module(model, f"{args.model}-b{args.batch}", strategy=strategy)
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    report = ait.tune(lambda item: wrapped(**item), [inputs], progress=False, time_budget_s=args.time_budget_s, ready_batches=True)
    result["tune_wall_s"] = time.perf_counter() - started
    # the report's figure: per-candidate sections reset PyTorch's counter and fold what it held (aitune/torch/measure/memory.py)
    result["tuning_peak_bytes"] = max(report.peak_memory["device_bytes"] or 0, torch.cuda.max_memory_allocated())
    gc.collect()  # what stays allocated once the tune is over (chosen backend, guard fallbacks, anything leaked)
    result["allocated_after_tune_bytes"] = torch.cuda.memory_allocated()
    print(report.describe())
    chosen = next(iter(wrapped.backends.values()))
    rows = report.rows
    passing = [r for r in rows if r.status in ("passed", "selected") and r.measurement]
    best = max(passing, key=lambda r: r.measurement["throughput"])
    selected = next(r for r in rows if r.status == "selected")
    result["selected"] = selected.description
    result["tuned_over_best_candidate"] = selected.measurement["throughput"] / best.measurement["throughput"]
    result["rows"] = row_facts(rows)

    result["anchors"] = anchors(model, inputs, conv, bf16=dtype == torch.float32)
    with torch.no_grad():
        kwargs = chosen.graph.signature.normalize((), inputs)[1]
        # the wrapper's cost: the tuned module and its chosen backend called directly, alternating call by call
        result["tuned_module_p50_ms"], result["chosen_direct_p50_ms"], result["wrapper_ratio_p50"] = paired_p50_ms(
            lambda: wrapped(**inputs), lambda: chosen.run((), kwargs))
        _, _, result["hand_picked_ro_over_tuned_paired"] = paired_p50_ms(anchors.reduce_overhead_call,
                                                                        lambda: wrapped(**inputs))
        result["eager_p50_ms"] = min(eager_ms, p50_ms(lambda: model(**inputs)))

    if args.diagnose:  # the tuner's own runners-up, timed directly after tuning (vs their in-tuner figures)
        for index, graph_guard in enumerate(wrapped._self_dispatch.guards().values()):
            for position, runner_up in enumerate(graph_guard.fallbacks):
                with torch.no_grad():
                    result[f"diag_runner_up{position}_{runner_up.describe()}_p50_ms"] = p50_ms(
                        lambda: runner_up.run((), kwargs))
    if args.diagnose:  # where the time goes between a compiled callable and the wrapped module
        from aitune.torch.backend import TorchInductorJitBackend, TorchInductorJitBackendConfig

        config = TorchInductorJitBackendConfig(mode="reduce-overhead", freezing=True,
                                               memory_format="channels_last" if conv else None)
        probe = ait.Module(model, f"{args.model}-diag", strategy=ait.OneBackendStrategy(
            TorchInductorJitBackend(config)).enable_performance_validation(False))
        ait.tune(lambda item: probe(**item), [inputs], progress=False, ready_batches=True)
        backend = probe.backends["graph0"]
        diag_kwargs = backend.graph.signature.normalize((), inputs)[1]
        compiled = backend._compiled
        raw_inputs = diag_kwargs
        anchor = anchors.compiled  # the hand-picked composite, compiled by anchors()
        with torch.no_grad():
            def raw():
                torch.compiler.cudagraph_mark_step_begin()
                with parameter_freezing(True):
                    return compiled(**raw_inputs)

            def hand_picked():
                torch.compiler.cudagraph_mark_step_begin()
                with parameter_freezing(True):
                    return anchor(**raw_inputs)
            for round_ in range(2):  # A/B/A/B: the same clock conditions for both
                result[f"diag{round_}_hand_picked_composite_p50_ms"] = p50_ms(hand_picked)
                result[f"diag{round_}_our_compiled_raw_p50_ms"] = p50_ms(raw)
            result["diag_backend_private_run_p50_ms"] = p50_ms(lambda: backend._run((), diag_kwargs))
            result["diag_backend_run_p50_ms"] = p50_ms(lambda: backend.run((), diag_kwargs))
            result["diag_module_p50_ms"] = p50_ms(lambda: probe(**inputs))
        try:
            from torch._dynamo.eval_frame import _debug_get_cache_entry_list

            result["diag_dynamo_cache_entries"] = len(_debug_get_cache_entry_list(type(model).forward.__code__))
        except Exception as exc:  # noqa: BLE001 - diagnostics only
            result["diag_dynamo_cache_entries"] = repr(exc)
        print({key: value for key, value in result.items() if key.startswith("diag_")})

    if not args.no_second_tune:
        second = ait.Module(model, f"{args.model}-b{args.batch}-again", strategy=copy.deepcopy(strategy))
        started = time.perf_counter()
        again = ait.tune(lambda item: second(**item), [inputs], progress=False, time_budget_s=args.time_budget_s,
                         ready_batches=True)
        result["second_tune_wall_s"] = time.perf_counter() - started
        result["second_tune_rows"] = row_facts(again.rows)
        result["second_tune_selected"] = again.graphs[0].selected

    reduce_overhead = result["anchors"]["hand-picked reduce-overhead"]["p50_ms"]
    best_anchor = min(value["p50_ms"] for value in result["anchors"].values())
    tuned = result["tuned_module_p50_ms"]
    print(f"\n## {args.model} batch {args.batch} on {result['gpu']} (torch {result['torch']}, {args.dtype})")
    print(f"eager {result['eager_p50_ms']:.3f} ms")
    for label, value in result["anchors"].items():
        print(f"{label}: {value['p50_ms']:.3f} ms (max abs err {value['max_abs_error']:.3g})")
    print(f"tuned module ({result['selected']}): {tuned:.3f} ms; chosen backend direct "
          f"{result['chosen_direct_p50_ms']:.3f} ms, timed alternately (wrapper: median per-pair ratio "
          f"{100 * (result['wrapper_ratio_p50'] - 1):+.1f} %)")
    print(f"tuned vs hand-picked reduce-overhead: {reduce_overhead / tuned:.3f}x; vs best hand-picked "
          f"{best_anchor / tuned:.3f}x; vs eager {result['eager_p50_ms'] / tuned:.2f}x; tuned/best candidate "
          f"throughput {result['tuned_over_best_candidate']:.3f}")
    print(f"tuned vs hand-picked reduce-overhead, timed alternately call by call (median per-pair ratio): "
          f"{result['hand_picked_ro_over_tuned_paired']:.3f}x")
    second_tune = f"{result['second_tune_wall_s']:.1f} s" if "second_tune_wall_s" in result else "not run"
    print(f"tune wall {result['tune_wall_s']:.1f} s, second tune {second_tune}; tuning peak GPU "
          f"memory {result['tuning_peak_bytes'] / 2**30:.2f} GiB vs eager inference {result['eager_inference_peak_bytes'] / 2**30:.2f} GiB")
    for row in result["rows"]:
        if row.get("device_peak_bytes") is not None:
            print(f"  {row['description'][:60]:60s} device peak {row['device_peak_bytes'] / 2**30:.2f} GiB, kept "
                  f"{row['device_retained_bytes'] / 2**30:.2f} GiB")
    print(f"allocated after the tune: {result['allocated_after_tune_bytes'] / 2**30:.2f} GiB")
    if "eager_channels_last_first_call_peak_bytes" in result:
        print(f"eager channels_last first call (cuDNN autotuning a new format): "
              f"{result['eager_channels_last_first_call_peak_bytes'] / 2**30:.2f} GiB")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
