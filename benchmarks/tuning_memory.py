"""Issue "Search", point 6: tuning peak memory vs eager inference's peak, for a model with a large output.

The model is an embedding, one hidden layer and an LM head over a 32k vocabulary (random weights); one batch
of ``--batch x --seq`` token ids gives ``batch * seq * vocab`` fp32 logits (8 x 2048 x 32000: 2 GiB). Each
measurement runs in its own process, so neither sees the other's memory:

(a) eager: the model built, then one inference under ``no_grad`` (after one warm-up call);
(b) tune: the model built, then ``ait.tune`` with a realistic candidate set — on CPU Inductor JIT (and its
    freezing variant) and ONNX Runtime, on CUDA the default candidates — performance validation on, default
    probes.

The host figure of each is the process's resident high-water mark (``VmHWM``, NOTE [measuring peak memory] in
aitune/torch/measure/memory.py), reset just before the measured work, so both start from a process holding Python,
PyTorch and the model; on CUDA also ``torch.cuda.max_memory_allocated``. Build steps that run in child
processes (Inductor AOT, TensorRT engines) are not counted; the CPU candidates here build in-process. Target:
``tuning peak <= 1.5 x eager peak + the largest candidate's own weights`` (a candidate that folds or exports
the weights holds its own copy; taken as the model's parameter bytes).

    python -m benchmarks.tuning_memory                       # 8 x 2048 on CPU
    python -m benchmarks.tuning_memory --batch 4 --json out.json
    python -m benchmarks.tuning_memory --probe-reference-gib 8   # probes checked too (their references spilled)
    python -m benchmarks.tuning_memory --device cuda --model bert-base --batch 32   # the H200 figure
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

GiB = 2**30


class TinyLM(torch.nn.Module):
    """Token ids [batch, seq] -> logits [batch, seq, vocab] (fp32)."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.mlp = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids):
        hidden = self.norm(self.embed(input_ids))
        return self.head(hidden + torch.nn.functional.gelu(self.mlp(hidden)))


def build(args) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    if args.model == "bert-base":
        from transformers import BertConfig, BertModel

        model = BertModel(BertConfig()).to(args.device).half().eval()
        ids = torch.randint(0, 30522, (args.batch, args.seq), device=args.device)
        return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    model = TinyLM(args.vocab, args.hidden).to(args.device).eval()
    return model, {"input_ids": torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device)}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def start_measuring(device: str) -> dict:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS (Linux >= 4.0)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    return {"rss_at_start_bytes": _status_kib("VmRSS") * 1024}


def stop_measuring(device: str, figures: dict) -> dict:
    figures["host_peak_bytes"] = _status_kib("VmHWM") * 1024
    if device == "cuda":
        torch.cuda.synchronize()
        figures["device_peak_bytes"] = torch.cuda.max_memory_allocated()
    return figures


def run_eager(args) -> dict:
    model, inputs = build(args)
    with torch.no_grad():
        model(**inputs)  # warm-up (first-call allocations, oneDNN primitive caches)
        figures = start_measuring(args.device)
        output = model(**inputs)
        figures["output_bytes"] = (output if isinstance(output, torch.Tensor) else output[0]).nbytes
        del output
    figures["weights_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    return stop_measuring(args.device, figures)


def run_tune(args) -> dict:
    import aitune.torch as ait
    from aitune.torch.backend import ONNXRuntimeBackend, TorchInductorJitBackend, TorchInductorJitBackendConfig

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    model, inputs = build(args)
    if args.device == "cpu":
        backends = [TorchInductorJitBackend(), TorchInductorJitBackend(TorchInductorJitBackendConfig(freezing=True)),
                    ONNXRuntimeBackend()]
    else:
        backends = None  # the default candidates
    probes = ait.ProbeConfig() if args.probe_reference_gib is None else ait.ProbeConfig(
        max_reference_bytes=int(args.probe_reference_gib * GiB))
    strategy = ait.MaxThroughputStrategy(backends, probe_config=probes)
    wrapped = ait.Module(model, "memory-bench", strategy=strategy)
    figures = start_measuring(args.device)
    started = time.perf_counter()
    report = ait.tune(lambda item: wrapped(**item), [inputs], ready_batches=True, progress=False)
    figures["tune_wall_s"] = time.perf_counter() - started
    stop_measuring(args.device, figures)
    figures["report_peak_memory"] = getattr(report, "peak_memory", None)
    if args.device == "cuda":  # per-candidate sections reset PyTorch's counter; the report folds what it held
        figures["device_peak_bytes"] = max(figures["device_peak_bytes"], report.peak_memory["device_bytes"] or 0)
    figures["rows"] = [{"candidate": row.description, "status": row.status, "probes": row.probes,
                        "device_peak_bytes": row.details.get("device_peak_bytes"),
                        "reason": row.reason[:160]} for row in report.rows]
    print(report.describe(), file=sys.stderr)
    return figures


def child(step: str, args) -> dict:
    command = [sys.executable, "-m", "benchmarks.tuning_memory", "--step", step, "--device", args.device,
               "--model", args.model, "--batch", str(args.batch), "--seq", str(args.seq), "--vocab", str(args.vocab),
               "--hidden", str(args.hidden)]
    if args.probe_reference_gib is not None:
        command += ["--probe-reference-gib", str(args.probe_reference_gib)]
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the {step} step failed (exit {done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", default="tiny-lm", choices=["tiny-lm", "bert-base"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=None, help="default: 2048 (tiny-lm), 128 (bert-base)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--probe-reference-gib", type=float,
                        help="ProbeConfig.max_reference_bytes in GiB (default: aitune's, 1 GiB)")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--step", choices=["eager", "tune"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.seq = args.seq or (128 if args.model == "bert-base" else 2048)
    if args.step:
        figures = run_eager(args) if args.step == "eager" else run_tune(args)
        print(json.dumps(figures))
        return 0

    eager, tune = child("eager", args), child("tune", args)
    weights = eager["weights_bytes"]
    result = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "device": args.device,
              "model": args.model, "batch": args.batch, "seq": args.seq, "vocab": args.vocab, "hidden": args.hidden,
              "command": "python -m benchmarks.tuning_memory " + " ".join(sys.argv[1:]), "eager": eager, "tune": tune}
    kinds = [("host", "host_peak_bytes")] + ([("device", "device_peak_bytes")] if args.device == "cuda" else [])
    print(f"{args.model} b{args.batch} x {args.seq} on {args.device}: output {eager['output_bytes'] / GiB:.2f} GiB, "
          f"weights {weights / GiB:.3f} GiB")
    for kind, key in kinds:
        target = 1.5 * eager[key] + weights
        result[f"{kind}_ratio"] = tune[key] / eager[key]
        result[f"{kind}_target_bytes"] = target
        result[f"{kind}_within_target"] = tune[key] <= target
        print(f"  {kind:6s} eager peak {eager[key] / GiB:6.2f} GiB   tuning peak {tune[key] / GiB:6.2f} GiB   "
              f"ratio {tune[key] / eager[key]:.2f}x   target (1.5 x eager + weights) {target / GiB:6.2f} GiB   "
              f"{'within' if tune[key] <= target else 'OVER'} ({tune[key] / target:.2f} of target)")
    print(f"  tune wall {tune['tune_wall_s']:.0f} s")
    for row in tune["rows"]:
        print(f"    {row['candidate'][:60]:60s} {row['status']:24s} probes {row['probes']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
