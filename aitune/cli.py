"""The ``aitune`` command line: ``env``, ``demo``, ``report``, ``export``, ``serve``, ``--version``."""

from __future__ import annotations

import argparse
import logging
import os
import platform
import shutil
import sys
import zipfile
from pathlib import Path

from aitune import __version__
from aitune.errors import AITuneError, UnknownBackendError


def _env(args) -> int:
    import torch
    from tabulate import tabulate

    from aitune.torch.backend import registered_backends
    from aitune.torch.search.crashes import FILE_NAME, CrashRegistry
    from aitune.torch.common.environment import cpu_model_name, native_bf16
    from aitune.torch.search.rankings import RANKINGS_DIR, RankingStore
    from aitune.torch.tuning import cache_dir

    crashes = CrashRegistry(cache_dir() / FILE_NAME)
    rankings = RankingStore(cache_dir() / RANKINGS_DIR, fingerprint=None)
    if getattr(args, "clear_crashes", False) or getattr(args, "clear_rankings", False):
        if getattr(args, "clear_crashes", False):
            print(f"forgot {crashes.clear()} recorded crash(es) ({crashes.path}); they are tried again in later tunes")
        if getattr(args, "clear_rankings", False):
            print(f"forgot {rankings.clear()} ranking(s) of earlier searches ({rankings.root}); later tunes search "
                  "all candidates again")
        return 0

    print(f"aitune {__version__} (independent implementation of the NVIDIA AITune interface)")
    print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA build {torch.version.cuda}, "
          f"CUDA available: {torch.cuda.is_available()}, CPU threads: {torch.get_num_threads()}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        capability = ".".join(map(str, torch.cuda.get_device_capability()))
        print(f"device: {torch.cuda.get_device_name()} (compute capability {capability})")
    else:
        print(f"device: cpu ({cpu_model_name()}, {platform.machine()})")
    if native_bf16(device):
        print("native bf16: yes — an fp32 model's search includes Inductor with bf16 autocast, shown always and "
              "selected only with allow_reduced_precision=True (or allow_quantization=True)")
    else:
        print("native bf16: no — bf16 would be emulated here, so the search adds no bf16 variant")
    from aitune.torch.check.native_watch import native_status

    print(f"aitune's native extension (weight watch, call routes): "
          f"{native_status(build=getattr(args, 'build_native', False))}")
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
    entries = crashes.entries()
    if entries:
        print(f"\ncandidates that crashed their build child in an environment like this one ({crashes.path}); "
              "tunes skip them — `aitune env --clear-crashes` retries them:")
        print(tabulate([[entry["description"], entry["signal"], entry["when"], entry["environment"].get("name"),
                         entry["log"]] for entry in entries],
                       headers=["candidate", "signal", "when", "device", "log"], tablefmt="github"))
    remembered = rankings.records()
    if remembered:
        print(f"\n{len(remembered)} ranking(s) of earlier searches ({rankings.root}): re-tunes of the same graph "
              "rebuild only the earlier winners (the first by speed-up and those tied with it; the selection "
              "settles a tie head to head, so it may have chosen a tied one) — `aitune env --clear-rankings` "
              "searches all candidates again:")
        print(tabulate([[record.get("module"), record.get("graph"), record.get("strategy", ""),
                         record["ranked"][0].get("description"), record.get("when")] for record in remembered],
                       headers=["module", "graph", "strategy", "first by speed-up", "when"], tablefmt="github"))
    return 0


def _unknown_backend(names: list[str] | None) -> str | None:
    """The one-line error for the first unknown backend name (it lists the registered ones), else None."""
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
    from aitune.torch.checkpoint import describe_checkpoint
    from aitune.torch.checkpoint.manifest import read_manifest
    from aitune.torch.report.rows import TuneReport
    from aitune.torch.report.html import REPORT_EXTRA, figures_available

    from aitune.torch.storage import existing_checkpoint

    path = existing_checkpoint(args.file)  # a name given to ait.save is found in checkpoints/
    if not path.exists() and not path.is_absolute():  # a tune report's name is found in <cache>/reports/
        from aitune.torch.tuning import cache_dir

        in_reports = cache_dir() / "reports" / path
        path = in_reports if in_reports.exists() else path
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


def _export(args) -> int:
    """Write a checkpoint's deployment artifacts and a manifest into a new folder (``export_checkpoint``)."""
    from aitune.torch.checkpoint import export_checkpoint
    from aitune.torch.storage import existing_checkpoint

    try:
        result = export_checkpoint(existing_checkpoint(args.checkpoint), args.directory, overwrite=args.overwrite)
    except (AITuneError, OSError) as exc:
        print(f"aitune export: {exc}", file=sys.stderr)
        return 1
    for artifact in result["artifacts"]:
        print(f"{artifact['module']}/{artifact['graph']}: {artifact['backend']} {artifact['format']} -> "
              f"{', '.join(artifact['files'])}")
    for entry in result["left_out"]:
        print(f"{entry['module']}/{entry['graph']}: left out ({entry['reason']})")
    print(Path(args.directory) / "manifest.json")
    return 0


def _key_values(pairs: list[str] | None, option: str) -> dict[str, float]:
    values = {}
    for pair in pairs or []:
        name, sep, value = pair.partition("=")
        try:
            values[name] = float(value) if "." in value or "e" in value.lower() else int(value)
        except ValueError:
            sep = ""
        if not sep or not name:
            raise SystemExit(f"aitune serve: {option} takes NAME=NUMBER, got {pair!r}")
    return values


def _serve(args) -> int:
    import json
    import signal
    import time

    from aitune.serve import ServeConfig, availability, run
    from aitune.torch.storage import existing_checkpoint

    autoscaling = json.loads(args.autoscaling) if args.autoscaling else None
    if args.min_replicas is not None or args.max_replicas is not None:
        autoscaling = dict(autoscaling or {})
        for key, value in (("min_replicas", args.min_replicas), ("max_replicas", args.max_replicas)):
            if value is not None:
                autoscaling[key] = value
    try:
        config = ServeConfig(
            builder=args.builder, checkpoint=str(existing_checkpoint(args.checkpoint)), module=args.module,
            device=args.device,
            on_mismatch=args.on_mismatch, warmup=not args.no_warmup,
            max_batch_size=args.max_batch_size, batch_wait_timeout_ms=args.batch_wait_ms,
            pad_values=_key_values(args.pad, "--pad"), out_of_range=args.out_of_range,
            preprocessor=args.preprocessor, name=args.name, route_prefix=args.route_prefix,
            num_replicas=args.replicas, autoscaling=autoscaling, num_cpus=args.num_cpus, num_gpus=args.num_gpus,
            resources=_key_values(args.resource, "--resource"), max_ongoing_requests=args.max_ongoing_requests,
            health_check_period_s=args.health_check_period_s, health_min_calls=args.health_min_calls)
    except AITuneError as exc:
        print(f"aitune serve: {exc}", file=sys.stderr)
        return 2
    check = availability()
    if not check.ok:
        print(f"aitune serve: Ray Serve is unavailable: {check.reason}", file=sys.stderr)
        return 2
    import ray
    from ray import serve

    from aitune.serve.app import stage_checkpoint

    runtime_env, checkpoint_on_replicas, staged = None, None, None
    if args.ship_checkpoint:  # Ray Serve takes a local working_dir only as the deploying job's runtime_env
        staged = stage_checkpoint(config.checkpoint)
        runtime_env = {"working_dir": str(staged)}
        checkpoint_on_replicas = Path(config.checkpoint).name
    started_here = not ray.is_initialized()
    ray.init(address=args.address, num_cpus=args.ray_num_cpus, include_dashboard=False, runtime_env=runtime_env)

    def stop(_signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 <pid>` prints every thread's Python stack (a stop that hangs)
        import faulthandler

        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        run(config, host=args.host, port=args.port, checkpoint_on_replicas=checkpoint_on_replicas)
        url = f"http://{args.host}:{args.port}{config.route_prefix}"
        replicas = (f"autoscaling {config.autoscaling}" if config.autoscaling
                    else f"{config.num_replicas or 1} replica(s)")
        print(f"aitune serve: {config.name} ({replicas}, {config.num_cpus:g} CPU / {config.num_gpus:g} GPU each) "
              f"answers at {url}\n  POST {{\"inputs\": {{input name: [[...]] | {{\"data\": [[...]], \"dtype\": "
              f"\"int64\"}}}}}}; GET {url} shows the tuned inputs and replica stats. Ctrl-C stops.", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("aitune serve: stopping", flush=True)
        return 0
    except (AITuneError, RuntimeError) as exc:  # a replica that refused to start: Ray Serve reports it here
        print(f"aitune serve: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        try:
            serve.delete(config.name)
        finally:
            if started_here:
                ray.shutdown()
            if staged is not None:
                shutil.rmtree(staged, ignore_errors=True)


def _add_serve_parser(commands) -> None:
    serve = commands.add_parser(
        "serve", help="serve a tuned checkpoint on Ray Serve (pip install 'aitune[serve]')",
        description="Serve BUILDER's model with CHECKPOINT loaded on Ray Serve: each replica builds the model, "
                    "loads the checkpoint (never re-tunes), warms up on the tuned shapes and batches requests up to "
                    "the tuned batch. Starts a local Ray instance unless --address (or RAY_ADDRESS) names a cluster. "
                    "Requests: POST {\"inputs\": {name: tensor}} as JSON (README, section Serve).")
    serve.add_argument("builder", help="package.module:function returning the model in the structure that was saved "
                                       "(e.g. aitune.serve.examples:minilm_encoder)")
    serve.add_argument("checkpoint", help="the .ait file (readable on every node, unless --ship-checkpoint)")
    model = serve.add_argument_group("model")
    model.add_argument("--module", help="the tuned module whose inputs requests carry (default: the saved root)")
    model.add_argument("--device", default="auto", help="auto (default: the replica's GPU if Ray gave it one), cpu, "
                                                        "cuda, cuda:N")
    model.add_argument("--on-mismatch", choices=["refuse", "eager"], default="refuse",
                       help="checkpoint does not fit a replica's machine: refuse to start (default) or serve eagerly")
    model.add_argument("--no-warmup", action="store_true", help="report ready without running the tuned shapes")
    model.add_argument("--ship-checkpoint", action="store_true",
                       help="send the checkpoint to every node in this job's Ray runtime_env (no shared disk needed; "
                            "the builder must then be an installed package)")
    requests = serve.add_argument_group("requests and batching")
    requests.add_argument("--max-batch-size", type=int, help="rows per batch (default: the largest tuned batch)")
    requests.add_argument("--batch-wait-ms", type=float,
                          help="wait to fill a batch (default: the tuned latency of the smallest batch, 1..50 ms)")
    requests.add_argument("--pad", nargs="+", metavar="INPUT=VALUE",
                          help="pad these inputs' dynamic axes with VALUE so requests of other lengths batch together")
    requests.add_argument("--out-of-range", choices=["reject", "eager"], default="reject",
                          help="sizes outside the tuned range: 422 (default) or run them eagerly")
    requests.add_argument("--preprocessor", metavar="MODULE:FUNCTION",
                          help="turns a JSON body without 'inputs' into tensors (e.g. aitune.serve.examples:minilm_texts)")
    scaling = serve.add_argument_group("Ray Serve (what scales)")
    scaling.add_argument("--name", default="aitune", help="application / deployment name (default: aitune)")
    scaling.add_argument("--route-prefix", default="/", help="HTTP route (default: /)")
    scaling.add_argument("--host", default="127.0.0.1", help="HTTP host (default: 127.0.0.1; 0.0.0.0 for all)")
    scaling.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000)")
    scaling.add_argument("--replicas", type=int, help="fixed number of replicas (default: 1)")
    scaling.add_argument("--min-replicas", type=int, help="autoscaling: fewest replicas")
    scaling.add_argument("--max-replicas", type=int, help="autoscaling: most replicas")
    scaling.add_argument("--autoscaling", metavar="JSON", help="Ray Serve autoscaling_config as JSON")
    scaling.add_argument("--num-cpus", type=float, default=1.0, help="logical CPUs per replica (default: 1)")
    scaling.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per replica (default: 0; fractions share)")
    scaling.add_argument("--resource", nargs="+", metavar="NAME=AMOUNT", help="custom Ray resources per replica")
    scaling.add_argument("--max-ongoing-requests", type=int, help="per replica (default: twice the batch, >= 8)")
    scaling.add_argument("--health-check-period-s", type=float, help="Ray Serve's health check period")
    scaling.add_argument("--health-min-calls", type=int, default=3,
                         help="unhealthy when this many calls in a period all fell back to eager (default: 3)")
    scaling.add_argument("--address", help="Ray cluster to join ('auto' for one started with 'ray start'); default: "
                                           "RAY_ADDRESS, else a new local instance")
    scaling.add_argument("--ray-num-cpus", type=int, help="CPUs of a new local Ray instance (default: all)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aitune", description="Tune PyTorch models for inference.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument("--version", action="version", version=f"aitune {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    env = commands.add_parser("env", help="what runs here: every backend's availability, versions, device, and "
                                          "candidates remembered as crashing here")
    env.add_argument("--build-native", action="store_true",
                     help="build aitune's native weight watch now if it is not built yet (NOTE [native watch]; "
                          "otherwise the first tune or load that needs it builds it)")
    env.add_argument("--clear-crashes", action="store_true",
                     help="forget the recorded crashes (their candidates are tried again)")
    env.add_argument("--clear-rankings", action="store_true",
                     help="forget the rankings of earlier searches (re-tunes search all candidates again)")
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
    export = commands.add_parser(
        "export", help="write a .ait checkpoint's deployment artifacts (ONNX, .pt2, TensorRT engine) and a manifest",
        description="Write the files another runtime needs to serve each tuned graph without aitune into "
                    "DIR/<module>/<graph>/ and DIR/manifest.json (tensor names, dtypes, shape bounds, batch axis, "
                    "runtime options; graphs left out with the reason). Digests are verified; nothing is unpickled.")
    export.add_argument("checkpoint", metavar="CHECKPOINT", help="the .ait file")
    export.add_argument("directory", metavar="DIR", help="a new or empty folder")
    export.add_argument("--overwrite", action="store_true",
                        help="allow a non-empty DIR; only the files the export writes are replaced")
    _add_serve_parser(commands)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("torch", "onnxscript", "onnx_ir", "torchao", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    handlers = {"env": _env, "demo": _demo, "report": _report, "export": _export, "serve": _serve}
    try:
        return handlers[args.command](args)
    except BrokenPipeError:  # `aitune env | head`: the reader left; as the Python docs advise for SIGPIPE
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes stdout at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())

