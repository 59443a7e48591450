"""Does channels-last help Inductor reduce-overhead + freezing on ResNet-50 b1 (H200, fp16)? Timed call by call.

The channels-last variant is an extra (tier-1) candidate, built only with a time budget, because separate
2-second windows did not agree on whether it is ahead (see RESULTS.md). This settles it in
one process: two aitune modules, each tuned with one backend (RO + freezing; RO + freezing + channels-last),
and the hand-picked ``torch.compile(mode="reduce-overhead")``, timed alternately call by call
(``paired_p50_ms``: median per-pair ratio).

Usage (device tool, repo root)::

    python3 -m benchmarks.gpu_channels_last --json $OUT/channels_last.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import aitune.torch as ait
from aitune.torch.backend import TorchInductorJitBackend, TorchInductorJitBackendConfig
from benchmarks.gpu_search import paired_p50_ms, resnet50


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args(argv)
    torch.backends.cudnn.benchmark = True
    model, inputs = resnet50(args.batch)
    result = {"batch": args.batch, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    modules = {}
    for label, memory_format in (("ro_freezing", None), ("ro_freezing_channels_last", "channels_last")):
        config = TorchInductorJitBackendConfig(mode="reduce-overhead", freezing=True, memory_format=memory_format)
        strategy = ait.OneBackendStrategy(TorchInductorJitBackend(config)).enable_performance_validation(False)
        wrapped = ait.Module(model, f"cl-{label}", strategy=strategy)
        started = time.perf_counter()
        ait.tune(lambda item, wrapped=wrapped: wrapped(**item), [inputs], progress=False, ready_batches=True)
        result[f"{label}_tune_s"] = time.perf_counter() - started
        modules[label] = wrapped
    hand_picked = torch.compile(model, mode="reduce-overhead")

    def reduce_overhead():
        torch.compiler.cudagraph_mark_step_begin()
        return hand_picked(**inputs)

    with torch.no_grad():
        expected = model(**inputs)
        for label, wrapped in modules.items():
            result[f"{label}_max_abs_error"] = float((wrapped(**inputs) - expected).abs().max())
        plain, channels_last = (lambda: modules["ro_freezing"](**inputs)), (lambda: modules["ro_freezing_channels_last"](**inputs))
        for round_ in range(2):  # twice, to see the pairing hold
            a, b, ratio = paired_p50_ms(plain, channels_last)
            result[f"round{round_}"] = {"ro_freezing_ms": a, "ro_freezing_channels_last_ms": b,
                                        "ro_freezing_over_channels_last": ratio}
            for label, call in (("ro_freezing", plain), ("ro_freezing_channels_last", channels_last)):
                _, _, speedup = paired_p50_ms(reduce_overhead, call)
                result[f"round{round_}"][f"hand_picked_ro_over_{label}"] = speedup
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
