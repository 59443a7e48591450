"""The ``aitune`` command line: ``env``, ``demo``, ``report``, ``--version``."""

from __future__ import annotations

import argparse
import logging
import platform
import sys
import zipfile
from pathlib import Path

from aitune import __version__


def _env(_args) -> int:
    import torch
    from tabulate import tabulate

    from aitune.torch.backend import registered_backends

    print(f"aitune {__version__} (independent implementation of the NVIDIA AITune interface)")
    print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA build {torch.version.cuda}, "
          f"CUDA available: {torch.cuda.is_available()}, CPU threads: {torch.get_num_threads()}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        capability = ".".join(map(str, torch.cuda.get_device_capability()))
        print(f"device: {torch.cuda.get_device_name()} (compute capability {capability})")
    else:
        print(f"device: cpu ({platform.processor() or platform.machine()})")
    rows = []
    for name, backend_class in sorted(registered_backends().items()):
        check = backend_class.availability()
        devices = "/".join(sorted(backend_class.device_types))
        versions = ", ".join(f"{k} {v}" for k, v in check.versions.items())
        runs_here = check.ok and device.type in backend_class.device_types
        status = "available" if runs_here else ("not on this device" if check.ok else "unavailable")
        reason = check.reason if not check.ok else ("" if runs_here else f"needs {devices}")
        rows.append([name, backend_class.build_mode.value.upper(), devices, status, versions, reason])
    print(tabulate(rows, headers=["backend", "build", "devices", "status", "versions", "reason / fix"],
                   tablefmt="github"))
    return 0


def _unknown_backend(names: list[str] | None) -> str | None:
    """The one-line error for the first unknown backend name (it lists the registered ones), else None."""
    from aitune.errors import UnknownBackendError
    from aitune.torch.backend import get_backend_class

    for name in names or []:
        try:
            get_backend_class(name)
        except UnknownBackendError as exc:
            return str(exc)
    return None


def _demo(args) -> int:
    error = _unknown_backend(args.backends)
    if error:
        print(f"aitune demo: {error}", file=sys.stderr)
        return 2
    from aitune.demo import run

    result = run(backends=args.backends, cache_dir=args.cache_dir, save_path=args.save)
    worst = min(result["cosine"])
    print(f"\nselected: {result['selected']}; lowest cosine similarity vs eager: {worst:.6f}")
    return 0 if worst >= 0.99 else 1


def _report(args) -> int:
    """Text (as ``describe``) or, with ``--html``, one HTML page, from a tune report JSON or a ``.ait`` checkpoint.

    A checkpoint is read through its manifest only (digests verified, no code loaded: ``describe_checkpoint``'s
    path); it keeps only the chosen backend's row per graph.
    """
    from aitune.errors import AITuneError
    from aitune.torch.checkpoint import describe_checkpoint
    from aitune.torch.checkpoint.manifest import read_manifest
    from aitune.torch.report import TuneReport
    from aitune.torch.report_html import REPORT_EXTRA, figures_available

    path = Path(args.file)
    try:
        checkpoint = path.suffix == ".ait" or zipfile.is_zipfile(path)
        if args.html is None:
            print(describe_checkpoint(path) if checkpoint else TuneReport.from_json(path).describe())
            return 0
        report = TuneReport.from_manifest(read_manifest(path)[0], path) if checkpoint else TuneReport.from_json(path)
        output = Path(args.html) if args.html else path.with_suffix(".html")
        report.to_html(output)
    except (AITuneError, OSError) as exc:
        print(f"aitune report: {exc}", file=sys.stderr)
        return 1
    if not figures_available():
        print(f"aitune report: the page has tables only; figures need matplotlib: {REPORT_EXTRA}", file=sys.stderr)
    print(output)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aitune", description="Tune PyTorch models for inference.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument("--version", action="version", version=f"aitune {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("env", help="what runs here: every backend's availability, versions, device")
    demo = commands.add_parser("demo", help="tune the all-MiniLM-L6-v2 sentence encoder on this machine")
    demo.add_argument("--backends", nargs="+", metavar="NAME", help="backend names to try (default: all available)")
    demo.add_argument("--cache-dir", help="aitune cache directory (default: $AITUNE_CACHE_DIR or ~/.cache/aitune)")
    demo.add_argument("--save", metavar="FILE.ait", help="also save the tuned encoder as a checkpoint")
    report = commands.add_parser(
        "report", help="print a tune report (JSON) or what a .ait checkpoint holds (loads no code); --html: a page",
        description="FILE: a tune report (<cache>/reports/tune-*.json, written by ait.tune) or a .ait checkpoint "
                    "(read from its manifest; no code is loaded from it).")
    report.add_argument("file", metavar="FILE")
    report.add_argument("--html", nargs="?", const="", default=None, metavar="OUT",
                        help="write one self-contained HTML page (default: FILE with .html) and print its path; "
                             "figures need matplotlib: pip install 'aitune[report]'")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("torch", "onnxscript", "onnx_ir", "torchao", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    handlers = {"env": _env, "demo": _demo, "report": _report}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
