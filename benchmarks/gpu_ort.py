"""Is ONNX Runtime's CUDA EP a contender on the GPU: plain, with CUDA graphs, with transformer fusions?

For ResNet-50 fp16 (torchvision, BatchNorm calibrated; batches 1 and 32, one recorded graph holding both) and
BERT-base fp16 (random weights, batch 32 x 128 tokens): eager, the hand-picked
``torch.compile(mode="reduce-overhead")``, and ``ONNXRuntimeBackend`` variants each built directly with
``backend.build`` on the recorded graph — plain CUDA EP, ``cuda_graph``, for ResNet-50 ``prefer_nhwc`` with and
without graphs, and for BERT ``transformer_fusions="bert"`` and both. ``--kernel-profile`` adds each path's GPU kernel
time per call by kind (attention, matmul/conv, layer norm, copies, other), Inductor's default mode beside ONNX
Runtime's variants without CUDA graphs: where ONNX Runtime's time goes. Every path is timed with CUDA events in
interleaved rounds (each round times ``--calls`` calls of every path in turn); the figure is the median per-call ms over rounds, with ratios vs eager and vs reduce-overhead, the
max abs error vs eager, and where ONNX Runtime ran the nodes (``build_info["node_placement"]``). A build that
fails is reported with its error (a CUDA-graph build refused by ONNX Runtime names the nodes off the CUDA EP).

Usage (GPU machine, repo root)::

    python -m benchmarks.gpu_ort --json $OUT/gpu_ort.json
    python -m benchmarks.gpu_ort --models bert_b32 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

MODELS = ("resnet50", "bert_b32")
RESNET_BATCHES = (1, 32)


def ort_variants(model_name: str) -> dict[str, dict]:
    """ONNXRuntimeBackendConfig keyword arguments per variant label."""
    variants = {"ort": {}, "ort+cuda_graph": {"cuda_graph": True}}
    if model_name == "resnet50":
        variants.update({"ort+nhwc": {"prefer_nhwc": True},
                         "ort+nhwc+cuda_graph": {"prefer_nhwc": True, "cuda_graph": True}})
    if model_name.startswith("bert"):
        variants.update({"ort+fusions": {"transformer_fusions": "bert"},
                         "ort+fusions+cuda_graph": {"transformer_fusions": "bert", "cuda_graph": True}})
    return variants


def summarize(times_ms: dict[str, list[float]], eager: str = "eager",
              reference: str = "reduce-overhead") -> dict[str, dict]:
    """Per path: median per-call ms over rounds, and its ratios (``eager_ms / path_ms``: > 1 is faster than
    eager; likewise vs the reduce-overhead path), None where a path did not run."""
    medians = {label: statistics.median(values) for label, values in times_ms.items() if values}
    summary = {}
    for label, median in medians.items():
        summary[label] = {
            "median_ms": median, "rounds_ms": times_ms[label],
            "speedup_vs_eager": medians[eager] / median if eager in medians else None,
            "speedup_vs_reduce_overhead": medians[reference] / median if reference in medians else None,
        }
    return summary


def max_abs_error(expected, actual) -> float:
    """Max abs difference over the tensor leaves of two outputs of the same structure."""
    from aitune.torch.record.pytree import tree_flatten

    pairs = zip(tree_flatten(expected)[0], tree_flatten(actual)[0], strict=True)
    return max((float((a.float() - b.float()).abs().max()) for a, b in pairs if isinstance(a, torch.Tensor)),
               default=0.0)


def timed_rounds(paths: dict, rounds: int, calls: int) -> dict[str, list[float]]:
    """Per-call ms of every path per round (CUDA events around ``calls`` calls), the paths interleaved."""
    times: dict[str, list[float]] = {label: [] for label in paths}
    for _ in range(rounds):
        for label, call in paths.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(calls):
                call()
            end.record()
            torch.cuda.synchronize()
            times[label].append(start.elapsed_time(end) / calls)
    return times


KERNEL_KINDS = (  # (kind, substrings of a CUDA kernel's name, lower case), first match wins
    ("copy/transpose", ("nchwtonhwc", "nhwctonchw", "transpose", "memcpy", "memset", "copy", "permute")),
    ("attention", ("fmha", "flash", "attention", "softmax", "mha")),
    ("matmul/conv", ("gemm", "cutlass", "xmma", "cublas", "nvjet", "fprop", "implicit", "winograd", "dgrad",
                     "wgrad", "bmm", "triton_tem")),
    ("layer norm", ("layernorm", "layer_norm", "skiplayernorm", "native_layer_norm", "rms")),
)  # (cuDNN's op_generic_tensor_kernel, its tensor add, falls in "other")


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    for kind, needles in KERNEL_KINDS:
        if any(needle in lowered for needle in needles):
            return kind
    return "other (elementwise, reductions, fused)"


def kernel_profile(paths: dict, calls: int = 10) -> dict[str, dict]:
    """GPU kernel time per call of each path, by kind of kernel, from ``torch.profiler`` (CUPTI sees every kernel of
    the process, ONNX Runtime's too): ``{path: {"total_us": .., "kernels": n per call, "by_kind_us": {...},
    "top": [(name, us per call), ...]}}``. Paths that replay CUDA graphs show as graph launches, so profile paths
    without them."""
    from torch.profiler import ProfilerActivity, profile

    result = {}
    for label, call in paths.items():
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                call()
            torch.cuda.synchronize()
        by_kind: dict[str, float] = {}
        by_name: dict[str, float] = {}
        count = 0
        for event in prof.events():
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            duration = event.time_range.elapsed_us()  # (a device event's span: the kernel or copy itself)
            if duration <= 0:
                continue
            count += 1
            by_kind[kernel_kind(event.name)] = by_kind.get(kernel_kind(event.name), 0.0) + duration / calls
            by_name[event.name] = by_name.get(event.name, 0.0) + duration / calls
        top = sorted(by_name.items(), key=lambda item: -item[1])[:8]
        result[label] = {"total_us": sum(by_kind.values()), "kernels": count / calls,
                         "by_kind_us": dict(sorted(by_kind.items(), key=lambda item: -item[1])),
                         "top": [(name[:120], round(us, 1)) for name, us in top]}
        print(f"  kernels of {label}: {result[label]['total_us']:.1f} us GPU per call in "
              f"{result[label]['kernels']:.0f} kernels; " + ", ".join(
                  f"{kind} {us:.1f}" for kind, us in result[label]["by_kind_us"].items()), flush=True)
    return result


def build_ort(model, calls_inputs: list[dict], config_kwargs: dict, workdir: Path):
    """An ONNXRuntimeBackend built on the graph recorded from ``calls_inputs`` (keyword inputs per call)."""
    from aitune.torch.backend import ONNXRuntimeBackend, ONNXRuntimeBackendConfig
    from aitune.torch.record.samples import record_graphs

    [graph] = record_graphs(model, [((), inputs) for inputs in calls_inputs])
    backend = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(**config_kwargs))
    started = time.perf_counter()
    backend.build(model, graph, "cuda", workdir)
    return backend, time.perf_counter() - started


def run_model(model_name: str, args, workroot: Path) -> dict:
    from benchmarks.gpu_search import bert_base, resnet50

    if model_name == "resnet50":
        model, _ = resnet50(1)
        cases = {f"b{b}": {"x": torch.randn(b, 3, 224, 224, device="cuda", dtype=torch.float16)}
                 for b in RESNET_BATCHES}
    else:
        model, inputs = bert_base(32, 128)
        cases = {"b32x128": inputs}
    result: dict = {"builds": {}, "cases": {}}
    with torch.no_grad():
        expected = {case: model(**inputs) for case, inputs in cases.items()}
        hand = torch.compile(model, mode="reduce-overhead")
        backends = {}
        chosen = set(args.variants.split(",")) if args.variants else None
        unknown = sorted((chosen or set()) - set(ort_variants(model_name)))
        if unknown:
            raise SystemExit(f"gpu_ort: unknown variant(s) {unknown} for {model_name}; "
                             f"choose from {sorted(ort_variants(model_name))}")
        for label, config_kwargs in ort_variants(model_name).items():
            if chosen is not None and label not in chosen:
                continue
            try:
                backend, build_s = build_ort(model, list(cases.values()), config_kwargs, workroot / model_name / label)
            except Exception as exc:  # noqa: BLE001 - reported in the results, the other paths still run
                result["builds"][label] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                print(f"{model_name} {label}: build failed: {exc}", file=sys.stderr, flush=True)
                continue
            info = backend.build_info
            result["builds"][label] = {
                "build_s": build_s, "node_placement": info.get("node_placement"),
                "placement_note": info.get("placement_note"), "cuda_graphs": info.get("cuda_graphs"),
                "transformer_fusions": info.get("transformer_fusions"), "exporter": info.get("exporter")}
            backends[label] = backend
        for case, inputs in cases.items():
            def compiled(inputs=inputs):
                torch.compiler.cudagraph_mark_step_begin()
                return hand(**inputs)

            paths = {"eager": lambda inputs=inputs: model(**inputs), "reduce-overhead": compiled}
            paths.update({label: (lambda backend=backend, inputs=inputs: backend(**inputs))
                          for label, backend in backends.items()})
            errors = {}
            for label, call in list(paths.items()):
                try:
                    for _ in range(3):  # warm-up (compiles, captures)
                        output = call()
                    errors[label] = max_abs_error(expected[case], output)
                except Exception as exc:  # noqa: BLE001 - a path that cannot run this case is reported, not timed
                    errors[label] = f"{type(exc).__name__}: {exc}"[:500]
                    del paths[label]
            summary = summarize(timed_rounds(paths, args.rounds, args.calls))
            for label, error in errors.items():
                summary.setdefault(label, {})["max_abs_error_vs_eager"] = error
            result["cases"][case] = summary
            if args.kernel_profile:  # why ONNX Runtime is slower: its kernels against Inductor's, no CUDA graphs
                default = torch.compile(model)
                profiled = {"inductor (default mode)": lambda inputs=inputs: default(**inputs)}
                profiled.update({label: (lambda backend=backend, inputs=inputs: backend(**inputs))
                                 for label, backend in backends.items() if "cuda_graph" not in label})
                try:
                    summary["kernel_profile"] = kernel_profile(profiled)
                except Exception as exc:  # noqa: BLE001 - the timings above stand without it
                    summary["kernel_profile"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                    print(f"{model_name} {case}: kernel profile failed: {exc}", file=sys.stderr, flush=True)
            print(f"{model_name} {case}: " + ", ".join(
                f"{label} {row['median_ms']:.3f} ms ({row['speedup_vs_eager']:.2f}x eager)"
                for label, row in summary.items() if isinstance(row, dict) and "median_ms" in row), flush=True)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=50, help="calls per path per round")
    parser.add_argument("--variants", help="only these ONNX Runtime variants (comma-separated labels)")
    parser.add_argument("--kernel-profile", action="store_true",
                        help="also each path's GPU kernel time by kind (torch.profiler), paths without CUDA graphs")
    args = parser.parse_args(argv)
    models = [name.strip() for name in args.models.split(",") if name.strip()]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    if not torch.cuda.is_available():
        print("gpu_ort: no CUDA device", file=sys.stderr)
        return 2
    import onnxruntime

    torch.backends.cudnn.benchmark = True
    result = {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__,
              "providers": onnxruntime.get_available_providers(), "gpu": torch.cuda.get_device_name(),
              "rounds": args.rounds, "calls": args.calls, "date": time.strftime("%Y-%m-%d"), "models": {}}

    def save():
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2, default=str))

    with tempfile.TemporaryDirectory(prefix="gpu_ort_") as workroot:
        for name in models:
            started = time.perf_counter()
            try:
                result["models"][name] = run_model(name, args, Path(workroot))
            except Exception:  # noqa: BLE001 - the other models still run
                result["models"][name] = {"error": traceback.format_exc()[-3000:]}
                print(result["models"][name]["error"], file=sys.stderr, flush=True)
            result["models"].setdefault(name, {})["wall_s"] = time.perf_counter() - started
            torch.cuda.empty_cache()
            save()
    print(json.dumps(result, default=str)[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
