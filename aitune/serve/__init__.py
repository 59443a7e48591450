"""Serve tuned checkpoints on Ray Serve (``pip install 'aitune[serve]'``).

``build_app(ServeConfig(builder="pkg.mod:build_model", checkpoint="model.ait"))`` is a Ray Serve application:
every replica builds the model with the builder, *loads* the checkpoint (``ait.load``: digests, device and
architecture checks; never tunes), warms up on the tuned shapes, batches requests with Ray Serve's own
batching up to the tuned batch, answers JSON over HTTP and tensors over handles, reports health and metrics.
``aitune serve BUILDER CHECKPOINT`` does the same from the command line.

Only :class:`ServeConfig`, the request checks and the JSON tensor form are importable without Ray; the
functions that need Ray raise :class:`~aitune.errors.BackendUnavailableError` with the fix when it is missing.
"""

from __future__ import annotations

from aitune.errors import BackendUnavailableError, RequestError
from aitune.serve.config import ServeConfig
from aitune.serve.tensors import tensor_from_json, to_json
from aitune.torch.backend.base import Check, Requirement, check_requirements

# Ray Serve's batch_size_fn (batches counted in rows) is what ties a batch to the tuned batch range; 2.60 is
# the version this was built and tested with.
REQUIREMENTS = (Requirement("ray", ("ray",), "serve", "2.60"), Requirement("starlette", ("starlette",), "serve"))

__all__ = ["REQUIREMENTS", "RequestError", "ServeConfig", "availability", "build_app", "run",
           "tensor_from_json", "to_json"]


def availability() -> Check:
    """Is Ray Serve importable and new enough (cached, silent)."""
    return check_requirements(REQUIREMENTS)


def _require_ray() -> None:
    check = availability()
    if not check.ok:
        raise BackendUnavailableError(f"aitune serve is unavailable: {check.reason}")


def build_app(config: ServeConfig, *, checkpoint_on_replicas: str | None = None):
    """The Ray Serve application for ``config``; see :func:`aitune.serve.app.build_app`.

    Raises:
        BackendUnavailableError: Ray Serve is not installed (``pip install 'aitune[serve]'``).
    """
    _require_ray()
    from aitune.serve import app  # optional dependency: imported only when Ray is there

    return app.build_app(config, checkpoint_on_replicas=checkpoint_on_replicas)


def run(config: ServeConfig, *, host: str = "127.0.0.1", port: int = 8000, blocking: bool = False,
        checkpoint_on_replicas: str | None = None):
    """Deploy on the connected Ray cluster and return the handle; see :func:`aitune.serve.app.run`."""
    _require_ray()
    from aitune.serve import app

    return app.run(config, host=host, port=port, blocking=blocking, checkpoint_on_replicas=checkpoint_on_replicas)
