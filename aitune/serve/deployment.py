"""The Ray Serve deployment: a :class:`~aitune.serve.model.ServedModel` per replica, behind HTTP and handles.

Ray Serve does the distributed work: replicas on the nodes of a Ray cluster (``num_replicas``, or
``autoscaling``), CPU/GPU accounting per replica, routing, HTTP, health checks, replacing replicas that die
or fail their checks, request batching (``@serve.batch``) and metrics export. This module only fills in
what a tuned checkpoint knows: the batch range, the batch wait, the inputs requests must fit, and whether the
tuned backend is still answering.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray
from ray import serve
from ray.serve.metrics import Counter, Histogram
from starlette.requests import Request
from starlette.responses import JSONResponse

from aitune.errors import RequestError
from aitune.serve.config import ServeConfig
from aitune.serve.inputs import PreparedRequest
from aitune.serve.model import Answer, ServedModel
from aitune.serve.tensors import to_json

logger = logging.getLogger(__name__)

LATENCY_BOUNDARIES_MS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]
ROWS_BOUNDARIES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def request_rows(requests: list[PreparedRequest]) -> int:
    """Ray Serve's ``batch_size_fn``: a batch's size is its rows, so ``max_batch_size`` is the tuned batch."""
    return sum(request.rows for request in requests)


@serve.deployment
class TunedModelDeployment:
    """A tuned checkpoint served by Ray Serve (one instance per replica).

    HTTP (any route under the application's prefix):
        ``POST`` a JSON body ``{"inputs": {input name: tensor}}`` (:mod:`aitune.serve.tensors` for the tensor
        form) -> 200 ``{"outputs": ..., "served": {"replica", "backend", "batch_rows", "batch_requests"}}``
        (what answered it: the replica, the tuned backend or ``"eager"``, the model call's rows and requests);
        400 (not that form) or 422 (does not fit the tuned inputs, or the model raised on it) ->
        ``{"error": message, "field": "inputs.<name>"}``. ``GET`` -> the tuned inputs and this replica's
        :meth:`stats`.

    Python (a ``DeploymentHandle``, in the cluster):
        ``handle.infer.remote({input name: torch.Tensor | JSON tensor})`` -> the module's output (tensors on
        the CPU); a bad request raises :class:`~aitune.errors.RequestError`. ``handle.stats.remote()``.

    Args:
        config: ``ServeConfig.to_dict()``.
    """

    def __init__(self, config: dict):
        self.config = ServeConfig.from_dict(config)
        context = serve.get_replica_context()
        replica = getattr(context, "replica_tag", "") or str(getattr(context, "replica_id", ""))
        self._latency = Histogram("aitune_serve_request_latency_ms", boundaries=LATENCY_BOUNDARIES_MS,
                                  description="Request latency in the replica, arrival to answer (ms)",
                                  tag_keys=("status",))
        self._rows = Histogram("aitune_serve_batch_rows", boundaries=ROWS_BOUNDARIES,
                               description="Rows per model call (the batch size the tuned module ran)")
        self._requests_per_call = Histogram("aitune_serve_requests_per_call", boundaries=ROWS_BOUNDARIES,
                                            description="Requests answered by one model call")
        self._fallbacks = Counter("aitune_serve_eager_fallbacks",
                                  description="Model calls that should have run on the tuned backend and ran eagerly")
        self._tuned_calls = Counter("aitune_serve_tuned_calls", description="Model calls the tuned backend answered")
        self.model = ServedModel(self.config, gpu_ids=ray.get_gpu_ids(), replica=replica,
                                 on_call=self._record_call)
        self._configure_batching()

    def _configure_batching(self) -> None:
        self._run_batch.set_max_batch_size(self.model.max_batch_rows if self.model.batching else 1)
        self._run_batch.set_batch_wait_timeout_s(self.model.batch_wait_timeout_s if self.model.batching else 0.0)

    def _record_call(self, rows: int, requests: int, ran_tuned: bool, fell_back: bool) -> None:
        self._rows.observe(rows)
        self._requests_per_call.observe(requests)
        if ran_tuned:
            self._tuned_calls.inc()
        if fell_back:
            self._fallbacks.inc()

    # ---- requests
    async def __call__(self, request: Request) -> JSONResponse:
        started = time.perf_counter()
        if request.method == "GET":
            return JSONResponse({"inputs": self.model.inputs.describe(), "stats": self.model.stats()})
        try:
            try:
                body = await request.json()
            except ValueError as exc:
                raise RequestError(f"the request body is not JSON ({exc})", status=400) from exc
            answer = await self._answer(self.model.prepare(body))
            status = 200
            payload = {"outputs": to_json(answer.output),
                       "served": {"replica": self.model.replica, "backend": answer.backend, "batch_rows": answer.rows,
                                  "batch_requests": answer.requests}}
        except RequestError as exc:
            status, payload = exc.status, {"error": str(exc), "field": exc.field}
        self._finish(started, status)
        return JSONResponse(payload, status_code=status)

    async def infer(self, inputs: dict) -> Any:
        """The Python path: ``{input name: tensor}`` -> the module's output for it (CPU tensors).

        Raises:
            RequestError: as the HTTP path's 400/422 answers.
        """
        started = time.perf_counter()
        try:
            answer = await self._answer(self.model.prepare({"inputs": inputs}))
        except RequestError as exc:
            self._finish(started, exc.status)
            raise
        self._finish(started, 200)
        return answer.output

    async def _answer(self, request: PreparedRequest) -> Answer:
        if self.model.batching and request.rows <= self.model.max_batch_rows:
            result = await self._run_batch(request)
        else:  # batching off, or more rows than a batch holds (out_of_range="eager"): a call of its own
            result = (await asyncio.to_thread(self.model.run_batch, [request]))[0]
        if isinstance(result, Exception):
            raise result
        return result

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.01, batch_size_fn=request_rows)
    async def _run_batch(self, requests: list[PreparedRequest]) -> list[Any]:
        # The model runs in a worker thread (torch releases the GIL), so the replica keeps accepting and
        # checking requests, which fill the next batch meanwhile; ServedModel runs one call at a time.
        batching = self.model.batching
        results = await asyncio.to_thread(self.model.run_batch, requests)
        if batching and not self.model.batching:
            self._configure_batching()
        return results

    def _finish(self, started: float, status: int) -> None:
        latency_ms = (time.perf_counter() - started) * 1000.0
        self.model.record_request(latency_ms, status)
        self._latency.observe(latency_ms, tags={"status": str(status)})

    # ---- health and stats
    def check_health(self) -> None:
        """Ray Serve calls this every ``health_check_period_s``; raising makes Serve replace the replica."""
        problem = self.model.health_problem()
        if problem:
            logger.error("aitune serve: replica %s is unhealthy: %s", self.model.replica, problem)
            raise RuntimeError(problem)

    def stats(self) -> dict:
        """This replica's counters (:meth:`aitune.serve.model.ServedModel.stats`)."""
        return self.model.stats()
