"""How long the AOTInductor canary (NOTE [AOTInductor canary] in aitune/torch/backend/inductor_aot/canary.py) takes to
compile on this machine, cold and warm, before it loads the package (on the H200 machine the load kills the
process: run it last). Prints one timestamped line per phase, flushed, so a crash leaves the figures.

Usage (repo root): ``python3 -m benchmarks.aoti_canary_time [--device cpu|cuda] [--no-load] [--no-pch]``
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

started = time.perf_counter()


def say(text: str) -> None:
    print(f"{time.perf_counter() - started:7.2f} s  {text}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-load", action="store_true")
    parser.add_argument("--no-pch", action="store_true", help="aot_inductor.precompile_headers off")
    args = parser.parse_args(argv)
    import torch

    from aitune.torch.backend.inductor_aot import load_package
    from aitune.torch.backend.inductor_aot.canary import Canary
    say(f"imported torch {torch.__version__}")
    folder = Path(tempfile.mkdtemp())
    example = torch.ones(2, 4, device=args.device)
    for round_ in ("cold", "warm"):
        exported = torch.export.export(Canary().to(args.device), (example,))
        say(f"{round_}: exported")
        package = folder / f"canary_{round_}.pt2"
        configs = {"aot_inductor.precompile_headers": False} if args.no_pch else None
        torch._inductor.aoti_compile_and_package(exported, package_path=str(package), inductor_configs=configs)
        say(f"{round_}: compiled and packaged ({package.stat().st_size} bytes)")
    if not args.no_load:
        say("loading (the H200 machine's torch build crashes here)")
        output = load_package(package, torch.device(args.device))(example)
        say(f"loaded and ran: {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
