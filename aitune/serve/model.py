"""One replica's model, without Ray: build, load the checkpoint (never tune), warm up, run batches, count.

:class:`ServedModel` is what the Ray Serve deployment (:mod:`aitune.serve.deployment`) holds; it has no Ray
dependency so that it can be checked on its own.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

import aitune.torch as ait
from aitune.errors import (
    CheckpointError,
    CheckpointIntegrityError,
    CheckpointVersionError,
    RequestError,
    ServeError,
)
from aitune.serve.batching import ModelCall, OutputNotSplittable, plan_calls, split_outputs
from aitune.serve.builder import build_model, load_object, resolve_device
from aitune.serve.config import ServeConfig
from aitune.serve.fit import FitProblem, fit_problems, read_manifest, served_module_entry
from aitune.serve.inputs import PreparedRequest, TunedInputs
from aitune.torch.checkpoint import describe_checkpoint, find_wrappers
from aitune.torch.measure.profiling import percentile
from aitune.torch.record.pytree import tree_flatten, tree_unflatten

logger = logging.getLogger(__name__)

_LATENCY_WINDOW = 2048  # requests kept for the p50/p90 in stats() (Ray's Histogram keeps them all)
_DEFAULT_WAIT_MS = 10.0  # Ray Serve's own default batch_wait_timeout_s, when the checkpoint has no timing


class RoutingCounter:
    """Which tuned backend serves each graph, and how many calls tuned backends answered.

    NOTE [counting fallbacks]: ``ait.Module.backend_calls`` counts the calls a tuned backend answered (a call
    the guard checked counts when the backend's answer was kept); a served call for which it did not move ran
    eagerly (input outside the artifact's range, untuned structure, a backend error, a backend the guard
    retired in favour of eager). Graphs for which tuning chose eager are ``passthrough``: their calls are not
    fallbacks.
    """

    def __init__(self, wrapper: Any):
        self.wrapper = wrapper
        self.backends: dict[str, str] = {}
        self.passthrough: set[str] = set()
        if wrapper is None:
            return
        for graph_name, backend in wrapper.backends.items():
            self.backends[graph_name] = backend.name
            if getattr(backend, "passthrough", False):
                self.passthrough.add(graph_name)

    @property
    def backend_calls(self) -> int:
        return self.wrapper.backend_calls if self.wrapper is not None else 0


@dataclasses.dataclass
class Answer:
    """One request's answer.

    Attributes:
        output: the module's output for the request's rows (CPU tensors, structured like the module's).
        backend: what ran the call (the tuned backend's name, or ``"eager"``).
        rows / requests: rows and requests of the model call that answered it (batching at work).
    """

    output: Any
    backend: str
    rows: int
    requests: int


class ServedModel:
    """The model of one replica.

    Builds the user's model with ``config.builder``, checks that the checkpoint fits this machine
    (:func:`~aitune.serve.fit.fit_problems`), loads it with :func:`aitune.torch.load` (digests, device and
    architecture checks; never tunes), and warms up on every recorded shape.

    Args:
        config: the :class:`~aitune.serve.config.ServeConfig`.
        gpu_ids: the GPUs Ray assigned to this replica (``ray.get_gpu_ids()``).
        replica: a name for logs and :meth:`stats` (Ray's replica id).
        on_call: called after every model call (not during warm-up) with ``(rows, requests, ran_tuned,
            fell_back)``: the deployment records Ray metrics with it.

    Raises:
        ServeError: the checkpoint does not fit and ``on_mismatch="refuse"``; warm-up on the tuned shapes ran
            eagerly with ``on_mismatch="refuse"``; the builder raised.
        CheckpointError (and subclasses): the checkpoint is corrupted, missing, or does not fit the model.
        ConfigError: the builder or preprocessor cannot be imported; a pad value names no input.
    """

    def __init__(self, config: ServeConfig, gpu_ids: list | tuple = (), replica: str = "",
                 on_call: Callable[[int, int, bool, bool], None] | None = None):
        started = time.perf_counter()
        self._on_call = None
        self.config = config
        self.replica = replica or f"pid{os.getpid()}"
        self.device = resolve_device(config.device, gpu_ids)
        checkpoint = Path(config.checkpoint)
        manifest = read_manifest(checkpoint)
        entry = served_module_entry(manifest, config.module)
        self.inputs = TunedInputs(entry, config.pad_values, config.out_of_range)
        self.preprocessor = load_object(config.preprocessor, "preprocessor") if config.preprocessor else None
        self.problems = fit_problems(manifest, self.device)
        self._refuse_if(self.problems, checkpoint)
        load_problems = self.problems
        if any(problem.build_mode == "device" for problem in self.problems):
            self.device = torch.device("cpu")  # on_mismatch="eager": the device is missing, the CPU is not
            load_problems = fit_problems(manifest, self.device)
            self._refuse_if(load_problems, checkpoint)
            self.problems = self.problems + load_problems
        model = build_model(config.builder, self.device)
        self.mode = "tuned"
        if any(problem.build_mode != "jit" for problem in load_problems):
            describe_checkpoint(checkpoint, verify=True)  # a corrupted checkpoint is refused, even to run eagerly
            self.root, self.wrapper, self.mode = model, None, "eager"
        else:
            self.root, self.wrapper = self._load(model, checkpoint, entry)
            if self.wrapper is None:
                self.mode = "eager"
            elif load_problems:
                self.mode = "partly eager"
        self.counter = RoutingCounter(self.wrapper)
        self.max_batch_rows = config.max_batch_size or self.inputs.max_rows
        tuned_ms = self.inputs.tuned_latency_ms
        wait_ms = config.batch_wait_timeout_ms
        if wait_ms is None:
            # A request alone would have been answered in about the smallest batch's latency: waiting longer
            # than that to fill a batch only adds latency at low load.
            wait_ms = _DEFAULT_WAIT_MS if tuned_ms is None else min(max(tuned_ms, 1.0), 50.0)
        self.batch_wait_timeout_s = wait_ms / 1000.0
        self.batching = self.max_batch_rows > 1
        self._lock = threading.Lock()
        self._reset_stats()
        if config.warmup:
            self._warm_up()
            self._reset_stats()
        self._on_call = on_call
        self.ready_s = time.perf_counter() - started
        logger.info("aitune serve: replica %s ready in %.1f s on %s, mode %s, backends %s, batches of up to %d rows "
                    "(wait %.1f ms)%s", self.replica, self.ready_s, self.device, self.mode, self.counter.backends or "-",
                    self.max_batch_rows if self.batching else 1, wait_ms,
                    "" if self.batching else " — batching off")

    # ---- start
    def _refuse_if(self, problems: list[FitProblem], checkpoint: Path) -> None:
        if not problems:
            return
        text = "; ".join(map(str, problems))
        if self.config.on_mismatch == "refuse":
            raise ServeError(f"checkpoint {checkpoint} does not fit this replica (device {self.device}): {text}. "
                             "Serve it on the kind of machine it was tuned on, re-tune here, or pass "
                             "on_mismatch='eager' (--on-mismatch eager) to serve the model eagerly")
        logger.warning("aitune serve: checkpoint %s does not fit this replica (device %s): %s. on_mismatch='eager': "
                       "the affected graphs run eagerly (slower than tuned)", checkpoint, self.device, text)

    def _load(self, model: Any, checkpoint: Path, entry: dict) -> tuple[Any, Any]:
        """``ait.load`` the checkpoint into ``model``; returns (root, served wrapper).

        A load that fails for a reason the fit check could not see beforehand (a backend's runtime that cannot
        restore its artifact here) is a mismatch too: refused, or with ``on_mismatch="eager"`` the builder's
        model is served eagerly (wrapper None). A corrupted or newer-format checkpoint is always refused.
        """
        try:
            root = ait.load(model, checkpoint, device=self.device)
        except (CheckpointIntegrityError, CheckpointVersionError):
            raise
        except CheckpointError as exc:
            if self.config.on_mismatch == "refuse":
                raise
            self.problems = self.problems + [FitProblem("load", str(exc), "aot")]
            logger.warning("aitune serve: ait.load failed here (%s); on_mismatch='eager': serving the builder's "
                           "model eagerly", exc)
            return model, None
        return root, self._find_wrapper(root, entry)

    def _find_wrapper(self, root: Any, entry: dict) -> Any:
        found = find_wrappers(root)
        for candidate in found:
            if candidate.path == entry.get("path") or candidate.wrapper.name == entry.get("name"):
                return candidate.wrapper
        raise ServeError(f"after ait.load, no tuned module {entry.get('name')!r} was found in the builder's "
                         f"{type(root).__name__} (found: {[c.wrapper.name for c in found]})")

    def _warm_up(self) -> None:
        """Every recorded shape once, alone, then batched; checks routing and that batching keeps the answers.

        A warm-up call on a tuned shape that runs eagerly means the checkpoint does not work here: refused
        (``on_mismatch="refuse"``) or logged. When batched answers differ from single ones beyond the dtype's
        tolerance, or outputs cannot be split by rows (NOTE [outputs split along axis 0]), batching is turned off.
        """
        requests = self._recorded_requests()
        singles = []
        for request in requests:
            before = self.counter.backend_calls
            result = self.run_batch([request])[0]
            if isinstance(result, Exception):
                raise ServeError(f"warm-up: the model raised on a recorded input of {request.graph.name}: {result}")
            ran_tuned = self.counter.backend_calls > before
            if self._expects_tuned(request.graph.name, request.in_range) and not ran_tuned:
                message = (f"warm-up: a recorded (tuned) input of {self.inputs.module_name}/{request.graph.name} ran "
                           f"eagerly instead of on '{request.graph.backend}' (the module's warning above says why)")
                if self.config.on_mismatch == "refuse":
                    raise ServeError(message + "; pass on_mismatch='eager' to serve anyway")
                logger.warning("aitune serve: %s", message)
            singles.append(result)
        if not self.batching or len(requests) < 2:
            return
        batched = self.run_batch(requests)
        if not self.batching:
            return  # outputs not splittable: run_batch turned batching off and said why
        for request, single, together in zip(requests, singles, batched):
            problem = _difference(single.output, together.output)
            if problem:
                self.batching = False
                logger.warning("aitune serve: batched answers of %s differ from single-call answers (%s); batching "
                               "off (check pad_values: padding must not change the answers)", request.graph.name,
                               problem)
                return

    def _recorded_requests(self) -> list[PreparedRequest]:
        if self.wrapper is None:
            return []
        by_name = {graph.name: graph for graph in self.inputs.graphs}
        requests = []
        for graph in self.wrapper.graphs:
            inputs_graph = by_name.get(graph.name)
            if inputs_graph is None:
                continue
            for sample in graph.samples:
                leaves = tree_flatten((sample.args, sample.kwargs))[0]
                inputs = {path: leaves[spec.leaf_index].cpu() for path, spec in inputs_graph.tensors.items()}
                requests.append(self.inputs.prepare(inputs, field=f"warm-up {graph.name}"))
        return requests

    def _expects_tuned(self, graph_name: str, in_range: bool) -> bool:
        """Should a call on this graph run on a tuned backend (not eager by choice, by mismatch or by range)?"""
        return (self.mode != "eager" and in_range and graph_name in self.counter.backends
                and graph_name not in self.counter.passthrough)

    # ---- requests
    def prepare(self, body: Any) -> PreparedRequest:
        """Check a request body: ``{"inputs": {...}}`` (or, with a preprocessor, what it takes).

        Raises:
            RequestError: 400 for a body that is not the documented form; 422 as ``TunedInputs.prepare``.
        """
        if isinstance(body, dict) and set(body) == {"inputs"}:
            return self.inputs.prepare(body["inputs"])
        if isinstance(body, dict) and self.preprocessor is not None and "inputs" not in body:
            try:
                inputs = self.preprocessor(body)
            except RequestError:
                raise
            except Exception as exc:  # noqa: BLE001 - the user's preprocessor: its message, as a 422
                raise RequestError(f"the preprocessor rejected the body: {type(exc).__name__}: {exc}") from exc
            return self.inputs.prepare(inputs, field="preprocessed inputs")
        form = '{"inputs": {input name: tensor}}' + (" or the preprocessor's form" if self.preprocessor else "")
        got = sorted(body) if isinstance(body, dict) else type(body).__name__
        raise RequestError(f"the request body must be a JSON object {form}; got {got}", status=400)

    def run_batch(self, requests: list[PreparedRequest]) -> list[Any]:
        """Run checked requests, as few model calls as the tuned shapes allow.

        Returns:
            One entry per request: an :class:`Answer` (its output on the CPU, structured like the module's), or
            a :class:`RequestError` (422) when the model raised on that request alone — a request that fails
            never fails the others batched with it (they are run again one by one).
        """
        results: list[Any] = [None] * len(requests)
        with self._lock:
            for call in plan_calls(requests, self.inputs.pad_values, self.max_batch_rows if self.batching else 1):
                self._run_call(call, requests, results)
        return results

    def _run_call(self, call: ModelCall, requests: list[PreparedRequest], results: list[Any]) -> None:
        try:
            output, ran_tuned = self._call(call)
            outputs = split_outputs(output, call)
        except OutputNotSplittable as exc:
            self.batching = False
            logger.warning("aitune serve: batching off: %s (NOTE [outputs split along axis 0])", exc)
            outputs = None
        except Exception as exc:  # noqa: BLE001 - a request that breaks the model gets a 422, the replica lives
            if len(call.members) == 1:
                results[call.members[0][0]] = RequestError(
                    f"the model raised {type(exc).__name__} on this request: {str(exc).strip()[:300]}")
                self._stats["model_errors"] += 1
                return
            outputs = None
        if outputs is None:  # run the members one by one: each gets its own answer or error
            for index, rows in call.members:
                request = requests[index]
                self._run_call(ModelCall(call.graph, [(index, rows)], request.tensors, rows, request.in_range),
                               requests, results)
            return
        ran = self.counter.backends.get(call.graph.name, "eager") if ran_tuned else "eager"
        for (index, _), output in zip(call.members, outputs):
            results[index] = Answer(output, ran, call.rows, len(call.members))

    def _call(self, call: ModelCall) -> tuple[Any, bool]:
        """Run one call; returns its output (on the CPU) and whether a tuned backend answered it."""
        tensors = {path: tensor.to(self.device) for path, tensor in call.tensors.items()}
        args, kwargs = call.graph.call_arguments(tensors)
        before = self.counter.backend_calls
        with torch.no_grad():
            output = self.root(*args, **kwargs)
        ran_tuned = self.counter.backend_calls > before
        stats = self._stats
        stats["calls"] += 1
        stats["rows"][call.rows] += 1
        stats["requests_per_call"][len(call.members)] += 1
        if ran_tuned:
            stats["tuned_calls"] += 1
        fell_back = False
        if self._expects_tuned(call.graph.name, call.in_range):
            stats["expected_tuned"] += 1
            self._window_expected += 1
            if ran_tuned:
                self._window_tuned += 1
            else:
                stats["fallback_calls"] += 1
                fell_back = True
        if self._on_call is not None:
            self._on_call(call.rows, len(call.members), ran_tuned, fell_back)
        return _to_cpu(output), ran_tuned

    # ---- health and stats
    def health_problem(self) -> str | None:
        """Why this replica should be replaced, or None; starts a new window of calls.

        Unhealthy when at least ``health_min_calls`` calls since the previous check should have run on a tuned
        backend and every one of them ran eagerly (a guard tripped, the backend keeps failing).
        """
        expected, tuned = self._window_expected, self._window_tuned
        self._window_expected = self._window_tuned = 0
        if self.wrapper is not None and self.wrapper.state is not ait.ModuleState.TUNED:
            return f"the served module {self.wrapper.name!r} is no longer tuned (state: {self.wrapper.state.value})"
        if expected >= self.config.health_min_calls and tuned == 0:
            return (f"every one of the last {expected} calls of {self.inputs.module_name!r} ran eagerly instead of on "
                    f"its tuned backend(s) {self.counter.backends} (a guard tripped or the backend fails; the module's "
                    "warning in the replica log says which)")
        return None

    def record_request(self, latency_ms: float, status: int) -> None:
        """Record one answered request (the deployment measures from arrival to answer)."""
        self._latencies.append(latency_ms)
        self._stats["status"][status] += 1

    def stats(self) -> dict:
        """JSON-able counters since warm-up: requests by status, p50/p90 latency (ms, last 2048 requests),
        model calls, rows and requests per call, calls on the tuned backend, eager fallbacks."""
        latencies = list(self._latencies)
        stats = self._stats
        return {
            "replica": self.replica, "pid": os.getpid(), "device": str(self.device), "mode": self.mode,
            "problems": [str(problem) for problem in self.problems], "module": self.inputs.module_name,
            "backends": dict(self.counter.backends), "batching": self.batching,
            "max_batch_size": self.max_batch_rows, "batch_wait_timeout_ms": self.batch_wait_timeout_s * 1000.0,
            "ready_s": getattr(self, "ready_s", None),
            "requests": {str(code): count for code, count in sorted(stats["status"].items())},
            "latency_ms": {"p50": percentile(latencies, 50) if latencies else None,
                           "p90": percentile(latencies, 90) if latencies else None, "count": len(latencies)},
            "calls": stats["calls"], "tuned_calls": stats["tuned_calls"], "fallback_calls": stats["fallback_calls"],
            "model_errors": stats["model_errors"],
            "rows_per_call": {str(rows): count for rows, count in sorted(stats["rows"].items())},
            "requests_per_call": {str(n): count for n, count in sorted(stats["requests_per_call"].items())},
        }

    def _reset_stats(self) -> None:
        self._stats = {"calls": 0, "tuned_calls": 0, "expected_tuned": 0, "fallback_calls": 0, "model_errors": 0,
                       "rows": collections.Counter(), "requests_per_call": collections.Counter(),
                       "status": collections.Counter()}
        self._latencies: collections.deque = collections.deque(maxlen=_LATENCY_WINDOW)
        self._window_expected = self._window_tuned = 0


def _to_cpu(value: Any) -> Any:
    leaves, spec = tree_flatten(value)
    if not any(isinstance(leaf, torch.Tensor) and leaf.device.type != "cpu" for leaf in leaves):
        return value
    return tree_unflatten(spec, [leaf.cpu() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves])


def _difference(expected: Any, actual: Any) -> str | None:
    """Where two outputs of the same request differ beyond the dtype's tolerance (fp32 1e-4/1e-3, else 1e-2)."""
    expected_leaves, _ = tree_flatten(expected)
    actual_leaves, _ = tree_flatten(actual)
    if len(expected_leaves) != len(actual_leaves):
        return "different output structure"
    for index, (a, b) in enumerate(zip(expected_leaves, actual_leaves)):
        if not isinstance(a, torch.Tensor):
            continue
        if not isinstance(b, torch.Tensor) or a.shape != b.shape:
            return f"output leaf {index}: shape {list(a.shape)} vs {list(getattr(b, 'shape', []))}"
        if a.is_floating_point():
            atol, rtol = (1e-4, 1e-3) if a.dtype in (torch.float32, torch.float64) else (1e-2, 1e-2)
            if not torch.allclose(a, b, atol=atol, rtol=rtol, equal_nan=True):
                return f"output leaf {index}: max abs difference {float((a - b).abs().max()):.3g}"
        elif not torch.equal(a, b):
            return f"output leaf {index}: values differ"
    return None
