"""Attention kernel sweep and kernel-selector end-to-end figures (issue 5, item 7), in one process.

1. Sweep: batch 2, 8 heads, sequence 256/1024/4096, head dim 64/128, fp16 (configurable, ``--causal``): the
   median time of PyTorch's SDPA (its own kernel choice) and of every kernel provider on the same call, and
   the speed-up of each provider against it, timed in alternation with it two ways: each call made from
   Python (launch cost included) and inside CUDA graphs (kernels only; what the KernelOptimizer uses on a
   GPU by default, ``aitune.torch.kernel_forge.optimizer.prepare_calls``). Providers a call is refused by
   are listed with the reason.
2. Plan vs best single provider: for each sweep shape the KernelOptimizer's plan, applied to a module
   that makes that call, timed against the best single provider measured in step 1 (target: >= 1.0x).
3. End-to-end: a pre-norm transformer block (attention + MLP) on eager, Inductor JIT, and the
   KernelSelectorBackend (every provider, Inductor JIT delegate).

Usage (from the repository root, on the GPU machine):
    python -m benchmarks.attention_kernels --json attention.json
    python -m benchmarks.attention_kernels --seq 256 1024 --head-dim 64 --no-block
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

from aitune.torch.backend import KernelSelectorBackend, KernelSelectorBackendConfig, TorchInductorJitBackend
from aitune.torch.kernel_forge import KernelOptimizer
from aitune.torch.kernel_forge.optimizer import prepare_calls
from aitune.torch.kernel_forge.kernel_provider import SageAttentionKernelProvider, SDPACall, TorchSDPAKernelProvider
from aitune.torch.measure.profiling import ProfilingConfig, measure
from aitune.torch.record.samples import record_graphs

logger = logging.getLogger("benchmarks.attention_kernels")


PROVIDER_NAMES = ("flash", "cudnn", "efficient", "math", "sage")
SELECTED = list(PROVIDER_NAMES)


def providers() -> list:
    """The providers picked with ``--providers`` (default: all; PyTorch's math kernel is slow at long sequences)."""
    return [SageAttentionKernelProvider() if name == "sage" else TorchSDPAKernelProvider(name) for name in SELECTED]


class Attention(nn.Module):
    """q, k, v [B, H, L, E] -> SDPA (the call being tuned)."""

    def __init__(self, causal: bool = False):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.norm2(x))


def median_ms(function, device, config: ProfilingConfig) -> float:
    timing = measure(lambda _: function(), [None], [1], device, config)
    return timing.median_round_ms


def sweep(args, device, config) -> list[dict]:
    in_graph = device.type == "cuda"
    rows = []
    for seq in args.seq:
        for head_dim in args.head_dim:
            q, k, v = (torch.randn(args.batch, args.heads, seq, head_dim, device=device, dtype=args.dtype)
                       for _ in range(3))
            call = SDPACall(q, k, v, is_causal=args.causal)
            run_original = lambda c: c.run_original()  # noqa: E731
            original = prepare_calls(run_original, [call], device, in_graph=False)
            graphed = prepare_calls(run_original, [call], device, in_graph=in_graph)
            row = {"seq": seq, "head_dim": head_dim, "causal": args.causal,
                   "original_ms": original.measure(config).median_round_ms,
                   "original_graph_ms": graphed.measure(config).median_round_ms if graphed.in_graph else None,
                   "providers": {}}
            for provider in providers():
                check = provider.supports(call)
                if not check.ok:
                    row["providers"][provider.name] = {"refused": check.reason}
                    continue
                try:  # each provider in alternation with SDPA, timed the same way (as the KernelOptimizer does)
                    base, mine = original.measure_pair(prepare_calls(provider.run, [call], device, in_graph=False),
                                                       config)
                    entry = {"ms": mine.median_round_ms, "speedup": base.median_round_ms / mine.median_round_ms}
                    in_graphs = prepare_calls(provider.run, [call], device, in_graph=graphed.in_graph)
                    entry["graph_timing"] = in_graphs.how
                    if in_graphs.in_graph:
                        base, mine = graphed.measure_pair(in_graphs, config)
                        entry.update(graph_ms=mine.median_round_ms,
                                     graph_speedup=base.median_round_ms / mine.median_round_ms)
                    del in_graphs
                except Exception as exc:  # noqa: BLE001 - a benchmark row, not a crash
                    row["providers"][provider.name] = {"failed": f"{type(exc).__name__}: {exc}"[:200]}
                    continue
                row["providers"][provider.name] = entry
            timed = {name: entry["ms"] for name, entry in row["providers"].items() if "ms" in entry}
            if timed:
                best = min(timed, key=timed.get)
                row["best_provider"], row["best_ms"] = best, timed[best]
            if args.plan:
                module = Attention(args.causal)
                plan = KernelOptimizer(providers(), profiling=config).make_plan(module, [((q, k, v), {})], device)
                with plan.apply(module):
                    row["plan_ms"] = median_ms(lambda: module(q, k, v), device, config)
                row["plan"] = [choice.provider.name for choice in plan.choices]
                if timed:
                    row["plan_vs_best"] = min(row["best_ms"], row["original_ms"]) / row["plan_ms"]
            rows.append(row)
            logger.info("seq %d head_dim %d: %s", seq, head_dim, json.dumps(row))
    return rows


def block(args, device, config) -> dict:
    torch.manual_seed(0)
    model = Block(args.block_dim, args.heads).to(device, args.dtype).eval()
    x = torch.randn(args.batch, args.block_seq, args.block_dim, device=device, dtype=args.dtype)
    graph = record_graphs(model, [((x,), {})])[0]
    figures = {"dim": args.block_dim, "heads": args.heads, "seq": args.block_seq}
    with torch.no_grad():
        figures["eager_ms"] = median_ms(lambda: model(x), device, config)
    inductor = TorchInductorJitBackend().build(model, graph, device, tempfile.mkdtemp())
    figures["inductor_jit_ms"] = median_ms(lambda: inductor(x), device, config)
    selector = KernelSelectorBackend(KernelSelectorBackendConfig(kernel_providers=providers()),
                                     delegate_backend=TorchInductorJitBackend()).build(model, graph, device,
                                                                                       tempfile.mkdtemp())
    figures["kernel_selector_ms"] = median_ms(lambda: selector(x), device, config)
    figures["plan"] = selector.plan.swapped_call_sites()
    with torch.no_grad():
        expected = model(x)
    figures["kernel_selector_max_abs_error"] = float((selector(x) - expected).abs().max())
    logger.info("block: %s", json.dumps(figures))
    return figures


def markdown(rows: list[dict], block_figures: dict | None) -> str:
    names = [provider.name for provider in providers()]
    lines = ["Provider cells: speed-up over SDPA timed from Python / inside CUDA graphs.", "",
             "| seq | head dim | SDPA ms (Python / graph) | " + " | ".join(names) + " | plan | plan ms | plan / best |",
             "|---|---|---|" + "---|" * len(names) + "---|---|---|"]
    for row in rows:
        cells = []
        for name in names:
            entry = row["providers"].get(name, {})
            graph = f" / {entry['graph_speedup']:.2f}x" if "graph_speedup" in entry else ""
            cells.append(f"{entry['speedup']:.2f}x{graph}" if "speedup" in entry else
                         "refused" if "refused" in entry else "failed")
        plan = f"{row['plan_ms']:.3f}" if "plan_ms" in row else ""
        ratio = f"{row['plan_vs_best']:.2f}" if "plan_vs_best" in row else ""
        graph_ms = f" / {row['original_graph_ms']:.3f}" if row.get("original_graph_ms") else ""
        lines.append(f"| {row['seq']} | {row['head_dim']} | {row['original_ms']:.3f}{graph_ms} | " + " | ".join(cells)
                     + f" | {','.join(row.get('plan', [])) or 'SDPA'} | {plan} | {ratio} |")
    if block_figures:
        lines += ["", f"Block dim {block_figures['dim']}, seq {block_figures['seq']}: eager "
                      f"{block_figures['eager_ms']:.3f} ms, inductor_jit {block_figures['inductor_jit_ms']:.3f} ms, "
                      f"kernel_selector {block_figures['kernel_selector_ms']:.3f} ms "
                      f"(plan: {block_figures['plan'] or 'empty'})"]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--causal", action="store_true", help="causal attention (is_causal=True)")
    parser.add_argument("--providers", nargs="+", choices=PROVIDER_NAMES, default=list(PROVIDER_NAMES))
    parser.add_argument("--budget-s", type=float, default=0.5)
    parser.add_argument("--no-plan", dest="plan", action="store_false")
    parser.add_argument("--no-block", dest="block", action="store_false")
    parser.add_argument("--block-dim", type=int, default=1024)
    parser.add_argument("--block-seq", type=int, default=4096)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    SELECTED[:] = args.providers
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    device = torch.device(args.device)
    config = ProfilingConfig(warmup_rounds=5, min_rounds=10, max_rounds=500, time_budget_s=args.budget_s)
    rows = sweep(args, device, config)
    block_figures = block(args, device, config) if args.block else None
    table = markdown(rows, block_figures)
    sys.stdout.write(table + "\n")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       "torch": torch.__version__, "dtype": str(args.dtype), "sweep": rows, "block": block_figures},
                      handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
