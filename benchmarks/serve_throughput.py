"""Requests/s and p50/p90 latency of the MiniLM sentence encoder served by ``aitune serve`` on Ray Serve:
batching on vs off, 1 vs 2 replicas, on this machine, over real HTTP.

Each configuration is deployed on one local Ray instance, warmed up, then driven by closed-loop clients
(each sends one sentence's token ids, waits for the answer, sends the next) for a fixed time. Latency is
measured by the clients (request sent -> answer read, HTTP proxy included). Clients, the HTTP proxy and the
replicas share the machine's cores: on a 2-core machine the figures say how the pieces compare, not what a
cluster would do.

    python -m benchmarks.serve_throughput [--checkpoint minilm.ait] [--clients 16] [--seconds 15] [--rounds 2]
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import logging
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import ray
import torch
from ray import serve
from tabulate import tabulate

import aitune.torch as ait
from aitune.demo import SENTENCES, make_batches
from aitune.serve import ServeConfig, run
from aitune.serve.examples import MINILM_PAD_VALUES, minilm_encoder, minilm_tokenizer
from aitune.torch.backend import get_backend_class
from aitune.torch.measure.profiling import percentile

CONFIGURATIONS = [  # (replicas, batching)
    (1, False), (1, True), (2, False), (2, True),
]


def tune_checkpoint(path: Path, backend: str, intra_op_threads: int | None) -> Path:
    """MiniLM tuned as ``aitune demo --backends <backend>`` tunes it (batches 1/4/8, up to 128 tokens)."""
    backend_class = get_backend_class(backend)
    config = backend_class.config_class(intra_op_num_threads=intra_op_threads) if intra_op_threads else None
    strategy = ait.OneBackendStrategy(backend_class(config))
    strategy.enable_performance_validation(False)
    encoder = ait.Module(minilm_encoder(), "minilm", strategy=strategy)
    ait.tune(lambda batch: encoder(**batch), make_batches(minilm_tokenizer(), SENTENCES),
             cache_dir_path=path.parent / "cache", ready_batches=True)
    return ait.save(encoder, path)


def request_bodies(fixed_tokens: int | None = None) -> list[bytes]:
    """One body per sentence: its own token ids, unpadded (7 to ~45 tokens), or padded by the client to
    ``fixed_tokens`` (one shape for every request, as fixed-shape serving does)."""
    tokenizer = minilm_tokenizer()
    bodies = []
    for sentence in SENTENCES:
        padding = "max_length" if fixed_tokens else False
        tokens = tokenizer(sentence, truncation=True, max_length=fixed_tokens or 128, padding=padding)
        inputs = {name: [tokens[name]] for name in ("input_ids", "attention_mask", "token_type_ids")}
        bodies.append(json.dumps({"inputs": inputs}).encode())
    return bodies


def drive(port: int, route: str, bodies: list[bytes], clients: int, seconds: float, warmup_s: float) -> dict:
    """Closed-loop clients for ``warmup_s + seconds``; figures over the last ``seconds`` only."""
    latencies: list[float] = []
    errors = [0]
    batch_sizes: list[int] = []
    lock = threading.Lock()
    started = time.perf_counter()
    measure_from, stop_at = started + warmup_s, started + warmup_s + seconds

    def client(number: int) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        index = number
        while True:
            now = time.perf_counter()
            if now >= stop_at:
                break
            body = bodies[index % len(bodies)]
            index += clients
            try:
                connection.request("POST", route, body, {"content-type": "application/json"})
                response = connection.getresponse()
                payload = json.loads(response.read())
                ok = response.status == 200
            except (OSError, http.client.HTTPException, ValueError):
                connection.close()
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                ok, payload = False, {}
            done = time.perf_counter()
            if now >= measure_from:
                with lock:
                    if ok:
                        latencies.append((done - now) * 1000.0)
                        batch_sizes.append(payload["served"]["batch_requests"])
                    else:
                        errors[0] += 1
        connection.close()

    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"requests": len(latencies), "errors": errors[0], "requests_per_s": len(latencies) / seconds,
            "p50_ms": percentile(latencies, 50), "p90_ms": percentile(latencies, 90),
            "mean_requests_per_call": sum(batch_sizes) / max(len(batch_sizes), 1)}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, help="a MiniLM checkpoint (default: tune one with --backend)")
    parser.add_argument("--backend", default="onnxruntime", help="backend to tune with (default: onnxruntime)")
    parser.add_argument("--intra-op-threads", type=int,
                        help="ONNX Runtime threads per replica, baked into the tuned checkpoint (default: one per core)")
    parser.add_argument("--fixed-tokens", type=int, help="clients pad every request to this many tokens")
    parser.add_argument("--clients", type=int, default=16, help="concurrent closed-loop clients (default: 16)")
    parser.add_argument("--seconds", type=float, default=15.0, help="measured seconds per configuration")
    parser.add_argument("--rounds", type=int, default=2, help="times each configuration is measured (default: 2)")
    parser.add_argument("--warmup-s", type=float, default=3.0, help="unmeasured seconds before (default: 3)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    workdir = Path(tempfile.mkdtemp(prefix="aitune-serve-bench-"))
    checkpoint = args.checkpoint or tune_checkpoint(workdir / "minilm.ait", args.backend, args.intra_op_threads)
    bodies = request_bodies(args.fixed_tokens)
    port = free_port()
    load = os.getloadavg()[0]
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=128 * 2**20)
    results = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # Rounds go through every configuration in turn, so that the load of a shared machine drifting over
        # minutes spreads over all of them instead of favouring the ones measured first.
        for round_index in range(args.rounds):
            for replicas, batching in CONFIGURATIONS:
                config = ServeConfig(builder="aitune.serve.examples:minilm_encoder", checkpoint=str(checkpoint),
                                     pad_values=MINILM_PAD_VALUES, num_replicas=replicas, num_cpus=1.0,
                                     max_batch_size=None if batching else 1, name="bench", route_prefix="/bench")
                deployed = time.perf_counter()
                handle = run(config, port=port)
                ready_s = time.perf_counter() - deployed
                stats = handle.stats.remote().result()
                figures = drive(port, "/bench", bodies, args.clients, args.seconds, args.warmup_s)
                figures.update(round=round_index, replicas=replicas, batching=batching, ready_s=ready_s,
                               max_batch_size=stats["max_batch_size"] if batching else 1,
                               batch_wait_ms=stats["batch_wait_timeout_ms"] if batching else 0.0)
                results.append(figures)
                print(json.dumps(figures), flush=True)
                serve.delete("bench")
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)
    rows = []
    for replicas, batching in CONFIGURATIONS:
        runs = [r for r in results if r["replicas"] == replicas and r["batching"] == batching]
        rates = sorted(r["requests_per_s"] for r in runs)
        rows.append([replicas, "on" if batching else "off", runs[0]["max_batch_size"], f"{runs[0]['batch_wait_ms']:.1f}",
                     f"{statistics.median(rates):.1f}", f"{min(rates):.1f}-{max(rates):.1f}",
                     f"{statistics.median(r['p50_ms'] for r in runs):.0f}",
                     f"{statistics.median(r['p90_ms'] for r in runs):.0f}",
                     f"{statistics.median(r['mean_requests_per_call'] for r in runs):.2f}",
                     sum(r["errors"] for r in runs)])
    header = (f"MiniLM on Ray Serve, {args.clients} closed-loop HTTP clients, {args.seconds:g} s per configuration, "
              f"checkpoint {checkpoint.name} ({args.backend if not args.checkpoint else 'given'}, "
              f"intra-op threads {args.intra_op_threads or 'default'}); requests of "
              f"{f'{args.fixed_tokens} tokens (client-padded)' if args.fixed_tokens else 'each sentence its own length'}; "
              f"{os.cpu_count()} CPUs, load average {load:.2f} at start; torch {torch.__version__}, ray {ray.__version__}")
    print("\n" + header)
    print(tabulate(rows, headers=["replicas", "batching", "max batch", "wait ms", "requests/s (median)",
                                  "requests/s (rounds)", "p50 ms", "p90 ms", "requests per call", "errors"],
                   tablefmt="github"))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"date": datetime.date.today().isoformat(), "header": header,
                                         "command": " ".join(["python -m benchmarks.serve_throughput", *sys.argv[1:]]),
                                         "platform": platform.platform(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
