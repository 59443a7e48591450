"""The served call's fast paths against the general ones, side by side in one process (small MLP, this CPU).

A plain Inductor JIT build of a small MLP (batch 4, fp32) is tuned once; then, interleaved in rounds (the order
rotating, 300 timed calls per path per round, grad mode off; ``benchmarks.wrapper_cost.timed_rounds``, its
warm-up first):

- ``direct``: the backend's compiled callable, called with the canonical call it was warmed up on;
- ``tuned``: the tuned module as users call it (NOTE [a bare served call] in aitune/torch/backend/inductor_jit.py,
  and the value gate's finite-only fast path, ``ValueGate.finite_only`` in aitune/torch/backend/accepted.py);
- ``general``: the same module with both fast paths switched off (``_bare`` and ``finite_only`` False): the
  contexts around the compiled callable and the value gate's general loops, as before they existed.

Printed: each path's median of per-round medians (host µs per call), the median and quartiles of the per-round
differences to ``direct``, and of ``general - tuned`` (what the fast paths save, paired round by round).
Usage (repo root): ``PYTHONPATH=. python -m benchmarks.served_call_ab``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys

import torch

import aitune.torch as ait
from aitune.torch.backend import TorchInductorJitBackend, TorchInductorJitBackendConfig
from benchmarks.wrapper_cost import small_mlp, timed_rounds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=300, help="timed calls per path per round")
    args = parser.parse_args(argv)
    model, x = small_mlp("cpu")
    strategy = ait.OneBackendStrategy(TorchInductorJitBackend(TorchInductorJitBackendConfig()))
    tuned = ait.Module(model, "served-call-ab", strategy=strategy.enable_performance_validation(False))
    ait.tune(lambda batch: tuned(batch), [x], ready_batches=True, progress=False)
    dispatch = tuned._self_dispatch
    entry = dispatch.graphs[0]
    backend, gate = entry.backend, entry.values
    canonical_args, canonical_kwargs = dispatch.signature.normalize((x,), {})
    fast = (backend._bare, gate.finite_only if gate is not None else None)

    @contextlib.contextmanager
    def general_paths():
        backend._bare = False
        if gate is not None:
            gate.finite_only = False
        try:
            yield
        finally:
            backend._bare = fast[0]
            if gate is not None:
                gate.finite_only = fast[1]

    paths = {"direct": lambda: backend._compiled(*canonical_args, **canonical_kwargs),
             "tuned": lambda: tuned(x), "general": lambda: tuned(x)}
    print(f"# fast paths: bare served call {fast[0]}, finite-only value gate {fast[1]}; torch {torch.__version__}")
    with torch.no_grad():
        samples = timed_rounds(paths, args.rounds, args.calls, cuda=False, contexts={"general": general_paths})
    medians = {name: [statistics.median(values[start:start + args.calls])
                      for start in range(0, len(values), args.calls)] for name, values in samples.items()}
    saved = [slow - fast_ for slow, fast_ in zip(medians["general"], medians["tuned"])]
    quartiles = statistics.quantiles(saved, n=4)
    print(f"the fast paths save {statistics.median(saved):.2f} µs per call (median of the per-round differences "
          f"general - tuned; quartiles {quartiles[0]:.2f} / {quartiles[2]:.2f}; {sum(d > 0 for d in saved)} of "
          f"{len(saved)} rounds positive)")
    for name, values in medians.items():
        differences = [value - base for value, base in zip(values, medians["direct"])]
        quartiles = statistics.quantiles(differences, n=4)
        print(f"{name:8s} {statistics.median(values):8.2f} µs   over direct: median "
              f"{statistics.median(differences):6.2f}  (quartiles {quartiles[0]:.2f} / {quartiles[2]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
